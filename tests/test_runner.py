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


def _nothing_to_measure_job():
    from worker.measure import DrafterSpec, MeasureJob, PromptItem
    from worker.protocol import ProtocolSpec, TaskSpec

    spec = ProtocolSpec(slug="p", version=1, target="t", target_sha256="", engine="vllm",
                        hardware="cpu", tasks=(TaskSpec("chat", "s", "", 2),),
                        batch_sizes=(1, 2), ks=(2,))
    prompts = {"chat": [PromptItem("1", ["hi"]), PromptItem("2", ["ho"])]}
    skip = frozenset(c.key for c in spec.run_cells("baseline"))
    return MeasureJob(spec, "/nonexistent-target", DrafterSpec("baseline"), prompts, skip)


def test_the_child_holds_the_host_lock_and_waits_for_it(tmp_path):
    import threading
    import time

    from worker.hostlock import HostLock

    lock_path = tmp_path / "host.lock"
    events, outcome = [], {}
    held = HostLock(lock_path, log=lambda m: None)
    held.acquire()
    worker = threading.Thread(target=lambda: outcome.setdefault("result", run_job_in_child(
        _nothing_to_measure_job(), tmp_path / "run.log", events.append, lambda: False,
        poll_seconds=0.2, host_lock_path=str(lock_path))))
    worker.start()
    deadline = time.monotonic() + 60
    while not events and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [e["type"] for e in events] == ["started"]
    time.sleep(2.0)
    assert worker.is_alive(), "the child measured while another process held the host lock"
    held.release()
    worker.join(60)
    assert outcome.get("result") == "done"
    assert "host" in (tmp_path / "run.log").read_text().lower()
