"""Celery tasks: the thin layer between the database and the measurement library.

measure_run(run_id): claim the run (compare-and-set), build the job from the database,
measure in a child process (worker/runner.py), write each cell as soon as it is measured,
honour the cancel flag between cells, finish the run once. A redelivered task for a run
that another live worker holds, or that is finished, does nothing.
"""
from __future__ import annotations

import logging
import time

from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded
from celery.signals import worker_ready

from worker.runner import ChildFailed, log_tail, run_job_in_child

log = logging.getLogger(__name__)


def execute_run(run_id: int, host: str | None = None, progress=None) -> str | None:
    """Measure one run to its end. Returns its final state, or None if not ours."""
    from django.conf import settings

    from leaderboard import runs
    from leaderboard.models import Run

    run = runs.claim(run_id, host or runs.worker_host())
    if run is None:
        log.info("run %s: not claimed (finished, cancelled or held by a live worker)", run_id)
        return None
    log_path = runs.run_log_path(run)
    started, measured = time.monotonic(), 0

    def on_event(event):
        nonlocal measured
        if isinstance(event, dict) and event.get("type") == "started":
            runs.record_started(run, event)
            return
        runs.record_cell(run, event)
        measured += 1
        runs.update_progress(run, measured, started)
        if progress:
            progress(run)

    def should_stop():
        # Called after every cell and every couple of seconds: a heartbeat, and the flag.
        return runs.heartbeat_and_cancel_flag(run)

    try:
        job = runs.build_job(run)
        outcome = run_job_in_child(job, log_path, on_event, should_stop)
    except SoftTimeLimitExceeded:
        minutes = round(settings.RUN_SOFT_LIMIT_S / 60)
        runs.finish(run, Run.FAILED, f"timed out after {minutes} minutes", log_tail(log_path))
        return Run.FAILED
    except ChildFailed as e:
        runs.finish(run, Run.FAILED, e.message, e.log_tail)
        return Run.FAILED
    except Exception as e:  # noqa: BLE001 - any failure is written on the run
        log.exception("run %s failed", run_id)
        runs.finish(run, Run.FAILED, f"{type(e).__name__}: {e}", log_tail(log_path))
        return Run.FAILED
    if outcome == "stopped":
        runs.finish(run, Run.CANCELLED, "cancelled by request", log_tail(log_path))
        return Run.CANCELLED
    runs.finish(run, Run.SUCCEEDED, tail=log_tail(log_path))
    return Run.SUCCEEDED


@shared_task(name="worker.measure_run", acks_late=True)
def measure_run(run_id: int):
    from celery import current_task

    host = getattr(current_task.request, "hostname", None)
    from leaderboard.runs import worker_host

    return execute_run(run_id, host=f"{host or 'worker'}|{worker_host()}")


@worker_ready.connect
def resume_stale_runs(sender=None, **_):
    """A worker that starts takes over runs whose worker died mid-run on its queues (their
    heartbeat went stale): it sends them again; the claim makes a duplicate a no-op, and the
    run measures only its missing cells."""
    from django.conf import settings

    from leaderboard.models import Run

    queues = [q.name for q in sender.app.amqp.queues.consume_from.values()] if sender else []
    for run in Run.objects.filter(state=Run.RUNNING, hardware__in=queues):
        measure_run.apply_async(args=[run.pk], queue=run.hardware,
                                countdown=settings.RUN_STALE_AFTER_S + 1)
        log.info("run %s: running; sent again in %ss, taken over only if its heartbeat is "
                 "stale by then (its worker stopped)", run.pk, settings.RUN_STALE_AFTER_S + 1)
    # Queued runs whose message was lost (the embedded broker keeps no unacked messages
    # across a kill) are sent again; a duplicate is a no-op.
    for run in Run.objects.filter(state=Run.QUEUED, hardware__in=queues):
        measure_run.apply_async(args=[run.pk], queue=run.hardware)
