"""Runs a measurement in a child process, so that an engine crash (or a segfault in a
kernel) cannot take the Celery worker with it. The child streams events back: one
``started`` dict, then one CellResult per cell; the parent writes them to the database.

The child leads its own process group (vLLM spawns an engine-core process of its own), so
the parent can end the whole tree on cancel or time-out, and the child ends its group if
the parent dies (a worker killed with SIGKILL must not leave an engine running).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections import deque


class ChildFailed(Exception):
    def __init__(self, message, log_tail=""):
        super().__init__(message)
        self.message, self.log_tail = message, log_tail


def log_tail(path, lines=60):
    try:
        with open(path, "r", errors="replace") as f:
            return "".join(deque(f, maxlen=lines))
    except OSError:
        return ""


def _watch_parent(parent_pid):
    while True:
        if os.getppid() != parent_pid:
            os.killpg(0, signal.SIGKILL)
        time.sleep(1.0)


def _child_main(job, events, log_path, parent_pid):
    os.setpgid(0, 0)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    # Everything the engine prints (its own processes too) goes to the run's log file.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    from worker.measure import iter_cells

    try:
        for event in iter_cells(job, log=lambda m: print(m, flush=True)):
            events.put(event)
        events.put({"type": "done"})
    except BaseException as e:  # noqa: BLE001 - everything must reach the parent
        traceback.print_exc()
        events.put({"type": "error", "message": f"{type(e).__name__}: {e}"})
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _end_group(process):
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
    process.join(10)
    if process.is_alive():
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        process.join(5)


def run_job_in_child(job, log_path, on_event, should_stop, poll_seconds=2.0):
    """Measure `job` in a child process. Calls on_event(event) for each event and
    should_stop() between events and every poll; returns "done" or "stopped".
    Raises ChildFailed when the measurement fails or the child dies."""
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    process = ctx.Process(target=_child_main, args=(job, events, str(log_path), os.getpid()),
                          name="specboard-measure", daemon=False)
    process.start()
    try:
        while True:
            try:
                event = events.get(timeout=poll_seconds)
            except queue.Empty:
                if should_stop():
                    return "stopped"
                if not process.is_alive():
                    raise ChildFailed(
                        f"the measurement process died (exit code {process.exitcode})",
                        log_tail(log_path))
                continue
            if isinstance(event, dict) and event.get("type") == "done":
                process.join(30)
                return "done"
            if isinstance(event, dict) and event.get("type") == "error":
                raise ChildFailed(event["message"], log_tail(log_path))
            on_event(event)
            if should_stop():
                return "stopped"
    finally:
        if process.is_alive():
            _end_group(process)
