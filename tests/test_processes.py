"""worker/processes.py: stop_process_group ends a real process group, grandchildren
included, escalating to SIGKILL for a member that ignores SIGTERM."""
import os
import signal
import subprocess
import sys
import textwrap
import time

from worker.processes import stop_process_group

# A leader that starts a grandchild (which ignores SIGTERM when asked to), prints its pid
# and waits.
LEADER = textwrap.dedent("""
    import subprocess, sys, time
    child = ("import signal, sys, time\\n"
             "if sys.argv[1] == 'stubborn': signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
             "print('ready', flush=True)\\n"
             "time.sleep(120)\\n")
    grandchild = subprocess.Popen([sys.executable, "-c", child, sys.argv[1]],
                                  stdout=subprocess.PIPE, text=True)
    grandchild.stdout.readline()
    print(grandchild.pid, flush=True)
    time.sleep(120)
""")


def start_group(kind):
    proc = subprocess.Popen([sys.executable, "-c", LEADER, kind], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    return proc, int(proc.stdout.readline())


def alive(pid):
    """Running, as opposed to ended (gone, or a zombie that its new parent, init, has not
    waited for yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sigterm_ends_the_group_grandchild_included():
    proc, grandchild = start_group("polite")
    assert alive(grandchild)
    started = time.monotonic()
    assert stop_process_group(proc, term_timeout=20, kill_timeout=5)
    assert time.monotonic() - started < 10  # no need to wait for SIGKILL
    assert proc.returncode == -15 and not alive(grandchild)


def test_a_stopped_member_ends_on_sigterm_too():
    # an engine frozen out of its turn (fair turns) is a stopped process: SIGTERM alone
    # would wait until it is continued
    proc, grandchild = start_group("polite")
    os.kill(grandchild, signal.SIGSTOP)
    started = time.monotonic()
    assert stop_process_group(proc, term_timeout=20, kill_timeout=5)
    assert time.monotonic() - started < 10  # no need to wait for SIGKILL
    assert not alive(grandchild)


def test_a_member_that_ignores_sigterm_gets_sigkill():
    proc, grandchild = start_group("stubborn")
    started = time.monotonic()
    assert stop_process_group(proc, term_timeout=1, kill_timeout=10)
    assert time.monotonic() - started >= 1
    assert proc.returncode == -15 and not alive(grandchild)


def test_sigkill_at_once_and_groups_already_gone():
    first, first_grandchild = start_group("stubborn")
    second, second_grandchild = start_group("polite")
    assert stop_process_group(first, second, term_timeout=None, kill_timeout=10)
    assert first.returncode == second.returncode == -9
    assert not alive(first_grandchild) and not alive(second_grandchild)
    # again: both leaders were waited for, so nothing is signalled and all is well
    assert stop_process_group(first, second, term_timeout=1, kill_timeout=1)
    # a group whose leader exited by itself, not yet waited for
    done = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    while alive(done.pid):
        time.sleep(0.01)
    assert stop_process_group(done) and done.returncode == 0
