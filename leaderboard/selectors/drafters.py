"""Reads of drafters: the drafter page (its runs, the shown run's cells and the baseline
cells they divide by) and the API's drafter list."""
from __future__ import annotations

from django.db.models import Count, Max, Sum

from ..models import Drafter, Result, Run
from worker.analysis import speedups
from .pinned import baseline_runs_of, pinned_for
from .board import pick_shown
from .shapes import (HIDDEN_REVIEW_STATES, drafter_summary, filtered, protocol_summary,
                     run_summary, training_summary)


def run_cells(run_id: int) -> list[dict]:
    """Every cell of a run, in grid order, with the baseline cell's throughput and TPOT
    (the figures its speedup divides by). One query."""
    out = []
    qs = (Result.objects.filter(run_id=run_id)
          .select_related("baseline_result").order_by("task", "batch_size", "temperature", "k"))
    for r in qs:
        d = r.as_cell_dict()
        base = r.baseline_result
        d["baseline_throughput"] = base.output_throughput if base else None
        d["baseline_tpot_mean"] = base.tpot_mean if base else None
        d["baseline_run_id"] = base.run_id if base else None
        d["baseline_same_run"] = bool(base) and base.run_id == r.run_id
        out.append(d)
    return out


def _pick_run(runs: list[Run], protocol_id: int):
    """(the run a drafter page shows for a protocol, the run re-measuring it or None): the
    one the leaderboard shows (board.pick_shown: the newest succeeded, else the newest
    running with a cell), else the newest with any state (queued, running without a cell,
    failed)."""
    mine = [r for r in runs if r.protocol_id == protocol_id]
    shown, newer = pick_shown(mine, state=lambda r: r.state, cells_done=lambda r: r.cells_done)
    return (shown or (mine[0] if mine else None)), newer


def drafter_overview(slug: str, protocol_ref: str | None = None) -> dict | None:
    """A drafter, its files and runs, and the run its page shows for the chosen protocol
    (default: the newest protocol where it has a succeeded run; the newest succeeded run
    there, else the newest run). None if there is no such drafter. Three queries.

    Returns {"drafter", "files", "runs", "protocols", "protocol", "protocol_json", "run",
    "remeasuring" (a newer running run of the shown succeeded one, or None)};
    "_run" and "_protocol" hold the model instances for `drafter_results`."""
    d = Drafter.objects.select_related("owner", "target", "training_data").filter(slug=slug).first()
    if d is None:
        return None
    files = list(d.files.order_by("name").values("name", "size", "sha256"))
    runs = list(Run.objects.filter(drafter=d).select_related("protocol", "protocol__target")
                .order_by("-queued_at", "-pk")[:100])
    for r in runs:
        r.drafter = d
    protocols = {}
    for r in runs:
        protocols.setdefault(r.protocol_id, r.protocol)
    protocol = None
    if protocol_ref:
        slug_, _, version = protocol_ref.partition("@")
        protocol = next((p for p in protocols.values() if p.slug == slug_
                         and (not version or str(p.version) == version)), None)
    if protocol is None:
        succeeded = [r for r in runs if r.state == Run.SUCCEEDED]
        protocol = (succeeded[0].protocol if succeeded else runs[0].protocol) if runs else None
    run, remeasuring = _pick_run(runs, protocol.pk) if protocol else (None, None)
    summary = drafter_api_summary(d, sum(f["size"] for f in files))
    return {
        "drafter": summary, "files": files,
        "runs": [run_summary(r) for r in runs],
        "protocols": [protocol_summary(p) for p in protocols.values()],
        "protocol": protocol_summary(protocol) if protocol else None,
        "protocol_json": protocol.canonical_json if protocol else None,
        "run": run_summary(run) if run else None,
        "remeasuring": run_summary(remeasuring) if remeasuring else None,
        "_run": run, "_protocol": protocol,
    }


def _baseline_candidates(run: Run):
    return Run.objects.filter(protocol_id=run.protocol_id, drafter__isnull=True,
                              hardware=run.hardware)


def drafter_signature(overview: dict) -> tuple | None:
    """(settled, landing) for caching (views.cached_fragment): what changes whenever the
    cells, charts or baseline of the shown run can change (the run or a baseline finishes),
    and its cells done while it runs (a cell lands). One query."""
    run = overview["_run"]
    if run is None:
        return None
    base = _baseline_candidates(run).aggregate(n=Count("id"), last=Max("id"),
                                               finished=Max("finished_at"))
    d = overview["drafter"]
    landing = run.cells_done if run.state == Run.RUNNING else None
    return ((run.pk, run.state, None if landing is not None else run.cells_done, run.attempts,
             str(run.finished_at), run.engine_version, base["n"], base["last"],
             str(base["finished"]), d["claimed_acceptance_length"], d["claimed_speedup"]),
            landing)


def drafter_results(overview: dict) -> dict:
    """The shown run's drafter cells (k > 0) and the baseline cells their speedups divide
    by: the cells stored with them (Result.baseline_result; under a paired protocol the
    run's own k = 0 cells). Up to four queries.

    Returns {"cells", "baseline_run", "baseline_cells", "baseline_paired"}."""
    run = overview["_run"]
    if run is None:
        return {"cells": [], "baseline_run": None, "baseline_cells": [],
                "baseline_paired": False}
    cells = run_cells(run.pk)
    drafter_cells = [c for c in cells if c["k"] > 0]
    pinned = pinned_for(drafter_cells).get(run.pk, {})
    base_ids = baseline_runs_of(pinned)
    baseline_run = (Run.objects.select_related("protocol").filter(pk=base_ids[-1]).first()
                    if base_ids else None)
    if not pinned:  # nothing divided yet: the run's own k = 0 cells (paired) are shown
        own = [c for c in cells if c["k"] == 0]
        return {"cells": drafter_cells, "baseline_run": run_summary(run) if own else None,
                "baseline_cells": own, "baseline_paired": bool(own)}
    return {"cells": drafter_cells,
            "baseline_run": run_summary(baseline_run) if baseline_run else None,
            "baseline_cells": sorted(pinned.values(), key=speedups.cell_key),
            "baseline_paired": base_ids == [run.pk]}


def drafter_page(slug: str, protocol_ref: str | None = None) -> dict | None:
    """`drafter_overview` and `drafter_results` together (six queries); None if there is no
    such drafter."""
    overview = drafter_overview(slug, protocol_ref)
    if overview is None:
        return None
    page = {k: v for k, v in overview.items() if not k.startswith("_")}
    page.update(drafter_results(overview))
    return page


def drafter_api_summary(d: Drafter, total_bytes: int | None = None) -> dict:
    """A drafter with the same fields as drafter_page()'s "drafter" (owner and target
    select_related by the caller)."""
    out = drafter_summary(d)
    out.update(description=d.description, link=d.link, licence=d.licence,
               content_sha256=d.content_sha256, params=d.params, created_at=d.created_at,
               target={"slug": d.target.slug, "name": d.target.name},
               trained_by_recipe=d.trained_by_recipe, training=training_summary(d),
               intake=intake_summary(d.intake), total_bytes=total_bytes or 0)
    return out


def intake_summary(intake: dict | None) -> dict:
    """The published format a drafter came in and what intake did to it (empty for a
    drafter stored before intake recorded it)."""
    intake = intake or {}
    return {"format": intake.get("format", ""), "converted_from": intake.get("converted_from", {}),
            "notes": list(intake.get("notes", [])), "verifier": intake.get("verifier"),
            "hub": intake.get("hub")}


def drafters_page(*, target: str | None = None, method: str | None = None,
                  owner: str | None = None, review_state: str | None = None,
                  limit: int = 100, offset: int = 0) -> tuple[int, list[dict]]:
    """(count, one page of drafters by name). Withdrawn and rejected drafters are left out
    unless `review_state` asks for them. Two queries."""
    qs = Drafter.objects.select_related("owner", "target", "training_data")
    if review_state:
        qs = qs.filter(review_state=review_state)
    else:
        qs = qs.exclude(review_state__in=HIDDEN_REVIEW_STATES)
    qs = filtered(qs, target__slug=target, method=method, owner__username=owner)
    count = qs.count()
    page = qs.annotate(total_bytes=Sum("files__size")).order_by("name", "pk")[offset:offset + limit]
    return count, [drafter_api_summary(d, d.total_bytes) for d in page]

