"""The Celery tasks: measure a run (leaderboard/services/runs.py), on the queue of its
hardware class; check a submission (leaderboard/services/intake.py), on the ``intake``
queue. Their names, MEASURE_RUN and CHECK_SUBMISSION, say where they live."""
from __future__ import annotations

from celery import current_task, shared_task
from celery.signals import worker_ready

from .celery import CHECK_SUBMISSION, INTAKE_QUEUE, MEASURE_RUN
from .services import intake, runs


@shared_task(name=MEASURE_RUN, acks_late=True)
def measure_run(run_id: int):
    host = getattr(current_task.request, "hostname", None) or "worker"
    return runs.execute_run(run_id, host=f"{host}|{runs.worker_host()}")


@shared_task(name=CHECK_SUBMISSION, acks_late=True)
def check_submission(submission_id: int):
    submission = intake.check(submission_id)
    return submission.state if submission is not None else None


@worker_ready.connect
def resend_unfinished_work(sender=None, **_):
    queues = [q.name for q in sender.app.amqp.queues.consume_from.values()] if sender else []
    runs.resend_unfinished_runs(queues)
    if INTAKE_QUEUE in queues:
        intake.resend_unchecked()
