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

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux /proc only")

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
