"""Ending a process tree. Every long-running child the project starts (the measurement child
of a Celery task, the processes of ``make run``, the servers of tests and benchmarks) leads
its own process group (``subprocess.Popen(..., start_new_session=True)``), so that one
signal to the group reaches whatever it started in turn (vLLM's engine core, Celery's pool)."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

POLL_SECONDS = 0.05


def stop_process_group(*procs, term_timeout: float | None = 10.0,
                       kill_timeout: float = 5.0) -> bool:
    """End the process group that each ``subprocess.Popen`` of ``procs`` leads: SIGTERM (and
    SIGCONT, for a stopped member) to the groups, up to ``term_timeout`` seconds for all
    their members to exit, then SIGKILL to the groups with members left and up to
    ``kill_timeout`` seconds more.
    ``term_timeout=None`` sends SIGKILL at once (an abrupt end, as in a crash).

    A group already gone is fine. A leader already waited for (``returncode`` set) is left
    alone: its id may belong to another process group by now. Returns whether every group
    has ended."""
    groups = {p.pid: p for p in procs if p.returncode is None}
    if term_timeout is not None:
        _signal(groups, signal.SIGTERM)
        # A stopped member (an engine frozen out of its turn: ProtocolSpec.fair_turns)
        # acts on SIGTERM only once continued.
        _signal(groups, signal.SIGCONT)
        _wait(groups, term_timeout)
    _signal(groups, signal.SIGKILL)
    _wait(groups, kill_timeout)
    return not groups


def _signal(groups: dict, sig) -> None:
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # ended already, or no longer ours


def _wait(groups: dict, seconds: float) -> None:
    """Drop from ``groups`` each group whose leader has exited (and is waited for) and
    that has no live member left, for up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while groups:
        for pgid, proc in list(groups.items()):
            if proc.poll() is not None and not _has_live_members(pgid):
                del groups[pgid]
        if not groups or time.monotonic() >= deadline:
            return
        time.sleep(POLL_SECONDS)


def _has_live_members(pgid: int) -> bool:
    """Whether the group still has a member that has not exited. A zombie (exited, not yet
    waited for by its parent: an orphan waits for init) still counts for ``killpg``, so
    Linux's /proc tells them apart; without /proc every member counts."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    if not Path("/proc/self/stat").exists():
        return True
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # the process ended while we looked
        if int(group) == pgid and state != "Z":
            return True
    return False
