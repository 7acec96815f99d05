"""The Celery tasks: measure a run (leaderboard/services/runs.py), on its queue (its
protocol's hardware class, engine and engine version: Run.queue); check a submission
(leaderboard/services/intake.py), on the ``intake`` queue. Their names, MEASURE_RUN and
CHECK_SUBMISSION, say where they live. A measurement worker announces itself when it is
ready and is forgotten when it stops (leaderboard/services/workers.py)."""
from __future__ import annotations

from celery import current_task, shared_task
from celery.signals import worker_ready, worker_shutdown

from .celery import CHECK_SUBMISSION, INTAKE_QUEUE, MEASURE_RUN
from .services import intake, runs, workers


@shared_task(name=MEASURE_RUN, acks_late=True)
def measure_run(run_id: int):
    host = getattr(current_task.request, "hostname", None) or "worker"
    return runs.execute_run(run_id, host=f"{host}|{runs.worker_host()}", resend_refused=True)


@shared_task(name=CHECK_SUBMISSION, acks_late=True)
def check_submission(submission_id: int):
    submission = intake.check(submission_id)
    return submission.state if submission is not None else None


# The thread that keeps this worker seen (services/workers.keep_seen), stopped at shutdown.
_keep_seen = {}


@worker_ready.connect
def resend_unfinished_work(sender=None, **_):
    queues = [q.name for q in sender.app.amqp.queues.consume_from.values()] if sender else []
    runs.resend_unfinished_runs(queues)
    if INTAKE_QUEUE in queues:
        intake.resend_unchecked()
    if sender is not None and workers.announce(sender.hostname, queues) is not None:
        _keep_seen[sender.hostname] = workers.keep_seen(sender.hostname)


@worker_shutdown.connect
def forget_worker(sender=None, **_):
    hostname = getattr(sender, "hostname", None)
    if hostname:
        stop = _keep_seen.pop(hostname, None)
        if stop is not None:
            stop.set()
        workers.gone(hostname)
