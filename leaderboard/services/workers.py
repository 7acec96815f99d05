"""Measurement workers announce themselves (EngineWorker): when a Celery worker is ready
(leaderboard/tasks.py) it writes its hardware class, engine and engine version and the queues
it consumes; a thread of its main process and its runs' heartbeats keep it seen; it is deleted
when the worker stops. One killed without a word stops being seen and counts as gone after
settings.RUN_STALE_AFTER_S (selectors/runs.py live_workers), so the queue page can say which
queue no worker serves."""
from __future__ import annotations

import logging
import platform
import threading
import time

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection
from django.utils import timezone

from worker.engines.vllm_engine import ENGINE_NAME, package_versions

from .. import queues as queue_names
from ..celery import INTAKE_QUEUE
from ..models import EngineWorker

log = logging.getLogger(__name__)

# Queues that measure nothing: the submissions' checks, and Celery's default.
NOT_MEASURING = (INTAKE_QUEUE, "celery")


def touch_interval_s() -> float:
    """How often a worker says it is alive: four times within the time after which it
    counts as gone, so a late touch or two never makes a live worker look dead."""
    return max(settings.RUN_STALE_AFTER_S / 4, 1.0)


def measuring_queues(queues) -> list[str]:
    return [q for q in queues if q not in NOT_MEASURING]


def announce(hostname: str, queues) -> EngineWorker | None:
    """Record the worker `hostname` (its Celery node name) that consumes `queues`, with what
    its environment holds (leaderboard.queues: the installed engine version). None for a
    worker that measures nothing (the intake worker)."""
    measuring = measuring_queues(queues)
    if not measuring:
        return None
    now = timezone.now()
    worker, _ = EngineWorker.objects.update_or_create(hostname=hostname, defaults=dict(
        # the hardware class a queue belongs to: the part before its engine (engine_queue)
        hardware=measuring[0].split(".")[0], engine=ENGINE_NAME,
        engine_version=queue_names.installed_engine_version() or "", queues=list(measuring),
        python_version=platform.python_version(), torch_version=package_versions()["torch"] or "",
        started_at=now, last_seen_at=now))
    log.info("worker %s announced: %s %s on %s, queues %s", hostname, worker.engine,
             worker.engine_version or "(none installed)", worker.hardware, ",".join(measuring))
    return worker


def seen(hostname: str) -> bool:
    """The worker is alive now. False when it is not recorded (it measures nothing)."""
    return bool(EngineWorker.objects.filter(hostname=hostname).update(
        last_seen_at=timezone.now()))


def gone(hostname: str) -> None:
    """The worker stops (a warm shutdown)."""
    EngineWorker.objects.filter(hostname=hostname).delete()


# When each worker was last touched by a run heartbeat in this process (seen_from_run).
_last_touch: dict[str, float] = {}


def seen_from_run(worker_host: str) -> None:
    """A run heartbeat of the worker (Run.worker_host, "celery node|host:pid" as the task
    writes it): it is seen, at most once per touch_interval_s (the heartbeat comes every few
    seconds, this write need not)."""
    hostname = worker_host.split("|", 1)[0] if "|" in worker_host else ""
    now = time.monotonic()
    if not hostname or now - _last_touch.get(hostname, -1e9) < touch_interval_s():
        return
    _last_touch[hostname] = now
    seen(hostname)


def keep_seen(hostname: str) -> threading.Event:
    """Start a daemon thread that marks the worker seen every touch_interval_s, idle or
    measuring (its runs run in other processes), until the returned event is set. A database
    that does not answer is tried again at the next touch."""
    stop = threading.Event()

    def loop():
        while not stop.wait(touch_interval_s()):
            try:
                seen(hostname)
            except (OperationalError, InterfaceError) as e:
                log.warning("worker %s: could not mark it seen (%s)", hostname, e)
                try:
                    connection.close()
                except (OperationalError, InterfaceError):
                    pass
        connection.close()

    threading.Thread(target=loop, name=f"seen-{hostname}", daemon=True).start()
    return stop
