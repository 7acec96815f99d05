"""The leaderboard and the compare page: each drafter's shown run under a protocol (its
newest succeeded run; for a drafter with none, its run still measuring, marked), its cells
aggregated, and the baseline cells its speedups divide by."""
from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple
from urllib.parse import urlencode

from django.db.models import Count, Max, Min, Q, Sum
from django.urls import reverse

from worker.analysis import speedups

from ..models import Protocol, Result, Run
from . import run_figures
from .pinned import baseline_runs_of, pinned_for
from .shapes import (ALL, HIDDEN_REVIEW_STATES, METHOD_LABELS, fast_url, figures_from_sums,
                     filtered, protocol_summary, sum_annotations, unprefix)


SORT_KEYS = ("name", "method", "k", "batch_size", "temperature", "acceptance_length",
             "tokens_per_step", "acceptance_rate", "output_throughput", "speedup",
             "lossless_share")
RUN_FIELDS = ("id", "drafter_id", "protocol_id", "engine_version", "hardware",
              "hardware_description", "artifact", "queued_at", "state", "cells_done",
              "cells_total", "attempts", "finished_at")
# A group's figures that a row carries beside the common ones (selectors.run_figures).
GROUP_EXTRA = ("speedup", "speedup_low", "speedup_high", "speedup_prompts_low",
               "speedup_prompts_high", "output_throughput_low",
               "output_throughput_high", "acceptance_length_low", "acceptance_length_high",
               "tokens_per_step", "engine_acceptance_length", "baseline_runs", "paired")
DRAFTER_FIELDS = ("slug", "name", "method", "owner_id", "owner__username", "review_state",
                  "claimed_acceptance_length", "claimed_speedup", "claimed_source")


def _summary_from_values(v: dict) -> dict:
    d = {f: v[f"drafter__{f}"] for f in DRAFTER_FIELDS}
    return {"id": v["drafter_id"], "slug": d["slug"], "name": d["name"], "method": d["method"],
            "method_label": METHOD_LABELS.get(d["method"], d["method"]),
            "owner": d["owner__username"], "owner_id": d["owner_id"],
            "review_state": d["review_state"], "url": fast_url("drafter", d["slug"], "x-slug-x"),
            "claimed_acceptance_length": d["claimed_acceptance_length"],
            "claimed_speedup": d["claimed_speedup"], "claimed_source": d["claimed_source"]}


def pick_shown(runs, state=lambda r: r["state"], cells_done=lambda r: r["cells_done"]):
    """(the run shown, the run re-measuring it) among one drafter's runs under one protocol,
    newest first: its newest succeeded run, and the newest running run queued after it
    (None when there is none); for a drafter without a succeeded run, its newest running run
    that has measured a cell, and None. The leaderboard, compare, "When does it pay?" and
    the drafter page all choose with this."""
    for i, r in enumerate(runs):
        if state(r) == Run.SUCCEEDED:
            newer = next((x for x in runs[:i] if state(x) == Run.RUNNING), None)
            return r, newer
    return next((r for r in runs if state(r) == Run.RUNNING and cells_done(r)), None), None


def shown_runs(protocol: Protocol, method: str | None = None, baselines_only: bool = False,
               slugs=None, include_running: bool = True):
    """(the run shown for each drafter (`pick_shown`), {engine version: newest succeeded
    baseline run}), drafters withdrawn or rejected left out. Runs are dicts (RUN_FIELDS,
    "drafter": a drafter summary or None, "artifact_url", "url", "measuring": the run is
    still running, "remeasuring": None or the running run re-measuring a succeeded one, as
    {"id", "cells_done", "cells_total", "url"}). A running shared baseline is never shown:
    speedups divide only by succeeded ones (services.baselines). Without include_running
    only succeeded runs are shown (and none is marked re-measuring). One query."""
    states = [Run.SUCCEEDED, Run.RUNNING] if include_running else [Run.SUCCEEDED]
    qs = (Run.objects.filter(protocol=protocol, state__in=states)
          .exclude(drafter__review_state__in=HIDDEN_REVIEW_STATES)
          .order_by("-queued_at", "-pk"))
    if baselines_only:
        qs = qs.filter(drafter__isnull=True)
    elif slugs is not None:
        qs = qs.filter(Q(drafter__slug__in=slugs) | Q(drafter__isnull=True))
    elif method:
        qs = qs.filter(Q(drafter__method=method) | Q(drafter__isnull=True))
    by_drafter, baselines = defaultdict(list), {}
    for v in qs.values(*RUN_FIELDS, *(f"drafter__{f}" for f in DRAFTER_FIELDS)):
        if v["drafter_id"] is None:
            if v["state"] == Run.SUCCEEDED and v["engine_version"] not in baselines:
                baselines[v["engine_version"]] = _run_values(v, None)
        else:
            by_drafter[v["drafter_id"]].append(v)
    drafter_runs = []
    for runs in by_drafter.values():
        shown, newer = pick_shown(runs)
        if shown is not None:
            run = _run_values(shown, _summary_from_values(shown))
            run["remeasuring"] = None if newer is None else {
                "id": newer["id"], "cells_done": newer["cells_done"],
                "cells_total": newer["cells_total"], "url": fast_url("run", newer["id"])}
            drafter_runs.append(run)
    return drafter_runs, baselines


def latest_succeeded_runs(protocol: Protocol, **kwargs):
    """`shown_runs` of succeeded runs only (the recommender weighs whole task mixes)."""
    return shown_runs(protocol, include_running=False, **kwargs)


def _run_values(v: dict, drafter: dict | None) -> dict:
    run = {f: v[f] for f in RUN_FIELDS}
    run["drafter"] = drafter
    run["artifact_url"] = fast_url("run_artifact", v["id"]) if v["artifact"] else None
    run["url"] = fast_url("run", v["id"])
    run["measuring"] = v["state"] == Run.RUNNING
    run["remeasuring"] = None
    return run


class Landing(NamedTuple):
    """What changes while cells land: the protocol's visible running runs (baselines
    included), the cells they have measured, their attempts."""
    running_runs: int
    cells_done: int | None
    attempts: int | None


class Signature(NamedTuple):
    settled: tuple
    landing: Landing


def leaderboard_signature(protocol: Protocol) -> Signature:
    """(settled, landing) for caching (views.cached_fragment): settled changes whenever the
    runs a leaderboard shows change (a run succeeds, a drafter is withdrawn or approved),
    landing whenever a cell lands in a running run (pages show running runs' cells as they
    land; selectors.run_figures keeps the rebuild to that run). One query."""
    visible = Q(state__in=[Run.SUCCEEDED, Run.RUNNING]) & ~Q(
        drafter__review_state__in=HIDDEN_REVIEW_STATES)
    running = Q(state=Run.RUNNING)
    agg = (Run.objects.filter(protocol=protocol).filter(visible)
           .aggregate(n=Count("id", filter=~running), last=Max("id", filter=~running),
                      finished=Max("finished_at", filter=~running),
                      running=Count("id", filter=running),
                      cells=Sum("cells_done", filter=running),
                      attempts=Sum("attempts", filter=running)))
    return Signature((protocol.pk, protocol.sha256, agg["n"], agg["last"],
                      agg["finished"].isoformat() if agg["finished"] else None),
                     Landing(agg["running"], agg["cells"], agg["attempts"]))


def smallest_measured_batch_size(protocol: Protocol, landing: Landing, *,
                                 task: str | None = None, temperature: float | None = None,
                                 k: int | None = None, method: str | None = None) -> int:
    """The leaderboard's default batch size: the smallest with drafter cells (k > 0, under
    these filters; None: every value) in the runs `leaderboard` shows. That is the
    protocol's smallest while no shown run is still measuring (a succeeded run has every
    cell); a run still measuring may have cells at a larger batch size only (it measures its
    first comparison at the largest one: worker.measure.first_comparison). `landing` is
    `leaderboard_signature`'s (the page reads it for its cache anyway): while no running run
    has measured a cell, no query; two otherwise."""
    smallest = min(protocol.spec.batch_sizes)
    if not landing.cells_done:
        return smallest
    drafter_runs, _ = shown_runs(protocol, method)
    if not any(r["measuring"] for r in drafter_runs):
        return smallest
    measured = filtered(Result.objects.filter(run_id__in=[r["id"] for r in drafter_runs],
                                              k__gt=0), task=task, temperature=temperature, k=k)
    return measured.aggregate(b=Min("batch_size"))["b"] or smallest


def leaderboard(protocol: Protocol, *, task: str | None = None, batch_size: int | None = None,
                temperature: float | None = None, k: int | None = None,
                method: str | None = None, sort: str = "speedup",
                descending: bool = True) -> dict:
    """The leaderboard of one protocol: one row per (drafter, batch size, temperature, k)
    from each drafter's shown run (`shown_runs`: its newest succeeded run, else its run
    still measuring), figures over one task or all tasks (None), and the baseline rows.
    None for a filter means every value (the page's default batch size is
    `smallest_measured_batch_size`). Rows of a run still measuring are marked "measuring",
    sorted among the others by their figure and never ranked: ranks and ties are those of
    the finished rows alone. Every row has its plausible rank range by speedup
    ("rank_low", "rank_high": worker.analysis.speedups.rank_ranges, over the same rows the
    ranks are of: every finished row the filters show, whatever the sort). Two or three
    queries.

    Returns {"protocol", "filters", "choices", "rows", "baseline_rows", "runs_info",
    "drafters"}; a row: {"drafter" (drafter summary), "run_id", "task", "batch_size",
    "temperature", "k", "cells", "requests", "acceptance_length", "acceptance_rate",
    "output_throughput", "speedup", "lossless_share", "baseline_throughput",
    "engine_version", "hardware_description", "artifact_url", "run" (the run: "measuring",
    "cells_done", "cells_total", "url", "remeasuring"), "tasks_measured", "rank_low",
    "rank_high", and when sorted by speedup, best first, "rank" and "tied"}; "export": the
    URLs of this table in the API ({"csv", "json"})."""
    spec = protocol.spec
    drafter_runs, baselines = shown_runs(protocol, method)
    run_by_id = {r["id"]: r for r in drafter_runs}
    run_by_id.update({r["id"]: r for r in baselines.values()})

    # Drafter rows: the groups of each drafter run's cells (k > 0), each divided by the
    # baseline cells stored with them (selectors.pinned, worker.analysis.speedups), computed per run and kept
    # while the run does not change (selectors.run_figures).
    states = None
    if run_figures.cache_enabled():  # the runs' states from the runs read above
        base_states = run_figures.baseline_states([protocol.pk])
        states = {r["id"]: run_figures.run_state(r, base_states) for r in drafter_runs}
    pieces = run_figures.groups([r["id"] for r in drafter_runs], task=task,
                                batch_size=batch_size, temperature=temperature, k=k,
                                states=states)

    def row(run, g, base_thr, extra=None):
        return {
            "drafter": run["drafter"], "run_id": run["id"], "task": task or ALL,
            "batch_size": g["batch_size"], "temperature": float(g["temperature"]),
            "k": g["k"], "cells": g["cells"], "requests": g["requests"],
            "acceptance_length": g["acceptance_length"], "acceptance_rate": g["acceptance_rate"],
            "output_throughput": g["output_throughput"], "speedup": None,
            "lossless_share": g["lossless_share"], "baseline_throughput": base_thr,
            "engine_version": run["engine_version"],
            "hardware_description": run["hardware_description"],
            "artifact_url": run["artifact_url"],
            "run": {f: run[f] for f in ("measuring", "cells_done", "cells_total", "url",
                                        "remeasuring")},
            "tasks_measured": g["cells"] if not task else 1, **(extra or {}),
        }

    rows = []
    for run in drafter_runs:
        for g in pieces.get(run["id"], ()):
            figs = {f: g[f] for f in GROUP_EXTRA}
            rows.append(row(run, g, g["baseline_throughput"], figs))

    # The newest succeeded shared baseline run's cells, for reference (paired protocols
    # have none: each drafter run holds its own).
    baseline_rows = []
    newest_base = max(baselines.values(), key=lambda r: (r["queued_at"], r["id"]), default=None)
    if newest_base is not None:
        groups = (filtered(Result.objects.filter(run_id=newest_base["id"]), task=task,
                           batch_size=batch_size, temperature=temperature)
                  .values("run_id", "batch_size", "temperature", "k")
                  .annotate(**sum_annotations()).order_by("batch_size", "temperature"))
        for g in map(unprefix, groups):
            figs = {**g, **figures_from_sums(g)}
            baseline_rows.append(row(newest_base, figs, figs["output_throughput"]))

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
    if sort == "speedup" and descending:
        speedups.mark_ties(rows)
    speedups.rank_ranges(rows)

    runs_info = sorted({(r["engine_version"], r["hardware_description"], r["hardware"])
                        for r in run_by_id.values()})
    methods = sorted({r["drafter"]["method"] for r in drafter_runs})
    return {
        "protocol": protocol_summary(protocol),
        "filters": {"task": task or ALL, "batch_size": batch_size, "temperature": temperature,
                    "k": k, "method": method, "sort": sort, "descending": descending},
        "choices": {"tasks": list(spec.task_names), "batch_sizes": list(spec.batch_sizes),
                    "temperatures": list(spec.temperatures), "ks": list(spec.ks),
                    "methods": methods},
        "rows": rows, "baseline_rows": baseline_rows,
        "runs_info": [{"engine_version": e, "hardware_description": h, "hardware": hw}
                      for e, h, hw in runs_info],
        "drafters": len(drafter_runs),
        "export": {fmt: export_url(protocol, task=task, batch_size=batch_size,
                                   temperature=temperature, k=k, method=method, fmt=fmt)
                   for fmt in ("csv", "json")},
    }


def export_url(protocol: Protocol, *, task=None, batch_size=None, temperature=None, k=None,
               method=None, fmt: str = "csv") -> str:
    """The API's URL of the leaderboard table under these filters (None: every value, as
    in `leaderboard`), as CSV (a download) or JSON (the API's answer)."""
    query = {"batch_size": "all" if batch_size is None else batch_size,
             "temperature": "all" if temperature is None else f"{temperature:g}"}
    query.update({name: v for name, v in (("task", task), ("k", k), ("method", method))
                  if v is not None})
    if fmt == "csv":
        query["format"] = "csv"
    return (reverse("api:protocol_leaderboard", args=[protocol.slug, protocol.version])
            + "?" + urlencode(query))


def resolve_filters(protocol: Protocol, *, task: str | None = None, batch_size=None,
                    temperature=None, k=None, method: str | None = None,
                    lenient: bool = False, signature=None) -> dict:
    """The leaderboard's filters from a request's, for the page and the API alike: "all"
    for batch size or temperature is every value (None), an absent one the default (batch
    size: `smallest_measured_batch_size`; temperature: the protocol's first). A value the
    protocol does not measure raises ValueError(filter, message) (the API's 422), or with
    ``lenient`` (the page, whose links a user may edit) is taken as absent. ``signature``:
    a callable giving `leaderboard_signature(protocol)` when the caller has read it (the
    page caches it), so it is read at most once."""
    spec = protocol.spec

    def refuse(name, message):
        if not lenient:
            raise ValueError(name, message)

    def number(cast, value):
        try:
            return cast(value)
        except (TypeError, ValueError):
            return None

    if task is not None and task not in spec.task_names:
        refuse("task", "the protocol's tasks are " + ", ".join(spec.task_names))
        task = None
    if k is not None and number(int, k) not in spec.ks:
        refuse("k", "the protocol's ks are " + ", ".join(map(str, spec.ks)))
        k = None
    k = None if k is None else int(k)
    if method is not None and method not in METHOD_LABELS:
        refuse("method", "the methods are " + ", ".join(METHOD_LABELS))
        method = None
    if temperature == "all":
        temperature = None
    elif temperature is not None and number(float, temperature) not in spec.temperatures:
        refuse("temperature", "the protocol's temperatures are " + ", ".join(
            f"{t:g}" for t in spec.temperatures))
        temperature = spec.temperatures[0]
    else:
        temperature = spec.temperatures[0] if temperature is None else float(temperature)
    if batch_size == "all":
        batch_size = None
    elif batch_size is not None and number(int, batch_size) in spec.batch_sizes:
        batch_size = int(batch_size)
    else:
        if batch_size is not None:
            refuse("batch_size", "the protocol's batch sizes are " + ", ".join(
                map(str, spec.batch_sizes)))
        landing = (signature or (lambda: leaderboard_signature(protocol)))().landing
        batch_size = smallest_measured_batch_size(protocol, landing, task=task,
                                                  temperature=temperature, k=k, method=method)
    return {"task": task, "batch_size": batch_size, "temperature": temperature, "k": k,
            "method": method}


def compare_candidates(protocol: Protocol) -> list[dict]:
    """Drafters with a run shown under the protocol (succeeded, or still measuring: then
    "measuring" is true), for the compare form."""
    drafter_runs, _ = shown_runs(protocol)
    return sorted(({**r["drafter"], "measuring": r["measuring"]} for r in drafter_runs),
                  key=lambda d: d["name"].lower())


def compare(protocol: Protocol, slugs: list[str]) -> dict:
    """2-4 drafters side by side on one protocol: each drafter's shown run (`shown_runs`:
    newest succeeded, else still measuring, its "measuring" flag set) and its cells, and the
    baseline cells each of them divides by. Two queries.

    Returns {"protocol", "entries": [{"drafter", "run", "cells", "baseline_cells"}],
    "missing": [slugs without a succeeded or measuring run under the protocol]}."""
    drafter_runs, _ = shown_runs(protocol, slugs=list(slugs))
    latest = {r["drafter"]["slug"]: r for r in drafter_runs}
    chosen = [latest[s] for s in slugs if s in latest]
    ids = [r["id"] for r in chosen]
    by_run = defaultdict(list)
    for res in (Result.objects.filter(run_id__in=ids, k__gt=0)
                .order_by("task", "batch_size", "temperature", "k")):
        by_run[res.run_id].append(res.as_cell_dict())
    pinned_of = pinned_for([c for cells in by_run.values() for c in cells])
    entries = []
    for r in chosen:
        mine = pinned_of.get(r["id"], {})
        entries.append({"drafter": r["drafter"], "run": r, "cells": by_run[r["id"]],
                        "baseline_cells": sorted(mine.values(), key=speedups.cell_key),
                        "baseline_run_ids": baseline_runs_of(mine)})
    return {"protocol": protocol_summary(protocol), "entries": entries,
            "missing": [s for s in slugs if s not in latest]}
