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
