import os

import pytest

from worker.runner import ChildFailed, run_job_in_child


def test_a_failing_measurement_reaches_the_parent_with_its_reason_and_log(tmp_path):
    events = []
    with pytest.raises(ChildFailed) as info:
        run_job_in_child("not a job", tmp_path / "run.log", events.append, lambda: False,
                         poll_seconds=0.5)
    assert "AttributeError" in info.value.message
    assert "Traceback" in info.value.log_tail  # the child's output is the run's log
    assert events == []


def runner_children():
    """This process's measurement children (``python -m worker.runner FD PARENT``) that are
    still running."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"worker.runner" in cmdline and str(os.getpid()).encode() in cmdline and state != "Z":
            found.append(int(pid))
    return found


def test_a_stopped_measurement_ends_the_child_before_returning(tmp_path):
    outcome = run_job_in_child("not a job", tmp_path / "run.log", lambda e: None, lambda: True,
                               poll_seconds=0.01)
    assert outcome == "stopped"
    assert runner_children() == []
