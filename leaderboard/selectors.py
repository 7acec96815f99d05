"""Selectors: every read that a page makes, and that the REST API reuses, so that a table
on a page and the same table in the export come from one place.

Each function makes a bounded number of queries whatever the number of rows, and returns
plain dicts and lists (JSON-able apart from datetimes). Figures over several cells are
aggregated from the summed counts with worker.metrics (never by averaging ratios):

    acceptance length = 1 + sum accepted_tokens / sum drafts
    acceptance rate   = sum accepted_tokens / sum draft_tokens
    throughput        = sum generated_tokens / sum wall_seconds
    speedup           = that throughput / the baseline's throughput over the same cells
"""
from __future__ import annotations

import functools
import inspect
import logging
from collections import Counter, defaultdict

from django.conf import settings as _settings
from django.core.cache import cache as _cache
from django.db import connection
from django.db.models import (Count, Exists, ExpressionWrapper, F, FloatField, Func, Max, OuterRef,
                              Q, Sum, TextField, Value)
from django.db.models.functions import Cast, Coalesce
from django.urls import reverse

import worker.protocol
from worker import analysis, metrics

from .models import ApiToken, Drafter, Prompt, PromptSet, Protocol, Result, Run, Target

HIDDEN_REVIEW_STATES = ("withdrawn", "rejected")
ALL = "all"

SUMS = ("requests", "generated_tokens", "wall_seconds", "drafts", "draft_tokens",
        "accepted_tokens")


# ---- small shapes ---------------------------------------------------------------------

def protocol_label(p: Protocol) -> str:
    return f"{p.slug} v{p.version}"


def protocol_ref(p: Protocol) -> str:
    """How a protocol is named in a URL query: slug@version."""
    return f"{p.slug}@{p.version}"


def protocol_summary(p: Protocol) -> dict:
    spec = p.spec
    return {
        "id": p.pk, "slug": p.slug, "version": p.version, "label": protocol_label(p),
        "ref": protocol_ref(p), "title": p.title, "engine": p.engine, "hardware": p.hardware,
        "sha256": p.sha256, "created_at": p.created_at,
        "target": {"slug": p.target.slug, "name": p.target.name},
        "tasks": [t["task"] for t in spec["tasks"]], "batch_sizes": list(spec["batch_sizes"]),
        "temperatures": [float(t) for t in spec["temperatures"]], "ks": list(spec["ks"]),
        "url": reverse("protocol", args=[p.slug, p.version]),
    }


def drafter_summary(d: Drafter | None) -> dict | None:
    if d is None:
        return None
    return {
        "id": d.pk, "slug": d.slug, "name": d.name, "method": d.method,
        "method_label": d.get_method_display(),
        "owner": d.owner.username if d.owner_id else None, "owner_id": d.owner_id,
        "review_state": d.review_state, "url": reverse("drafter", args=[d.slug]),
        "claimed_acceptance_length": d.claimed_acceptance_length,
        "claimed_speedup": d.claimed_speedup, "claimed_source": d.claimed_source,
    }


def run_summary(run: Run, position: int | None = None) -> dict:
    """A run for the queue, the drafter page and the API. The drafter (if any) and the
    protocol must be select_related by the caller."""
    return {
        "id": run.pk, "state": run.state, "is_baseline": run.drafter_id is None,
        "drafter": drafter_summary(run.drafter) if run.drafter_id else None,
        "protocol": {"slug": run.protocol.slug, "version": run.protocol.version,
                     "label": protocol_label(run.protocol),
                     "url": reverse("protocol", args=[run.protocol.slug, run.protocol.version])},
        "hardware": run.hardware, "position": position,
        "cells_done": run.cells_done, "cells_total": run.cells_total,
        "progress": run.progress, "eta_seconds": run.eta_seconds,
        "cancel_requested": run.cancel_requested, "attempts": run.attempts,
        "worker_host": run.worker_host, "engine_version": run.engine_version,
        "versions": run.versions, "hardware_description": run.hardware_description,
        "engine_args": run.engine_args, "error": run.error, "log_tail": run.log_tail,
        "artifact_url": reverse("run_artifact", args=[run.pk]) if run.artifact else None,
        "queued_at": run.queued_at, "started_at": run.started_at,
        "heartbeat_at": run.heartbeat_at, "finished_at": run.finished_at,
        "owner_id": run.drafter.owner_id if run.drafter_id else None,
    }


def run_progress_summary(run: Run, position: int | None = None) -> dict:
    """The small, JSON-ready part of a run that the queue page polls."""
    return {
        "id": run.pk, "state": run.state, "position": position,
        "cells_done": run.cells_done, "cells_total": run.cells_total,
        "progress": round(run.progress, 4), "eta_seconds": run.eta_seconds,
        "cancel_requested": run.cancel_requested, "error": run.error[:300],
    }


# ---- aggregation (worker.metrics on summed counts) ---------------------------------------

def figures_from_sums(s: dict) -> dict:
    """Figures of a group of cells from their summed counts (keys of SUMS)."""
    counts = metrics.SpecCounts(s.get("drafts") or 0, s.get("draft_tokens") or 0,
                                s.get("accepted_tokens") or 0, list(s.get("accepted_at") or []))
    out = {
        "acceptance_length": metrics.acceptance_length(counts),
        "acceptance_rate": metrics.acceptance_rate(counts),
        "output_throughput": metrics.output_throughput(s.get("generated_tokens") or 0,
                                                       s.get("wall_seconds") or 0.0),
    }
    if s.get("accepted_at") is not None:
        out["per_position_acceptance"] = metrics.per_position_acceptance(counts)
        out["conditional_acceptance"] = metrics.conditional_acceptance(counts)
    lossless_n = s.get("lossless_requests") or 0
    out["lossless_share"] = (s["lossless_weighted"] / lossless_n) if lossless_n else None
    return out


def aggregate_cells(cells: list[dict], keys: tuple[str, ...]) -> dict[tuple, dict]:
    """Group cell dicts (see `cell_dict`) by `keys` and compute each group's figures from
    the summed counts, accepted_at included (per-position acceptance)."""
    groups: dict[tuple, dict] = {}
    for c in cells:
        key = tuple(c[k] for k in keys)
        g = groups.setdefault(key, {**{s: 0 for s in SUMS}, "counts": metrics.SpecCounts(),
                                    "lossless_weighted": 0.0, "lossless_requests": 0,
                                    "cells": 0})
        for s in SUMS:
            g[s] += c[s] or 0
        g["counts"] = g["counts"] + metrics.SpecCounts(c["drafts"], c["draft_tokens"],
                                                       c["accepted_tokens"], c["accepted_at"])
        if c["lossless_share"] is not None:
            g["lossless_weighted"] += c["lossless_share"] * c["requests"]
            g["lossless_requests"] += c["requests"]
        g["cells"] += 1
    out = {}
    for key, g in groups.items():
        sums = {**g, "accepted_at": g["counts"].accepted_at}
        out[key] = {**{s: g[s] for s in SUMS}, "cells": g["cells"], **figures_from_sums(sums)}
    return out


def _sum_annotations():
    """Sum(...) of each count, named sum_<field> (see `_unprefix`)."""
    lossless = ExpressionWrapper(F("lossless_share") * F("requests"), output_field=FloatField())
    return dict(
        **{f"sum_{s}": Sum(s) for s in SUMS},
        sum_lossless_weighted=Sum(lossless, filter=Q(lossless_share__isnull=False)),
        sum_lossless_requests=Sum("requests", filter=Q(lossless_share__isnull=False)),
        sum_cells=Count("id"),
    )


def _unprefix(row: dict) -> dict:
    return {k[4:] if k.startswith("sum_") else k: v for k, v in row.items()}


# ---- protocols ------------------------------------------------------------------------

def protocols_with_results(target_slug: str | None = None):
    """Protocols that have results, newest first (a queryset with the target joined)."""
    qs = Protocol.objects.select_related("target").filter(
        Exists(Result.objects.filter(run__protocol=OuterRef("pk"))))
    if target_slug:
        qs = qs.filter(target__slug=target_slug)
    return qs.order_by("-created_at", "-version", "-pk")


def get_protocol(ref: str | None = None, target_slug: str | None = None) -> Protocol | None:
    """A protocol by `slug@version` or `slug` (its newest version); without a ref, the
    newest protocol with results (or, if none has any, the newest protocol)."""
    qs = Protocol.objects.select_related("target")
    if ref:
        slug, _, version = ref.partition("@")
        qs = qs.filter(slug=slug)
        if version:
            if not version.isdigit():
                return None
            qs = qs.filter(version=int(version))
        return qs.order_by("-version").first()
    return (protocols_with_results(target_slug).first()
            or (qs.filter(target__slug=target_slug) if target_slug else qs)
            .order_by("-created_at", "-version", "-pk").first())


def protocol_list() -> list[dict]:
    """Every protocol with its number of runs and whether it has results."""
    qs = (Protocol.objects.select_related("target")
          .annotate(runs_count=Count("runs", distinct=True),
                    succeeded=Count("runs", filter=Q(runs__state=Run.SUCCEEDED), distinct=True))
          .order_by("slug", "-version"))
    return [{**protocol_summary(p), "runs_count": p.runs_count, "succeeded_runs": p.succeeded}
            for p in qs]


def multi_turn_policy() -> str:
    """The comment above worker.protocol.MULTI_TURN_FIRST_TURN (not retyped here)."""
    lines = inspect.getsource(worker.protocol).splitlines()
    end = next(i for i, line in enumerate(lines) if line.startswith("MULTI_TURN_FIRST_TURN"))
    start = end
    while start > 0 and lines[start - 1].startswith("#"):
        start -= 1
    return " ".join(line.lstrip("# ").strip() for line in lines[start:end])


def protocol_detail(p: Protocol) -> dict:
    """The whole spec (canonical JSON and its sha256), each task's prompt set with counts
    and hashes, the multi-turn policy and the definition of every metric."""
    spec = p.spec
    slugs = {t["prompt_set"] for t in spec["tasks"]}
    sets = {ps.slug: ps for ps in PromptSet.objects.filter(slug__in=slugs)}
    per_category = defaultdict(Counter)
    for row in (Prompt.objects.filter(prompt_set__slug__in=slugs)
                .values("prompt_set__slug", "category").annotate(n=Count("id"))):
        per_category[row["prompt_set__slug"]][row["category"]] = row["n"]
    tasks = []
    for t in spec["tasks"]:
        ps = sets.get(t["prompt_set"])
        cats = per_category.get(t["prompt_set"], Counter())
        available = sum(n for c, n in cats.items() if not t["categories"] or c in t["categories"])
        tasks.append({
            "task": t["task"], "prompt_set": t["prompt_set"], "categories": t["categories"],
            "prompts": t["prompts"], "spec_sha256": t["prompt_set_sha256"],
            "imported": ps is not None,
            "name": ps.name if ps else None, "format": ps.format if ps else None,
            "source_name": ps.source_name if ps else None,
            "source_sha256": ps.source_sha256 if ps else None,
            "sha256_matches": bool(ps and ps.source_sha256 == t["prompt_set_sha256"]),
            "set_count": sum(cats.values()), "available": available,
            "category_counts": dict(sorted(cats.items())),
        })
    counts = Run.objects.filter(protocol=p).aggregate(
        runs=Count("id"), succeeded=Count("id", filter=Q(state=Run.SUCCEEDED)))
    return {
        "protocol": protocol_summary(p), "spec": spec, "canonical_json": p.canonical_json,
        "sha256": p.sha256, "tasks": tasks, "multi_turn": spec.get("multi_turn"),
        "multi_turn_policy": multi_turn_policy(), "metrics": metrics.definitions(),
        "runs": counts["runs"], "succeeded_runs": counts["succeeded"],
        "cells_per_drafter_run": len(p.spec_obj.cells(with_drafter=True)),
        "cells_per_baseline_run": len(p.spec_obj.cells(with_drafter=False)),
    }


# ---- leaderboard --------------------------------------------------------------------

SORT_KEYS = ("name", "method", "k", "batch_size", "temperature", "acceptance_length",
             "acceptance_rate", "output_throughput", "speedup", "lossless_share")


RUN_FIELDS = ("id", "drafter_id", "engine_version", "hardware", "hardware_description",
              "artifact", "queued_at")
DRAFTER_FIELDS = ("slug", "name", "method", "owner_id", "owner__username", "review_state",
                  "claimed_acceptance_length", "claimed_speedup", "claimed_source")
METHOD_LABELS = dict(Drafter.METHODS)


@functools.lru_cache(maxsize=None)
def _url_pattern(name: str, placeholder: str) -> str:
    return reverse(name, args=[placeholder])


def fast_url(name: str, value, placeholder: str = "9876543210") -> str:
    """reverse() for one-argument URLs, without resolving the pattern for every row."""
    return _url_pattern(name, placeholder).replace(placeholder, str(value), 1)


def _summary_from_values(v: dict) -> dict:
    d = {f: v[f"drafter__{f}"] for f in DRAFTER_FIELDS}
    return {"id": v["drafter_id"], "slug": d["slug"], "name": d["name"], "method": d["method"],
            "method_label": METHOD_LABELS.get(d["method"], d["method"]),
            "owner": d["owner__username"], "owner_id": d["owner_id"],
            "review_state": d["review_state"], "url": fast_url("drafter", d["slug"], "x-slug-x"),
            "claimed_acceptance_length": d["claimed_acceptance_length"],
            "claimed_speedup": d["claimed_speedup"], "claimed_source": d["claimed_source"]}


def latest_succeeded_runs(protocol: Protocol, method: str | None = None,
                          baselines_only: bool = False, slugs=None):
    """(newest succeeded run per drafter, {engine version: newest succeeded baseline run}),
    drafters withdrawn or rejected left out. Runs are dicts (RUN_FIELDS, "drafter": a
    drafter summary or None, "artifact_url"). One query."""
    qs = (Run.objects.filter(protocol=protocol, state=Run.SUCCEEDED)
          .exclude(drafter__review_state__in=HIDDEN_REVIEW_STATES)
          .order_by("-queued_at", "-pk"))
    if baselines_only:
        qs = qs.filter(drafter__isnull=True)
    elif slugs is not None:
        qs = qs.filter(Q(drafter__slug__in=slugs) | Q(drafter__isnull=True))
    elif method:
        qs = qs.filter(Q(drafter__method=method) | Q(drafter__isnull=True))
    drafter_runs, baselines = {}, {}
    for v in qs.values(*RUN_FIELDS, *(f"drafter__{f}" for f in DRAFTER_FIELDS)):
        if v["drafter_id"] is None:
            if v["engine_version"] not in baselines:
                baselines[v["engine_version"]] = _run_values(v, None)
        elif v["drafter_id"] not in drafter_runs:
            drafter_runs[v["drafter_id"]] = _run_values(v, _summary_from_values(v))
    return list(drafter_runs.values()), baselines


def _run_values(v: dict, drafter: dict | None) -> dict:
    run = {f: v[f] for f in RUN_FIELDS}
    run["drafter"] = drafter
    run["artifact_url"] = fast_url("run_artifact", v["id"]) if v["artifact"] else None
    return run


def leaderboard_signature(protocol: Protocol) -> tuple:
    """Changes whenever the runs a leaderboard shows change (a run succeeds, a drafter is
    withdrawn or approved): for caching. One query."""
    agg = (Run.objects.filter(protocol=protocol, state=Run.SUCCEEDED)
           .exclude(drafter__review_state__in=HIDDEN_REVIEW_STATES)
           .aggregate(n=Count("id"), last=Max("id"), finished=Max("finished_at")))
    return (protocol.pk, protocol.sha256, agg["n"], agg["last"],
            agg["finished"].isoformat() if agg["finished"] else None)


def leaderboard(protocol: Protocol, *, task: str | None = None, batch_size: int | None = None,
                temperature: float | None = None, k: int | None = None,
                method: str | None = None, sort: str = "speedup",
                descending: bool = True) -> dict:
    """The leaderboard of one protocol: one row per (drafter, batch size, temperature, k)
    from each drafter's newest succeeded run, figures over one task or all tasks (None),
    and the baseline rows. None for a filter means every value. Two queries.

    Returns {"protocol", "filters", "choices", "rows", "baseline_rows", "runs_info",
    "drafters"}; a row: {"drafter" (drafter summary), "run_id", "task", "batch_size",
    "temperature", "k", "cells", "requests", "acceptance_length", "acceptance_rate",
    "output_throughput", "speedup", "lossless_share", "baseline_throughput",
    "engine_version", "hardware_description", "artifact_url"}."""
    spec = protocol.spec
    drafter_runs, baselines = latest_succeeded_runs(protocol, method)
    run_by_id = {r["id"]: r for r in drafter_runs}
    run_by_id.update({r["id"]: r for r in baselines.values()})

    rows_qs = Result.objects.filter(run__protocol=protocol, run__state=Run.SUCCEEDED)
    if task:
        rows_qs = rows_qs.filter(task=task)
    if batch_size is not None:
        rows_qs = rows_qs.filter(batch_size=batch_size)
    if temperature is not None:
        rows_qs = rows_qs.filter(temperature=temperature)
    if k is not None:
        rows_qs = rows_qs.filter(k__in=[k, 0])
    groups = (rows_qs.values("run_id", "batch_size", "temperature", "k")
              .annotate(**_sum_annotations()).order_by())

    base_figs, drafter_groups = {}, []
    for g in map(_unprefix, groups):
        run = run_by_id.get(g["run_id"])
        if run is None:  # an older run of a drafter, or of a hidden one
            continue
        figs = {**g, **figures_from_sums(g)}
        if run["drafter"] is None:
            base_figs[(g["run_id"], g["batch_size"], float(g["temperature"]))] = figs
        else:
            drafter_groups.append(figs)

    def row(run, g, base):
        base_thr = base["output_throughput"] if base else None
        return {
            "drafter": run["drafter"], "run_id": run["id"], "task": task or ALL,
            "batch_size": g["batch_size"], "temperature": float(g["temperature"]),
            "k": g["k"], "cells": g["cells"], "requests": g["requests"],
            "acceptance_length": g["acceptance_length"], "acceptance_rate": g["acceptance_rate"],
            "output_throughput": g["output_throughput"],
            "speedup": (metrics.speedup(g["output_throughput"], base_thr)
                        if run["drafter"] else None),
            "lossless_share": g["lossless_share"], "baseline_throughput": base_thr,
            "engine_version": run["engine_version"],
            "hardware_description": run["hardware_description"],
            "artifact_url": run["artifact_url"],
        }

    rows = []
    for g in drafter_groups:
        run = run_by_id[g["run_id"]]
        base_run = baselines.get(run["engine_version"])
        base = base_figs.get((base_run["id"], g["batch_size"], float(g["temperature"]))) \
            if base_run else None
        rows.append(row(run, g, base))
    baseline_rows = []
    newest_base = max(baselines.values(), key=lambda r: (r["queued_at"], r["id"]), default=None)
    if newest_base is not None:
        for (run_id, b, t), g in sorted(base_figs.items(), key=lambda kv: kv[0][1:]):
            if run_id == newest_base["id"]:
                baseline_rows.append(row(newest_base, g, g))

    sort = sort if sort in SORT_KEYS else "speedup"

    def value(r):
        if sort == "name":
            return r["drafter"]["name"].lower()
        if sort == "method":
            return r["drafter"]["method"]
        return r[sort]

    # Rows without the figure (no baseline yet, no drafts) go last in either direction.
    present = [r for r in rows if value(r) is not None]
    present.sort(key=lambda r: (value(r), r["drafter"]["name"].lower()), reverse=descending)
    rows = present + [r for r in rows if value(r) is None]

    runs_info = sorted({(r["engine_version"], r["hardware_description"], r["hardware"])
                        for r in run_by_id.values()})
    methods = sorted({r["drafter"]["method"] for r in drafter_runs})
    return {
        "protocol": protocol_summary(protocol),
        "filters": {"task": task or ALL, "batch_size": batch_size, "temperature": temperature,
                    "k": k, "method": method, "sort": sort, "descending": descending},
        "choices": {"tasks": [t["task"] for t in spec["tasks"]],
                    "batch_sizes": list(spec["batch_sizes"]),
                    "temperatures": [float(t) for t in spec["temperatures"]],
                    "ks": list(spec["ks"]), "methods": methods},
        "rows": rows, "baseline_rows": baseline_rows,
        "runs_info": [{"engine_version": e, "hardware_description": h, "hardware": hw}
                      for e, h, hw in runs_info],
        "drafters": len(drafter_runs),
    }


# ---- drafter page -----------------------------------------------------------------------

CELL_FIELDS = (
    "task", "batch_size", "temperature", "k", "requests", "generated_tokens", "wall_seconds",
    "drafts", "draft_tokens", "accepted_tokens", "accepted_at", "acceptance_length",
    "acceptance_rate", "per_position_acceptance", "conditional_acceptance",
    "output_throughput", "ttft_mean", "ttft_p50", "ttft_p90", "ttft_p99", "tpot_mean",
    "tpot_p50", "tpot_p90", "tpot_p99", "speedup", "lossless_share", "measured_at",
)


def cell_dict(r: Result) -> dict:
    d = {f: getattr(r, f) for f in CELL_FIELDS}
    d["temperature"] = float(d["temperature"])
    d["accepted_at"] = list(d["accepted_at"] or [])
    d["run_id"] = r.run_id
    d["baseline_result_id"] = r.baseline_result_id
    return d


def run_cells(run_id: int) -> list[dict]:
    """Every cell of a run, in grid order, with the baseline cell's throughput and TPOT
    (the figures its speedup divides by). One query."""
    out = []
    qs = (Result.objects.filter(run_id=run_id)
          .select_related("baseline_result").order_by("task", "batch_size", "temperature", "k"))
    for r in qs:
        d = cell_dict(r)
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


# ---- compare ----------------------------------------------------------------------------

def compare_candidates(protocol: Protocol) -> list[dict]:
    """Drafters with a succeeded run under the protocol (for the compare form)."""
    drafter_runs, _ = latest_succeeded_runs(protocol)
    return sorted((r["drafter"] for r in drafter_runs), key=lambda d: d["name"].lower())


def compare(protocol: Protocol, slugs: list[str]) -> dict:
    """2-4 drafters side by side on one protocol: each drafter's newest succeeded run and
    its cells, and the baseline cells each of them divides by. Two queries.

    Returns {"protocol", "entries": [{"drafter", "run", "cells", "baseline_cells"}],
    "missing": [slugs without a succeeded run under the protocol]}."""
    drafter_runs, baselines = latest_succeeded_runs(protocol, slugs=list(slugs))
    latest = {r["drafter"]["slug"]: r for r in drafter_runs}
    chosen = [latest[s] for s in slugs if s in latest]
    base_runs = {r["id"]: baselines.get(r["engine_version"]) for r in chosen}
    ids = {r["id"] for r in chosen} | {b["id"] for b in base_runs.values() if b}
    by_run = defaultdict(list)
    for res in (Result.objects.filter(run_id__in=ids)
                .order_by("task", "batch_size", "temperature", "k")):
        by_run[res.run_id].append(cell_dict(res))
    entries = []
    for r in chosen:
        base = base_runs[r["id"]]
        entries.append({"drafter": r["drafter"], "run": r, "cells": by_run[r["id"]],
                        "baseline_cells": by_run[base["id"]] if base else []})
    return {"protocol": protocol_summary(protocol), "entries": entries,
            "missing": [s for s in slugs if s not in latest]}


# ---- queue ------------------------------------------------------------------------------

def queue_positions(run_ids=None) -> dict[int, int]:
    """Position of each queued run in its hardware class's queue: 1 + the runs queued
    earlier on the same hardware class that are still waiting. One query."""
    positions, seen = {}, Counter()
    for pk, hardware in (Run.objects.filter(state=Run.QUEUED)
                         .order_by("queued_at", "pk").values_list("pk", "hardware")):
        seen[hardware] += 1
        positions[pk] = seen[hardware]
    if run_ids is not None:
        positions = {pk: p for pk, p in positions.items() if pk in set(run_ids)}
    return positions


def queue(hardware: str | None = None, finished_limit: int = 50) -> dict:
    """Every queued and running run (running first, then queued in queue order), and the
    most recently finished ones (failed runs keep their error and log tail). Three queries.

    Returns {"active": [run_summary], "finished": [run_summary], "hardware": [...]}."""
    base = Run.objects.select_related("drafter", "drafter__owner", "protocol")
    if hardware:
        base = base.filter(hardware=hardware)
    positions = queue_positions()
    active = list(base.filter(state__in=[Run.QUEUED, Run.RUNNING])
                  .order_by("queued_at", "pk"))
    active.sort(key=lambda r: (r.state != Run.RUNNING, r.hardware, positions.get(r.pk, 0)))
    finished = list(base.filter(state__in=Run.FINISHED)
                    .order_by(F("finished_at").desc(nulls_last=True), "-pk")[:finished_limit])
    hardware_classes = sorted({r.hardware for r in active + finished} | (
        {hardware} if hardware else set()))
    return {"active": [run_summary(r, positions.get(r.pk)) for r in active],
            "finished": [run_summary(r) for r in finished],
            "hardware": hardware_classes}


def run_progress(ids) -> list[dict]:
    """Progress of the given runs (the queue page polls this). Two queries."""
    ids = [int(i) for i in ids][:500]
    runs = list(Run.objects.filter(pk__in=ids).order_by("pk"))
    positions = queue_positions(ids) if any(r.state == Run.QUEUED for r in runs) else {}
    return [run_progress_summary(r, positions.get(r.pk)) for r in runs]


def get_run(run_id: int) -> Run | None:
    return (Run.objects.select_related("drafter", "drafter__owner", "protocol")
            .filter(pk=run_id).first())


# ---- accounts ---------------------------------------------------------------------------

def user_tokens(user) -> list[dict]:
    return list(ApiToken.objects.filter(user=user).order_by("-created_at").values(
        "id", "name", "created_at", "last_used_at", "revoked_at"))


def user_drafters(user) -> list[dict]:
    return [drafter_summary(d) for d in
            Drafter.objects.filter(owner=user).select_related("owner").order_by("-created_at")]


# --- API reads ---
# What the REST API (leaderboard/api.py) and its export read beyond the page selectors
# above. Rows reuse the page shapes (protocol_summary, drafter_summary, run_summary,
# CELL_FIELDS), so a page and the API show the same fields under the same names.

RESULT_PROVENANCE = (
    "id", "run_id", "protocol", "protocol_version", "protocol_sha256", "target", "engine",
    "engine_version", "hardware", "hardware_description", "run_state", "drafter", "method",
)
# The columns of a result row, in export order: provenance, then the cell (CELL_FIELDS),
# then what "When does it pay?" computed from the run's raw records (ANALYSIS_COLUMNS,
# worker.analysis, stored by runs.record_analysis; null where there are none).
ANALYSIS_COLUMNS = ("tokens_per_step", "predicted_speedup", "engine_efficiency",
                    "oracle_speedup", "no_waste_speedup", "prefill_share",
                    "verification_share", "drafting_other_share")
RESULT_COLUMNS = RESULT_PROVENANCE + CELL_FIELDS + ("baseline_result_id",) + ANALYSIS_COLUMNS
RESULT_JSON_COLUMNS = ("accepted_at", "per_position_acceptance", "conditional_acceptance")
BASELINE_METHOD = "baseline"


def target_list() -> list[dict]:
    """Every target model. One query."""
    return list(Target.objects.order_by("slug").values(
        "slug", "name", "family", "hub_id", "revision", "weights_sha256", "vocab_size",
        "hidden_size", "num_layers", "has_chat_template", "created_at"))


def protocol_list_with_specs() -> list[dict]:
    """protocol_list() with each protocol's spec and its canonical JSON (whose sha256 is
    the row's sha256). Two queries."""
    rows = protocol_list()
    specs = dict(Protocol.objects.filter(pk__in=[r["id"] for r in rows])
                 .values_list("pk", "spec"))
    for r in rows:
        spec = specs.get(r["id"], {})
        r["spec"] = spec
        r["canonical_json"] = worker.protocol.canonical_json(spec)
    return rows


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


def training_summary(d: Drafter) -> dict | None:
    """How a baseline drafter was trained here (leaderboard/training.py); None otherwise."""
    if not d.trained_by_recipe:
        return None
    data = d.training_data  # select_related by list callers
    details = d.training_details or {}
    return {"recipe": d.trained_by_recipe, "data_slug": data.slug if data else None,
            "data_version": data.version if data else None,
            "data_sha256": d.training_data_sha256, "seed": d.training_seed,
            "seconds": d.training_seconds, "steps": details.get("steps"),
            "final_loss": details.get("final_loss")}


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
    if target:
        qs = qs.filter(target__slug=target)
    if method:
        qs = qs.filter(method=method)
    if owner:
        qs = qs.filter(owner__username=owner)
    count = qs.count()
    page = qs.annotate(total_bytes=Sum("files__size")).order_by("name", "pk")[offset:offset + limit]
    return count, [drafter_api_summary(d, d.total_bytes) for d in page]


def runs_page(*, state: str | None = None, hardware: str | None = None,
              drafter: str | None = None, protocol: str | None = None,
              version: int | None = None, baseline: bool | None = None,
              limit: int = 100, offset: int = 0) -> tuple[int, list[dict]]:
    """(count, one page of runs, newest first, each with its queue position). Three
    queries."""
    qs = Run.objects.select_related("drafter", "drafter__owner", "protocol")
    if state:
        qs = qs.filter(state=state)
    if hardware:
        qs = qs.filter(hardware=hardware)
    if drafter:
        qs = qs.filter(drafter__slug=drafter)
    if protocol:
        slug, _, v = protocol.partition("@")
        qs = qs.filter(protocol__slug=slug)
        if v:
            qs = qs.filter(protocol__version=int(v))
    if version is not None:
        qs = qs.filter(protocol__version=version)
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


def results_queryset(*, protocol: str | None = None, version: int | None = None,
                     target: str | None = None, drafter: str | None = None,
                     method: str | None = None, task: str | None = None,
                     batch_size: int | None = None, temperature: float | None = None,
                     k: int | None = None, run: int | None = None,
                     run_state: str | None = None):
    """Result cells (one row per cell of a run's grid) with their provenance, in grid
    order (run, task, batch size, temperature, k). `protocol` is a slug or slug@version;
    `method` "baseline" selects the baseline runs. Cells of withdrawn or rejected drafters
    are left out, as on the leaderboard. None for a filter means every value."""
    qs = Result.objects.exclude(run__drafter__review_state__in=HIDDEN_REVIEW_STATES)
    if protocol:
        slug, _, v = protocol.partition("@")
        qs = qs.filter(run__protocol__slug=slug)
        if v:
            qs = qs.filter(run__protocol__version=int(v))
    if version is not None:
        qs = qs.filter(run__protocol__version=version)
    if target:
        qs = qs.filter(run__protocol__target__slug=target)
    if drafter:
        qs = qs.filter(run__drafter__slug=drafter)
    if method == BASELINE_METHOD:
        qs = qs.filter(run__drafter__isnull=True)
    elif method:
        qs = qs.filter(run__drafter__method=method)
    if task:
        qs = qs.filter(task=task)
    if batch_size is not None:
        qs = qs.filter(batch_size=batch_size)
    if temperature is not None:
        qs = qs.filter(temperature=temperature)
    if k is not None:
        qs = qs.filter(k=k)
    if run is not None:
        qs = qs.filter(run_id=run)
    if run_state:
        qs = qs.filter(run__state=run_state)
    return qs.order_by("run_id", "task", "batch_size", "temperature", "k")


# measured_at as datetime.isoformat(timespec="microseconds") writes it, in UTC.
ISO_UTC_SQL = ("to_char(%(expressions)s AT TIME ZONE 'UTC', "
               "'YYYY-MM-DD\"T\"HH24:MI:SS.US\"+00:00\"')")


def _result_values(qs, json_as_text: bool, time_as_text: bool = False):
    """values_list of RESULT_COLUMNS. With json_as_text the list columns come as their
    JSON text straight from the database (the CSV export writes them as they are); with
    time_as_text (PostgreSQL) measured_at comes as ISO 8601 text."""
    provenance = dict(
        protocol=F("run__protocol__slug"), protocol_version=F("run__protocol__version"),
        protocol_sha256=F("run__protocol__sha256"), target=F("run__protocol__target__slug"),
        engine=F("run__protocol__engine"), engine_version=F("run__engine_version"),
        hardware=F("run__hardware"), hardware_description=F("run__hardware_description"),
        run_state=F("run__state"), drafter=F("run__drafter__slug"),
        method=Coalesce(F("run__drafter__method"), Value(BASELINE_METHOD)),
    )
    if json_as_text:
        provenance.update({f"{c}_text": Cast(c, TextField()) for c in RESULT_JSON_COLUMNS})
    if time_as_text:
        provenance["measured_at_text"] = Func(F("measured_at"), template=ISO_UTC_SQL,
                                              output_field=TextField())
    columns = [f"{c}_text" if (json_as_text and c in RESULT_JSON_COLUMNS)
               or (time_as_text and c == "measured_at") else c for c in RESULT_COLUMNS]
    return qs.annotate(**provenance).values_list(*columns)


def result_rows(qs, *, json_as_text: bool = False, chunk_size: int = 2000):
    """Iterate the rows of a results_queryset as lists in RESULT_COLUMNS order, in chunks
    (constant memory: a server-side cursor on PostgreSQL), measured_at as ISO 8601 text."""
    at = RESULT_COLUMNS.index("measured_at")
    for row in _result_values(qs, json_as_text).iterator(chunk_size=chunk_size):
        row = list(row)
        row[at] = row[at].isoformat(timespec="microseconds")
        yield row


def result_csv_blocks(qs, block_bytes: int = 1 << 18):
    """PostgreSQL only: the CSV lines (no header) of a results_queryset in RESULT_COLUMNS
    order, written by the database itself (COPY (SELECT ...) TO STDOUT), as byte blocks of
    about block_bytes. The same query and values as result_rows(json_as_text=True); only
    the spelling differs where CSV allows it (a float 16.0 is written 16, an empty string
    ""). Constant memory: the rows stream from the server."""
    sql, params = _result_values(qs, json_as_text=True, time_as_text=True).query.sql_with_params()
    statement = f"COPY ({connection.ops.compose_sql(sql, params)}) TO STDOUT WITH (FORMAT csv)"
    with connection.cursor() as cursor:
        with cursor.copy(statement) as copy:
            parts, size = [], 0
            for block in copy:
                parts.append(block)
                size += len(block)
                if size >= block_bytes:
                    yield b"".join(parts)
                    parts, size = [], 0
            if parts:
                yield b"".join(parts)


def results_page(qs, limit: int, offset: int) -> tuple[int, list[dict]]:
    """(count, one page of a results_queryset as dicts keyed by RESULT_COLUMNS). Two
    queries."""
    at = RESULT_COLUMNS.index("measured_at")
    rows = []
    for row in _result_values(qs, json_as_text=False)[offset:offset + limit]:
        row = list(row)
        row[at] = row[at].isoformat(timespec="microseconds")
        rows.append(dict(zip(RESULT_COLUMNS, row)))
    return qs.count(), rows


# --- When does it pay? ---
# The analyses of worker.analysis on the runs' raw per-request records (read through the
# storage: runs/<id>/cells/*.jsonl.gz). A succeeded run never changes, so what comes out is
# kept in Django's cache under the ids (and queue times) of the runs it was computed from.

_log = logging.getLogger(__name__)
ANALYSIS_VERSION = 2
ANALYSIS_CACHE_SECONDS = 7 * 24 * 3600


def _cached(key_parts, build):
    """build() once per key (Django's cache; off when SPECBOARD_PAGE_CACHE_SECONDS is 0)."""
    if _settings.SPECBOARD_PAGE_CACHE_SECONDS <= 0:
        return build()
    import hashlib

    key = "analysis:" + hashlib.sha256(repr((ANALYSIS_VERSION, key_parts)).encode()).hexdigest()
    value = _cache.get(key)
    if value is None:
        value = build()
        _cache.set(key, value, ANALYSIS_CACHE_SECONDS)
    return value


def cell_records(run_id: int, cell: dict) -> list[dict]:
    """A cell's raw per-request records from the storage ([] when there are none)."""
    from worker.protocol import Cell

    from .runs import _read_gz_lines, cell_records_name

    name = cell_records_name(run_id, Cell(cell["task"], cell["batch_size"],
                                          float(cell["temperature"]), cell["k"]))
    try:
        return _read_gz_lines(name)
    except (OSError, ValueError) as e:  # a damaged file: no analysis, never a failed page
        _log.warning("cannot read %s: %s", name, e)
        return []


def _with_records(run_id, cells):
    return [{**c, "records": cell_records(run_id, c)} for c in cells]


def baseline_for_cost_model(run_id, cells):
    """A baseline run's cells as the cost model reads them: the batch-size-1 cells with
    their records (the prefill slope), the others' TPOT alone."""
    if run_id is None:
        return cells
    return [{**c, "records": cell_records(run_id, c)} if c["batch_size"] == 1 else c
            for c in cells]


def _analyse(run_id, cells_with_records, baseline_cells, method):
    """analysis.analyse_run; records that do not have the expected shape are logged and
    left out (the cells' stored figures still show), never a failed page."""
    try:
        return analysis.analyse_run(cells_with_records, baseline_cells, method)
    except (KeyError, TypeError, ValueError, ArithmeticError) as e:
        _log.warning("run %s: raw records not analysable: %r", run_id, e)
        return analysis.analyse_run([{**c, "records": []} for c in cells_with_records],
                                    baseline_cells, method)


def analysis_export_values(a: dict | None) -> list:
    """The ANALYSIS_COLUMNS of one analysed cell (Nones without one)."""
    if not a:
        return [None] * len(ANALYSIS_COLUMNS)
    shares = a.get("shares") or {}
    drafting_other = shares.get("drafting_other")
    if drafting_other is None and shares:
        parts = [shares.get(p) for p in ("drafting", "sampling", "other")]
        drafting_other = sum(parts) if all(p is not None for p in parts) else None
    return [a.get("tokens_per_step"), a.get("predicted_speedup"), a.get("engine_efficiency"),
            a.get("oracle_speedup"), a.get("no_waste_speedup"), shares.get("prefill"),
            shares.get("verification"), drafting_other]


def run_analysis(run_id: int, cells: list[dict], baseline_run_id: int | None,
                 baseline_cells: list[dict], method: str | None, cache_key=None) -> list[dict]:
    """worker.analysis.analyse_run on a run's cells and its baseline's, with the records read
    from the storage. Cached under cache_key (the runs' ids and queue times) when given:
    only for succeeded runs, whose records never change."""
    def build():
        return _analyse(run_id, _with_records(run_id, cells),
                        baseline_for_cost_model(baseline_run_id, baseline_cells), method)
    if cache_key is None:
        return build()
    return _cached(("run", cache_key), build)


def drafter_analysis(page: dict) -> dict:
    """The drafter page's "When does it pay?" section: per cell the time breakdown, the
    measured, predicted and oracle speedups, and the crossover batch size per (k,
    temperature). No query: the page's cells and baseline cells, the records from storage."""
    run, base = page.get("run"), page.get("baseline_run")
    cells = page.get("cells") or []
    if not run or not cells:
        return {"cells": [], "curves": [], "has_records": False}
    key = None
    if run["state"] == Run.SUCCEEDED and base and base["state"] == Run.SUCCEEDED:
        key = (run["id"], str(run["queued_at"]), base["id"], str(base["queued_at"]))
    method = (page.get("drafter") or {}).get("method")
    rows = run_analysis(run["id"], cells, base["id"] if base else None,
                        page.get("baseline_cells") or [], method, key)
    curves = []
    for t in sorted({c["temperature"] for c in cells}):
        base_t = [c for c in page.get("baseline_cells") or [] if c["temperature"] == t]
        for k in sorted({c["k"] for c in cells}):
            sp = analysis.speedup_by_batch([c for c in cells if c["k"] == k
                                            and c["temperature"] == t], base_t)
            by_batch = [{"batch_size": b, "measured_speedup": sp.get(b), **_pooled(
                [a for a in rows if a["k"] == k and a["temperature"] == t
                 and a["batch_size"] == b])}
                for b in sorted({c["batch_size"] for c in cells})]
            curves.append({"k": k, "temperature": t, "by_batch": by_batch,
                           "crossover": analysis.crossover(sp)})
    return {"cells": rows, "curves": curves,
            "has_records": any(r.get("steps") for r in rows)}


def _pooled(rows: list[dict]) -> dict:
    """Measured-cost pooling of analysed cells (one drafter, k, temperature and batch size,
    several tasks): predicted and oracle speedups as ratios of summed predicted times."""
    ok = [r for r in rows if r.get("predicted_speedup") and r.get("t_fwd_b")]
    if not ok:
        return {"predicted_speedup": None, "oracle_speedup": None, "shares": None}
    base_time = sum(r["tokens"] * r["t_fwd_b"] for r in ok)
    pred_time = sum(r["tokens"] * r["t_fwd_b"] / r["predicted_speedup"] for r in ok)
    oracle_time = sum(r["tokens"] * r["t_fwd_b"] / r["oracle_speedup"] for r in ok
                      if r.get("oracle_speedup"))
    walls = [r for r in rows if r.get("breakdown") and r.get("wall_seconds")]
    shares = None
    if walls:
        total = sum(r["wall_seconds"] for r in walls)
        phases = sorted({p for r in walls for p in r["breakdown"]})
        shares = {p: sum((r["breakdown"].get(p) or 0.0) for r in walls) / total for p in phases}
    return {"predicted_speedup": base_time / pred_time if pred_time else None,
            "oracle_speedup": base_time / oracle_time if oracle_time else None,
            "shares": shares}


def protocol_pays(protocol: Protocol, temperature: float | None = None) -> dict:
    """The "When does it pay?" page and GET /api/protocols/{slug}/{version}/analysis: for
    one temperature (default the protocol's first), over each drafter's newest succeeded
    run and the baseline of its engine version: the best (drafter, k) per task and batch
    size, each (drafter, k)'s speedups by batch size (measured, predicted, oracle) and
    crossover, time shares, the oracle combination across drafters and the acceptance/cost
    points with their Pareto frontier. Two queries; the records from storage; cached under
    the runs' ids (then one query)."""
    spec = protocol.spec
    temps = [float(t) for t in spec["temperatures"]]
    temperature = temps[0] if temperature is None or float(temperature) not in temps \
        else float(temperature)
    tasks = [t["task"] for t in spec["tasks"]]
    batch_sizes, ks = list(spec["batch_sizes"]), list(spec["ks"])
    drafter_runs, baselines = latest_succeeded_runs(protocol)
    key = (protocol.pk, protocol.sha256, temperature,
           sorted((r["id"], str(r["queued_at"])) for r in drafter_runs),
           sorted((r["id"], str(r["queued_at"])) for r in baselines.values()))
    ids = [r["id"] for r in drafter_runs] + [r["id"] for r in baselines.values()]

    def build():
        by_run = defaultdict(list)
        for res in (Result.objects.filter(run_id__in=ids, temperature=temperature)
                    .order_by("run_id", "task", "batch_size", "k")):
            by_run[res.run_id].append(cell_dict(res))
        return _protocol_pays(protocol, temperature, tasks, batch_sizes, ks, drafter_runs,
                              baselines, by_run)
    out = _cached(("protocol", key), build)
    return {**out, "protocol": protocol_summary(protocol)}


def _protocol_pays(protocol, temperature, tasks, batch_sizes, ks, drafter_runs, baselines,
                   by_run) -> dict:
    entries, drafters, curves, points, combine_inputs = [], [], [], [], defaultdict(dict)
    base_outputs, base_records = {}, {}
    for r in sorted(drafter_runs, key=lambda r: r["drafter"]["name"].lower()):
        d = r["drafter"]
        base_run = baselines.get(r["engine_version"])
        cells = by_run.get(r["id"], [])
        base_cells = by_run.get(base_run["id"], []) if base_run else []
        has_records = bool(r["artifact"])
        if has_records:
            cells_r = _with_records(r["id"], cells)
            has_records = any(c["records"] for c in cells_r)
            if base_run and base_run["id"] not in base_records:  # read once, not per drafter
                base_records[base_run["id"]] = _with_records(base_run["id"], base_cells)
            base_r = base_records[base_run["id"]] if base_run else []
            rows = _analyse(r["id"], cells_r, base_r, d["method"])
            if temperature == 0:
                for c in cells_r:
                    combine_inputs[(c["task"], c["batch_size"], c["k"])][d["slug"]] = c["records"]
                for c in base_r:
                    base_outputs.setdefault((c["task"], c["batch_size"]), {
                        rec["prompt_id"]: rec["output_token_ids"] for rec in c["records"]
                        if rec.get("repetition", 0) == 0})
        else:
            rows = [None] * len(cells)
        drafters.append({"drafter": d, "run_id": r["id"], "has_records": has_records,
                         "baseline_run_id": base_run["id"] if base_run else None})
        by_k = defaultdict(list)
        for c, a in zip(cells, rows):
            entries.append({"drafter": d["slug"], "k": c["k"], "task": c["task"],
                            "batch_size": c["batch_size"], "speedup": c["speedup"]})
            by_k[c["k"]].append((c, a))
        for k, pairs in sorted(by_k.items()):
            kcells = [c for c, _ in pairs]
            measured = analysis.speedup_by_batch(kcells, base_cells)
            per_b = []
            for b in batch_sizes:
                pooled = _pooled([a for c, a in pairs if a and c["batch_size"] == b])
                per_b.append({"batch_size": b, "measured_speedup": measured.get(b), **pooled})
            al = aggregate_cells(kcells, ()).get((), {}).get("acceptance_length")
            analysed = [a for _, a in pairs if a and a.get("t_overhead") is not None
                        and a.get("t_fwd_b")]
            cost = None
            if analysed:
                cost_time = sum((a["t_draft"] if a["source"] == "reference traces"
                                 else a["t_overhead"]) * a["steps"] for a in analysed)
                fwd_time = sum(a["t_fwd_b"] * a["steps"] for a in analysed)
                cost = cost_time / fwd_time if fwd_time else None
            curves.append({"drafter": d, "k": k, "by_batch": per_b,
                           "crossover": analysis.crossover(measured),
                           "mean_speedup": (sum(measured.values()) / len(measured)
                                            if measured and None not in measured.values()
                                            else None)})
            points.append({"drafter": d, "k": k, "cost": cost, "al": al})
    matrix = analysis.best_matrix(entries, tasks, batch_sizes)
    names = {x["drafter"]["slug"]: x["drafter"] for x in drafters}
    matrix_rows = []
    for t in tasks:
        row = {"task": t, "cells": []}
        for b in batch_sizes:
            m = matrix.get((t, b))
            row["cells"].append(None if m is None else {
                "batch_size": b, "drafter": names.get(m["drafter"]), "k": m["k"],
                "speedup": m["speedup"],
                "best_drafter_speedup": m.get("best_drafter_speedup", m["speedup"])})
        matrix_rows.append(row)
    combine, combine_models = [], {}
    if baselines and combine_inputs:
        base_id = next(iter(baselines.values()))["id"]
        combine_models = analysis.fit_cost_models(
            baseline_for_cost_model(base_id, by_run.get(base_id, [])))
    for (t, b, k), recs in sorted(combine_inputs.items()):
        model = combine_models.get((t, float(temperature)))
        try:
            res = analysis.oracle_combine(recs, k, model, b, base_outputs.get((t, b)))
        except (KeyError, TypeError, ValueError, ArithmeticError) as e:
            _log.warning("oracle combination of %s b=%s k=%s failed: %r", t, b, k, e)
            res = None
        if res:
            combine.append({"task": t, "batch_size": b, "k": k, **{
                x: res[x] for x in ("requests", "tokens", "steps", "al_combine",
                                    "speedup_bound")},
                "drafters": [{"drafter": names[s], "tokens_per_step": v}
                             for s, v in sorted(res["drafter_tokens_per_step"].items())]})
    return {"temperature": temperature, "tasks": tasks, "batch_sizes": batch_sizes, "ks": ks,
            "drafters": drafters, "matrix": matrix_rows, "curves": curves,
            "pareto": analysis.pareto(points), "combine": combine,
            "definitions": analysis.definitions(),
            "has_records": any(x["has_records"] for x in drafters)}


def parse_mix(text: str, tasks) -> dict[str, float]:
    """"chat:0.5,code:0.5" -> {"chat": 0.5, "code": 0.5}; ValueError naming the problem."""
    mix = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        task, sep, weight = part.partition(":")
        task = task.strip()
        if task not in tasks:
            raise ValueError(f"unknown task {task!r}: the protocol's tasks are "
                             + ", ".join(tasks))
        try:
            w = float(weight) if sep else 1.0
        except ValueError:
            raise ValueError(f"the weight of {task!r} is not a number: {weight!r}") from None
        if not (w >= 0 and w < float("inf")):
            raise ValueError(f"the weight of {task!r} must be a finite number >= 0")
        mix[task] = mix.get(task, 0.0) + w
    if not mix:
        return {t: 1.0 for t in tasks}
    analysis.normalise_mix(mix)   # raises when no weight is positive
    return mix


def recommendation(protocol: Protocol, mix: dict[str, float], batch_size: int,
                   temperature: float | None = None) -> dict:
    """The (drafter, k) with the highest measured throughput for a task mix and batch size
    (worker.analysis.recommend), the baseline included. Two queries."""
    spec = protocol.spec
    temps = [float(t) for t in spec["temperatures"]]
    temperature = temps[0] if temperature is None or float(temperature) not in temps \
        else float(temperature)
    drafter_runs, baselines = latest_succeeded_runs(protocol)
    ids = [r["id"] for r in drafter_runs] + [r["id"] for r in baselines.values()]
    rows = list(Result.objects.filter(run_id__in=ids, temperature=temperature).values(
        "run_id", "task", "batch_size", "k", "output_throughput"))
    newest = max(baselines.values(), key=lambda r: (r["queued_at"], r["id"]), default=None)
    runs = {r["id"]: r for r in drafter_runs}
    cells = [{**x, "drafter": runs[x["run_id"]]["drafter"]["slug"]} for x in rows
             if x["run_id"] in runs and baselines.get(runs[x["run_id"]]["engine_version"])]
    base_cells = [x for x in rows if newest and x["run_id"] == newest["id"]]
    # a drafter is compared with the baseline of its own engine version
    out = {"temperature": temperature, "protocol": protocol_summary(protocol)}
    result = analysis.recommend(cells, base_cells, mix, batch_size)
    names = {r["drafter"]["slug"]: r["drafter"] for r in drafter_runs}
    for o in result["options"]:
        o["drafter"] = names.get(o["drafter"]) if o["drafter"] else None
        o["per_task"] = [{"task": t, **v} for t, v in o["per_task"].items()]
    out.update(result)
    out["mix"] = [{"task": t, "weight": w} for t, w in result["mix"].items()]
    return out
