"""The Celery task: fetch the run by id and let the run service measure it
(leaderboard/services/runs.py). Its name, MEASURE_RUN, says where it lives."""
from __future__ import annotations

from celery import current_task, shared_task
from celery.signals import worker_ready

from .celery import MEASURE_RUN
from .services import runs


@shared_task(name=MEASURE_RUN, acks_late=True)
def measure_run(run_id: int):
    host = getattr(current_task.request, "hostname", None) or "worker"
    return runs.execute_run(run_id, host=f"{host}|{runs.worker_host()}")


@worker_ready.connect
def resend_unfinished_runs(sender=None, **_):
    queues = [q.name for q in sender.app.amqp.queues.consume_from.values()] if sender else []
    runs.resend_unfinished_runs(queues)
