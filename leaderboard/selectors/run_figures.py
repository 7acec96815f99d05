"""The leaderboard's figures per run, computed once per state of the run and kept.

A leaderboard row is one group of a drafter run's cells: (batch size, temperature, k), over
one task or all tasks, divided by the baseline cells pinned to them. Its figures depend on
that run's cells and their pinned baseline cells only, so they are computed per run and
kept in Django's cache under the run's state; a page merges the pieces of the runs it
shows. When a cell lands, only that run's state changes, so only its piece is computed
again; the other runs' pieces are read back. Any set of run ids works (the caller picks
the runs: newest succeeded, running, several protocols).

The state of a run (`run_states`) is what a cell landing, a resumed attempt or the run
finishing changes (its cells_done is counted after each cell is written,
services.runs.update_progress), with the state of the succeeded baseline runs of its
protocol and hardware (a shared baseline finishing fills in earlier cells' speedups). A
piece is kept no longer than a page fragment (SPECBOARD_PAGE_CACHE_SECONDS): the same bound
on a figure written without a change of state (the analysis after a run succeeds).

There is one computation (`compute_groups`): the cached path stores its output, and
SPECBOARD_PAGE_CACHE_INCREMENTAL=0 (or a page cache of 0) calls it for every run on every
request. Figures come from shapes.aggregate_cells and speedups.pooled (worker.metrics)."""
from __future__ import annotations

import hashlib
from collections import defaultdict

from django.conf import settings
from django.core.cache import cache
from django.db.models import Count, Max

from ..models import ProtocolCalibration, Result, Run
from worker.analysis import speedups
from .pinned import baseline_runs_of, pinned_for
from .shapes import aggregate_cells, fast_url

# Bump when a group's shape or a figure's computation changes: old pieces are then ignored.
VERSION = 2


def compute_groups(run_ids, *, task=None, batch_size=None, temperature=None) -> dict:
    """{run id: [group]} for the drafter cells (k > 0) of the runs, one group per (batch
    size, temperature, k), over `task` or all tasks (None); None for a filter means every
    value. A group: {"batch_size", "temperature", "k", "cells", "requests",
    "acceptance_length", "acceptance_rate", "output_throughput", "lossless_share",
    "speedup", "speedup_low", "speedup_high", "speedup_prompts_low", "speedup_prompts_high",
    "output_throughput_low",
    "output_throughput_high", "acceptance_length_low", "acceptance_length_high",
    "tokens_per_step", "engine_acceptance_length", "baseline_throughput",
    "baseline_runs", "paired"}. Two queries."""
    qs = Result.objects.filter(run_id__in=list(run_ids), k__gt=0)
    if task:
        qs = qs.filter(task=task)
    if batch_size is not None:
        qs = qs.filter(batch_size=batch_size)
    if temperature is not None:
        qs = qs.filter(temperature=temperature)
    by_group = defaultdict(list)
    for r in qs.order_by("task"):
        by_group[(r.run_id, r.batch_size, float(r.temperature), r.k)].append(r.as_cell_dict())
    pinned = pinned_for([c for cells in by_group.values() for c in cells])
    out = defaultdict(list)
    for (run_id, b, t, k), cells in by_group.items():
        g = aggregate_cells(cells, ("batch_size", "temperature", "k"))[(b, t, k)]
        mine = pinned.get(run_id, {})
        figs = speedups.pooled(cells, mine)
        base_runs = baseline_runs_of({speedups.cell_key(c): mine[speedups.cell_key(c)]
                                               for c in cells if speedups.cell_key(c) in mine})
        out[run_id].append({
            "batch_size": b, "temperature": t, "k": k, "cells": g["cells"],
            "requests": g["requests"], "acceptance_length": g["acceptance_length"],
            "acceptance_rate": g["acceptance_rate"], "output_throughput": g["output_throughput"],
            "lossless_share": g["lossless_share"], **figs,
            "baseline_runs": [{"id": i, "url": fast_url("run", i), "same_run": i == run_id}
                              for i in base_runs],
            "paired": base_runs == [run_id]})
    for piece in out.values():
        piece.sort(key=lambda g: (g["batch_size"], g["temperature"], g["k"]))
    return dict(out)


# The fields of a run whose change makes its figures computed again (with its baselines').
STATE_FIELDS = ("state", "cells_done", "attempts", "finished_at", "engine_version")


def baseline_states(protocol_ids) -> dict[tuple, tuple]:
    """{(protocol id, hardware): state of its succeeded baseline runs} and {("calibration",
    protocol id): its newest calibration}: a calibration re-divides the protocol's cells
    (services.calibration.apply) without changing any run. Two queries."""
    protocol_ids = set(protocol_ids)
    states = {(b["protocol_id"], b["hardware"]): (b["n"], b["last"], str(b["finished"]))
              for b in Run.objects.filter(protocol_id__in=protocol_ids, drafter__isnull=True,
                                          state=Run.SUCCEEDED)
              .values("protocol_id", "hardware")
              .annotate(n=Count("id"), last=Max("id"), finished=Max("finished_at")).order_by()}
    for c in (ProtocolCalibration.objects.filter(protocol_id__in=protocol_ids)
              .values("protocol_id").annotate(last=Max("id")).order_by()):
        states[("calibration", c["protocol_id"])] = c["last"]
    return states


def run_state(run: dict, baselines: dict) -> tuple:
    """The state of a run (a dict with "protocol_id", "hardware" and STATE_FIELDS)."""
    return (*(str(run[f]) for f in STATE_FIELDS),
            baselines.get((run["protocol_id"], run["hardware"])),
            baselines.get(("calibration", run["protocol_id"])))


def run_states(run_ids) -> dict[int, tuple]:
    """{run id: its state} (see the module's docstring). Three queries."""
    rows = list(Run.objects.filter(pk__in=list(run_ids)).values(
        "id", "protocol_id", "hardware", *STATE_FIELDS))
    baselines = baseline_states(r["protocol_id"] for r in rows)
    return {r["id"]: run_state(r, baselines) for r in rows}


def _key(run_id: int, state: tuple, filters: tuple) -> str:
    digest = hashlib.sha256(repr((VERSION, state, filters)).encode()).hexdigest()[:24]
    return f"run-figures:{run_id}:{digest}"


def cache_enabled() -> bool:
    return settings.SPECBOARD_PAGE_CACHE_SECONDS > 0 and settings.SPECBOARD_PAGE_CACHE_INCREMENTAL


# A group as kept: its values in this order (a tuple pickles and loads faster than a dict).
GROUP_FIELDS = ("batch_size", "temperature", "k", "cells", "requests", "acceptance_length",
                "acceptance_rate", "output_throughput", "lossless_share", "speedup",
                "speedup_low", "speedup_high", "speedup_prompts_low", "speedup_prompts_high",
                "output_throughput_low", "output_throughput_high", "acceptance_length_low",
                "acceptance_length_high", "tokens_per_step", "engine_acceptance_length",
                "baseline_throughput", "baseline_runs", "paired")


def groups(run_ids, *, task=None, batch_size=None, temperature=None, k=None,
           states: dict | None = None) -> dict:
    """`compute_groups` of the runs, each run's piece read from the cache when its state
    has not changed, else computed (all the missing runs in one go) and kept; groups of
    another k than `k` (if given) left out. `states`: {run id: `run_state`} when the
    caller has read them (else two queries). Two more queries when a piece is missing."""
    run_ids = list(run_ids)
    filters = (task or None, batch_size, None if temperature is None else float(temperature))
    if not cache_enabled():
        out = compute_groups(run_ids, task=task, batch_size=batch_size, temperature=temperature)
    else:
        if states is None:
            states = run_states(run_ids)
        keys = {run_id: _key(run_id, states[run_id], filters) for run_id in run_ids
                if run_id in states}
        kept = cache.get_many(list(keys.values()))
        out = {run_id: [dict(zip(GROUP_FIELDS, g)) for g in kept[key]]
               for run_id, key in keys.items() if key in kept}
        missing = [run_id for run_id in keys if run_id not in out]
        if missing:
            computed = compute_groups(missing, task=task, batch_size=batch_size,
                                      temperature=temperature)
            fresh = {run_id: computed.get(run_id, []) for run_id in missing}
            cache.set_many({keys[run_id]: [tuple(g[f] for f in GROUP_FIELDS) for g in piece]
                            for run_id, piece in fresh.items()},
                           settings.SPECBOARD_PAGE_CACHE_SECONDS)
            out.update(fresh)
    if k is not None:
        out = {run_id: [g for g in piece if g["k"] == k] for run_id, piece in out.items()}
    return {run_id: piece for run_id, piece in out.items() if piece}
