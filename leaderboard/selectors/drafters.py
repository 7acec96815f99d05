"""Reads of drafters: the drafter page (its runs, the shown run's cells and the baseline
cells they divide by) and the API's drafter list."""
from __future__ import annotations

from collections import Counter

from django.db.models import Count, Max, Sum

from ..models import Drafter, Result, Run
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
        out.append(d)
    return out


def _pick_run(runs: list[Run], protocol_id: int):
    """The run a drafter page shows for a protocol: the newest succeeded one, else the
    newest with any state."""
    mine = [r for r in runs if r.protocol_id == protocol_id]
    return next((r for r in mine if r.state == Run.SUCCEEDED), None) or (mine[0] if mine else None)


def drafter_overview(slug: str, protocol_ref: str | None = None) -> dict | None:
    """A drafter, its files and runs, and the run its page shows for the chosen protocol
    (default: the newest protocol where it has a succeeded run; the newest succeeded run
    there, else the newest run). None if there is no such drafter. Three queries.

    Returns {"drafter", "files", "runs", "protocols", "protocol", "protocol_json", "run"};
    "_run" and "_protocol" hold the model instances for `drafter_results`."""
    d = Drafter.objects.select_related("owner", "target").filter(slug=slug).first()
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
    run = _pick_run(runs, protocol.pk) if protocol else None
    summary = drafter_summary(d)
    summary.update(description=d.description, link=d.link, licence=d.licence,
                   content_sha256=d.content_sha256, params=d.params, created_at=d.created_at,
                   target={"slug": d.target.slug, "name": d.target.name},
                   trained_by_recipe=d.trained_by_recipe, training=training_summary(d),
                   total_bytes=sum(f["size"] for f in files))
    return {
        "drafter": summary, "files": files,
        "runs": [run_summary(r) for r in runs],
        "protocols": [protocol_summary(p) for p in protocols.values()],
        "protocol": protocol_summary(protocol) if protocol else None,
        "protocol_json": protocol.canonical_json if protocol else None,
        "run": run_summary(run) if run else None,
        "_run": run, "_protocol": protocol,
    }


def _baseline_candidates(run: Run):
    return Run.objects.filter(protocol_id=run.protocol_id, drafter__isnull=True,
                              hardware=run.hardware)


def drafter_signature(overview: dict) -> tuple | None:
    """Changes whenever the cells, charts or baseline of the shown run can change (a cell
    is added, the run or a baseline finishes): for caching. One query."""
    run = overview["_run"]
    if run is None:
        return None
    base = _baseline_candidates(run).aggregate(n=Count("id"), last=Max("id"),
                                               finished=Max("finished_at"))
    d = overview["drafter"]
    return (run.pk, run.state, run.cells_done, run.attempts, str(run.finished_at),
            run.engine_version, base["n"], base["last"], str(base["finished"]),
            d["claimed_acceptance_length"], d["claimed_speedup"])


def drafter_results(overview: dict) -> dict:
    """The shown run's cells and the baseline cells its speedups divide by (the baseline
    run its cells point to, else the newest succeeded baseline of the same protocol,
    hardware class and engine version). Up to three queries.

    Returns {"cells", "baseline_run", "baseline_cells"}."""
    run = overview["_run"]
    if run is None:
        return {"cells": [], "baseline_run": None, "baseline_cells": []}
    cells = run_cells(run.pk)
    base_ids = Counter(c["baseline_result_id"] for c in cells if c["baseline_result_id"])
    qs = _baseline_candidates(run).select_related("protocol")
    if base_ids:
        qs = qs.filter(results__id=base_ids.most_common(1)[0][0])
    else:
        qs = qs.filter(state=Run.SUCCEEDED, engine_version=run.engine_version)
    baseline_run = qs.order_by("-queued_at").first()
    return {"cells": cells,
            "baseline_run": run_summary(baseline_run) if baseline_run else None,
            "baseline_cells": run_cells(baseline_run.pk) if baseline_run else []}


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
               total_bytes=total_bytes or 0)
    return out


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

