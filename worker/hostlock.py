"""A host lock: one measurement at a time on a host (``fcntl.flock`` on a file).

The holder writes its pid and what it runs into the file, so a waiter can say whom it waits
for. The lock belongs to the open file description: it is released when the holder closes
the file or exits (also when killed), so a crashed holder never leaves a stale lock. The
file itself stays; its content is only informative.
"""
from __future__ import annotations

import fcntl
import os
import sys
import time
from pathlib import Path

DEFAULT_POLL_S = 0.5


def _holder(path) -> str:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return "unknown"
    return text or "unknown"


def _try_lock(fd) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except (BlockingIOError, PermissionError):
        return False


class HostLock:
    """Hold the host lock at ``path`` for the ``with`` block; blocks while another process
    holds it, logging once "waiting for the host lock held by pid N (what)". ``what`` is
    written into the file with the pid (default: this process's command line); ``name`` is
    what the message calls the lock (the same kind of lock guards other single-writer work)."""

    def __init__(self, path, log=print, poll_s: float = DEFAULT_POLL_S, what: str | None = None,
                 name: str = "host lock"):
        self.path = Path(path)
        self.name = name
        self.log = log
        self.poll_s = poll_s
        self.what = what if what is not None else " ".join(sys.argv) or "python"
        self._fd = None

    def acquire(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not _try_lock(fd):
                self.log(f"waiting for the {self.name} {self.path} held by {_holder(self.path)}")
                while not _try_lock(fd):
                    time.sleep(self.poll_s)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} ({self.what})\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def release(self):
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        except OSError:
            pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
        return False


def is_held(path) -> bool:
    """Whether another open file holds the host lock at ``path`` now (non-blocking probe;
    False when the file does not exist)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        if _try_lock(fd):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        return True
    finally:
        os.close(fd)


def wait_until_free(path, timeout_s: float, poll_s: float = 0.2) -> bool:
    """Wait up to ``timeout_s`` seconds for the host lock at ``path`` to be free. True when
    it is free (it is not taken: a measurement may start right after), False on timeout."""
    deadline = time.monotonic() + max(timeout_s, 0)
    while is_held(path):
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(poll_s, max(deadline - time.monotonic(), 0.0)) or poll_s)
    return True
