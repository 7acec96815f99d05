"""Runs a measurement in a child process, so that an engine crash (or a segfault in a
kernel) cannot take the Celery worker with it. The child streams events back: one
``started`` dict, then one CellResult per cell; the parent writes them to the database.

The child is a fresh interpreter (``python -m worker.runner``), not a multiprocessing
child: Celery's prefork pool processes are daemonic and may not have multiprocessing
children, and vLLM spawns an engine-core process of its own. The child leads its own
session, so the parent can end the whole tree on cancel or time-out, and the child ends
its group if the parent dies (a worker killed with SIGKILL must not leave an engine running).
"""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection
from pathlib import Path

from worker.processes import stop_process_group

ROOT = Path(__file__).resolve().parent.parent


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
            # Not stop_process_group: the parent is gone, so the child ends its own group
            # (itself included) from inside, at once.
            os.killpg(0, signal.SIGKILL)
        time.sleep(1.0)


def _child_main(events_fd: int, parent_pid: int):
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    events = Connection(events_fd, readable=False)
    job, host_lock_path = pickle.load(sys.stdin.buffer)
    from worker.measure import iter_cells

    try:
        for event in iter_cells(job, log=lambda m: print(m, flush=True),
                                host_lock_path=host_lock_path):
            events.send(event)
        events.send({"type": "done"})
    except BaseException as e:  # noqa: BLE001 - everything must reach the parent
        traceback.print_exc()
        events.send({"type": "error", "message": f"{type(e).__name__}: {e}"})
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _wait_quietly(process, seconds):
    try:
        process.wait(seconds)
    except subprocess.TimeoutExpired:
        pass


def run_job_in_child(job, log_path, on_event, should_stop, poll_seconds=2.0,
                     host_lock_path=None):
    """Measure `job` in a child process. Calls on_event(event) for each event and
    should_stop() between events and every poll; returns "done" or "stopped". With
    ``host_lock_path`` the child holds the host lock (worker.hostlock) while it measures.
    Raises ChildFailed when the measurement fails or the child dies."""
    read_fd, write_fd = os.pipe()
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "worker.runner", str(write_fd), str(os.getpid())],
            stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
            pass_fds=(write_fd,), start_new_session=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    os.close(write_fd)
    events = Connection(read_fd, writable=False)
    try:
        process.stdin.write(pickle.dumps((job, host_lock_path)))
        process.stdin.close()
        while True:
            if not events.poll(poll_seconds):
                if should_stop():
                    return "stopped"
                if process.poll() is not None:
                    raise ChildFailed(
                        f"the measurement process died (exit code {process.returncode})",
                        log_tail(log_path))
                continue
            try:
                event = events.recv()
            except EOFError:
                _wait_quietly(process, 30)
                raise ChildFailed(
                    f"the measurement process died (exit code {process.returncode})",
                    log_tail(log_path)) from None
            if isinstance(event, dict) and event.get("type") == "done":
                _wait_quietly(process, 60)  # the engine shuts down; the group is ended below
                return "done"
            if isinstance(event, dict) and event.get("type") == "error":
                raise ChildFailed(event["message"], log_tail(log_path))
            on_event(event)
            if should_stop():
                return "stopped"
    finally:
        events.close()
        stop_process_group(process, term_timeout=10, kill_timeout=5)


if __name__ == "__main__":
    _child_main(int(sys.argv[1]), int(sys.argv[2]))
