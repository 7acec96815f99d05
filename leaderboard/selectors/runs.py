"""Reads of runs: the queue (positions, progress, the workers that serve it) and the API's
run list."""
from __future__ import annotations

from collections import Counter
from datetime import timedelta

from django.conf import settings
from django.db.models import F
from django.utils import timezone

from worker.protocol import cell_key

from ..models import EngineWorker, Result, Run
from ..permissions import REJECTED
from ..queues import start_worker_command
from .shapes import filtered, protocol_ref_lookups, run_progress_summary, run_summary


def visible(qs, show_rejected: bool):
    """Runs, without those of rejected drafters unless ``show_rejected`` (staff:
    leaderboard.permissions.sees_rejected): a rejection hides the drafter everywhere."""
    return qs if show_rejected else qs.exclude(drafter__review_state=REJECTED)


def queue_positions(run_ids=None) -> dict[int, int]:
    """Position of each queued run in its queue (Run.queue: hardware class, and engine
    version where the protocol pins one): 1 + the runs queued earlier on the same queue that
    are still waiting. One query."""
    positions, seen = {}, Counter()
    for pk, queue_name in (Run.objects.filter(state=Run.QUEUED)
                           .order_by("queued_at", "pk").values_list("pk", "queue")):
        seen[queue_name] += 1
        positions[pk] = seen[queue_name]
    if run_ids is not None:
        positions = {pk: p for pk, p in positions.items() if pk in set(run_ids)}
    return positions


def worker_summary(worker: EngineWorker, live_since) -> dict:
    return {"hostname": worker.hostname, "hardware": worker.hardware, "engine": worker.engine,
            "engine_version": worker.engine_version, "queues": list(worker.queues),
            "python_version": worker.python_version, "torch_version": worker.torch_version,
            "started_at": worker.started_at, "last_seen_at": worker.last_seen_at,
            "live": worker.last_seen_at >= live_since}


def workers(live_only: bool = True) -> list[dict]:
    """The measurement workers that announced themselves (EngineWorker), by hardware class,
    engine and version; "live": seen within settings.RUN_STALE_AFTER_S (one killed without
    a word stops being seen). `live_only`: only those. One query."""
    live_since = timezone.now() - timedelta(seconds=settings.RUN_STALE_AFTER_S)
    qs = EngineWorker.objects.all()
    if live_only:
        qs = qs.filter(last_seen_at__gte=live_since)
    return [worker_summary(w, live_since) for w in qs]


def start_worker_hint(queue_name: str, hardware: str, engine_version: str | None) -> str:
    """How to start a worker that serves `queue_name` (leaderboard.queues)."""
    return start_worker_command(hardware, engine_version, queue_name)


def queue_coverage(active_runs, live: list[dict]) -> list[dict]:
    """For every queue with runs waiting or running: how many, the live workers that consume
    it, and, where none does, how to start one."""
    queues = {}
    for r in active_runs:
        entry = queues.setdefault(r.queue, {
            "queue": r.queue, "hardware": r.hardware,
            "engine_version": r.protocol.spec.engine_version or "",
            "waiting": 0, "running": 0, "workers": []})
        entry["waiting" if r.state == Run.QUEUED else "running"] += 1
    for name, entry in queues.items():
        entry["workers"] = [w["hostname"] for w in live if name in w["queues"]]
        entry["hint"] = ("" if entry["workers"] else
                         start_worker_hint(name, entry["hardware"], entry["engine_version"]))
    return [queues[name] for name in sorted(queues)]


def queue(hardware: str | None = None, finished_limit: int = 50,
          show_rejected: bool = False) -> dict:
    """Every queued and running run (running first, then queued in queue order), the most
    recently finished ones (failed runs keep their error and log tail), the live workers and
    which of them serve each queue that has runs waiting. Four queries.

    Returns {"active": [run_summary], "finished": [run_summary], "hardware": [...],
    "workers": [worker_summary], "queues": [queue_coverage]}."""
    base = visible(Run.objects.select_related("drafter", "drafter__owner", "protocol"),
                   show_rejected)
    if hardware:
        base = base.filter(hardware=hardware)
    positions = queue_positions()
    active = list(base.filter(state__in=[Run.QUEUED, Run.RUNNING])
                  .order_by("queued_at", "pk"))
    active.sort(key=lambda r: (r.state != Run.RUNNING, r.queue, positions.get(r.pk, 0)))
    finished = list(base.filter(state__in=Run.FINISHED)
                    .order_by(F("finished_at").desc(nulls_last=True), "-pk")[:finished_limit])
    hardware_classes = sorted({r.hardware for r in active + finished} | (
        {hardware} if hardware else set()))
    live = workers()
    if hardware:
        live = [w for w in live if w["hardware"] == hardware]
    return {"active": [run_summary(r, positions.get(r.pk)) for r in active],
            "finished": [run_summary(r) for r in finished],
            "hardware": hardware_classes, "workers": live,
            "queues": queue_coverage(active, live)}


def active_runs(*, protocol=None, drafter=None, run_ids=None, limit: int = 10,
                show_rejected: bool = False) -> list[dict]:
    """The queued and running runs of a protocol (or of a drafter, or these ids), running
    first then in queue order, as the queue page shows them (run_summary with the queue
    position, progress and ETA) plus "next": the cells the run measures next (its next
    group, worker.measure.measurement_groups_for on the cells it has, the same order the
    worker follows) as {"task", "temperature", "batch_size", "ks"}, None when it has
    measured everything. Three queries."""
    from worker.measure import measurement_groups_for

    qs = visible(Run.objects.select_related("drafter", "drafter__owner", "protocol"),
                 show_rejected).filter(state__in=[Run.QUEUED, Run.RUNNING])
    if protocol is not None:
        qs = qs.filter(protocol=protocol)
    if drafter is not None:
        qs = qs.filter(drafter=drafter)
    if run_ids is not None:
        qs = qs.filter(pk__in=list(run_ids))
    positions = queue_positions()
    runs = sorted(qs.order_by("queued_at", "pk")[:500],
                  key=lambda r: (r.state != Run.RUNNING, positions.get(r.pk, 0)))[:limit]
    done = {}
    for row in (Result.objects.filter(run_id__in=[r.pk for r in runs])
                .values("run_id", "task", "batch_size", "temperature", "k")):
        done.setdefault(row["run_id"], set()).add(cell_key(row))
    out = []
    for r in runs:
        method = r.drafter.method if r.drafter_id else "baseline"
        groups = measurement_groups_for(r.protocol.spec, method,
                                        frozenset(done.get(r.pk, ())))
        nxt = None
        if groups:
            c = groups[0][0]
            nxt = {"task": c.task, "temperature": c.temperature, "batch_size": c.batch_size,
                   "ks": [g.k for g in groups[0]]}
        out.append({**run_summary(r, positions.get(r.pk)), "next": nxt})
    return out


def run_progress(ids, show_rejected: bool = False) -> list[dict]:
    """Progress of the given runs (the queue page polls this). Two queries."""
    ids = [int(i) for i in ids][:500]
    runs = list(visible(Run.objects.filter(pk__in=ids), show_rejected).order_by("pk"))
    positions = queue_positions(ids) if any(r.state == Run.QUEUED for r in runs) else {}
    return [run_progress_summary(r, positions.get(r.pk)) for r in runs]


def get_run(run_id: int) -> Run | None:
    return (Run.objects.select_related("drafter", "drafter__owner", "protocol")
            .filter(pk=run_id).first())


def runs_page(*, state: str | None = None, hardware: str | None = None,
              drafter: str | None = None, protocol: str | None = None,
              version: int | None = None, baseline: bool | None = None,
              limit: int = 100, offset: int = 0,
              show_rejected: bool = False) -> tuple[int, list[dict]]:
    """(count, one page of runs, newest first, each with its queue position). Three
    queries."""
    qs = visible(Run.objects.select_related("drafter", "drafter__owner", "protocol"),
                 show_rejected)
    qs = filtered(qs, **protocol_ref_lookups(protocol))
    qs = filtered(qs, state=state, hardware=hardware, drafter__slug=drafter,
                  protocol__version=version)
    if baseline is not None:
        qs = qs.filter(drafter__isnull=baseline)
    count = qs.count()
    runs = list(qs.order_by("-queued_at", "-pk")[offset:offset + limit])
    positions = (queue_positions([r.pk for r in runs])
                 if any(r.state == Run.QUEUED for r in runs) else {})
    return count, [run_summary(r, positions.get(r.pk)) for r in runs]


def run_with_position(run_id: int) -> dict | None:
    """One run (run_summary) with its queue position. Two queries."""
    run = get_run(run_id)
    if run is None:
        return None
    position = queue_positions([run.pk]).get(run.pk) if run.state == Run.QUEUED else None
    return run_summary(run, position)



def run_page(run_id: int) -> dict | None:
    """A run (run_summary with its queue position, drift and drift flag) and its cells,
    each with its self-checks, host load and the baseline cell its speedup divides by.
    Three queries."""
    from .drafters import run_cells

    run = get_run(run_id)
    if run is None:
        return None
    position = queue_positions([run.pk]).get(run.pk) if run.state == Run.QUEUED else None
    cells = run_cells(run.pk)
    spec = run.protocol.spec
    return {"run": {**run_summary(run, position), "drift": run.drift,
                    "drift_flagged": run.drift_flagged, "max_drift": spec.max_drift,
                    "baseline_mode": spec.baseline, "repetitions": spec.repetitions,
                    "engine_starts": spec.starts},
            "cells": cells,
            "checks_failed": [c for c in cells if c["checks_ok"] is False],
            "loaded": [c for c in cells if c["loaded"]]}
