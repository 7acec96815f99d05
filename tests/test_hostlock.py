"""The host lock (worker.hostlock) against a real second process holding it."""
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from worker.hostlock import HostLock, is_held, wait_until_free

ROOT = Path(__file__).resolve().parent.parent

HOLDER = """
import sys
from worker.hostlock import HostLock
with HostLock(sys.argv[1], what="test holder"):
    print("held", flush=True)
    sys.stdin.readline()
print("released", flush=True)
"""


@pytest.fixture
def holder(tmp_path):
    """A second process that holds the lock until told (a line on its stdin)."""
    path = tmp_path / "locks" / "host.lock"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield path, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def test_a_free_lock_is_not_held(tmp_path):
    path = tmp_path / "host.lock"
    assert not is_held(path)                    # no file yet
    assert wait_until_free(path, 0)
    with HostLock(path, log=lambda m: pytest.fail(f"should not wait: {m}")):
        assert is_held(path)                    # another open file sees it held
        assert f"pid {os.getpid()}" in path.read_text()
    assert not is_held(path)
    assert path.read_text() == ""               # the holder's note goes with the lock


def test_waiting_for_a_lock_held_by_another_process(holder):
    path, proc = holder
    assert is_held(path)
    assert f"pid {proc.pid} (test holder)" in path.read_text()
    t0 = time.monotonic()
    assert not wait_until_free(path, 0.3)
    assert time.monotonic() - t0 >= 0.3

    lines, acquired = [], threading.Event()

    def take():
        with HostLock(path, log=lines.append, poll_s=0.05, what="the test"):
            acquired.set()
            assert f"pid {os.getpid()} (the test)" in path.read_text()

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    time.sleep(0.5)
    assert not acquired.is_set()                # blocked while the other process holds it
    assert len(lines) == 1                      # logged once, not per poll
    assert f"held by pid {proc.pid} (test holder)" in lines[0]
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "released"
    thread.join(timeout=10)
    assert acquired.is_set() and not thread.is_alive()
    assert len(lines) == 1
    assert not is_held(path)


def test_a_killed_holder_leaves_no_stale_lock(holder):
    path, proc = holder
    assert is_held(path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert wait_until_free(path, 5)
    with HostLock(path, log=lambda m: pytest.fail(f"should not wait: {m}")):
        assert is_held(path)
