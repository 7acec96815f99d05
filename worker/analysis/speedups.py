"""The one speedup rule, used by every page, the API, the export and "When does it pay?".

A drafter cell's speedup is its stored figure: its throughput over the throughput of the
baseline cell stored with it (its *pinned* baseline: the site picks it once, when the cell
is recorded; under a paired protocol the run's own k = 0 cell). Over several cells of one
drafter and k (a leaderboard row over tasks, a batch size over tasks) the speedup is the
summed throughput of the cells over the summed throughput of their pinned baseline cells;
where any cell lacks its pinned baseline there is no speedup, rather than one over a
different set of tasks. Callers pass the pinned baseline cells as {cell_key: cell}; no
caller matches a baseline of its own.

Intervals over several cells: each cell's 95% interval is turned into log standard errors
below and above its estimate (log half-width / z); the pooled figure's are the cells'
combined in quadrature, each weighted by the cell's share of the group's wall time (a pooled
throughput is the wall-time-weighted mean of the cells' throughputs, and the cells of
different tasks are measured on different prompts, so their within-run errors are
independent). A speedup interval also carries the protocol's between-run variance
(`speedup_between_run_variance`, worker.calibration), which is not independent between the
cells of one run: a rerun moved every cell the same way (docs/measurement.md). It is taken
out of every cell's before they are combined and added once to the pooled one, so pooling
cells never averages it away. One cell: its own stored interval.

A drafter cell's speedup has two intervals (services.runs.speedup_with_interval): the one
the leaderboard ranks by (`speedup_low/high`: where a rerun on the protocol's prompts would
land) and the one across prompts (`speedup_prompts_low/high`). Both are pooled by this rule."""
from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from worker import metrics
from worker.calibration import Z
from worker.protocol import Cell


def cell_key(c) -> tuple:
    """(task, batch size, temperature): the key a drafter cell and its baseline cell share."""
    return Cell.of(c, k=0).key[:3]


def by_key(baseline_cells) -> dict[tuple, dict]:
    """{cell_key: cell} of a list of pinned baseline cells."""
    return {cell_key(c): c for c in baseline_cells}


def combined_interval(point, parts, shared_variance: float | None = None):
    """(low, high) of a pooled figure `point` from (weight, estimate, low, high) of its
    cells, with `shared_variance` (of the log figure, in every cell's interval and common
    to all of them) counted once (see the module's docstring); (None, None) when a cell has
    no interval."""
    if point is None or not parts:
        return None, None
    if len(parts) == 1:
        _, est, lo, hi = parts[0]
        return lo, hi
    total = sum(w for w, *_ in parts) or 0.0
    if not total or point <= 0 or any(lo is None or hi is None or not est or est <= 0
                                      or lo <= 0 for _, est, lo, hi in parts):
        return None, None
    shared = max(shared_variance or 0.0, 0.0)

    def side(log_half):
        own = sum((w / total) ** 2 * max((h / Z) ** 2 - shared, 0.0)
                  for (w, *_), h in zip(parts, log_half))
        return Z * math.sqrt(own + shared)

    below = side([math.log(est / lo) for _, est, lo, _ in parts])
    above = side([math.log(hi / est) for _, est, _, hi in parts])
    return point * math.exp(-below), point * math.exp(above)


def pooled(cells: list[dict], pinned: dict[tuple, dict] | None) -> dict:
    """Figures of one drafter's cells of one k (one or several tasks/batch sizes) against
    their pinned baseline cells: speedup with interval, throughput with interval,
    acceptance length (corrected, engine) with interval, tokens per step, and the
    baseline's throughput. One cell gives exactly its stored figures."""
    out = dict.fromkeys((
        "speedup", "speedup_low", "speedup_high", "speedup_prompts_low",
        "speedup_prompts_high", "output_throughput_low",
        "output_throughput_high", "acceptance_length_low", "acceptance_length_high",
        "tokens_per_step", "engine_acceptance_length", "baseline_throughput"))
    if not cells:
        return out
    wall = [c["wall_seconds"] or 0.0 for c in cells]
    thr = metrics.output_throughput(sum(c["generated_tokens"] for c in cells), sum(wall))
    out["output_throughput_low"], out["output_throughput_high"] = combined_interval(
        thr, [(w, c["output_throughput"], c.get("output_throughput_low"),
               c.get("output_throughput_high")) for w, c in zip(wall, cells)])
    drafts = sum(c["drafts"] or 0 for c in cells)
    al = 1 + sum(c["accepted_tokens"] or 0 for c in cells) / drafts if drafts else None
    out["acceptance_length_low"], out["acceptance_length_high"] = combined_interval(
        al, [(c["drafts"] or 0, c["acceptance_length"], c.get("acceptance_length_low"),
              c.get("acceptance_length_high")) for c in cells if c["drafts"]])
    steps = [c.get("decode_steps") for c in cells]
    if all(s for s in steps):
        out["tokens_per_step"] = sum(c["decode_tokens"] for c in cells) / sum(steps)
    elif len(cells) == 1:
        out["tokens_per_step"] = cells[0].get("tokens_per_step")
    engine = [(c["drafts"], c.get("engine_acceptance_length")) for c in cells if c["drafts"]]
    if engine and all(e is not None for _, e in engine):
        # drafts-weighted: the engine's own counts are not stored, its drafts are close
        out["engine_acceptance_length"] = 1 + sum(d * (e - 1) for d, e in engine) / sum(
            d for d, _ in engine)
    bases = [(pinned or {}).get(cell_key(c)) for c in cells]
    if any(b is None for b in bases):
        return out
    out["baseline_throughput"] = metrics.output_throughput(
        sum(b["generated_tokens"] for b in bases), sum(b["wall_seconds"] for b in bases))
    if len(cells) == 1:
        c = cells[0]
        out.update({f: c.get(f) for f in ("speedup", "speedup_low", "speedup_high",
                                          "speedup_prompts_low", "speedup_prompts_high")})
        return out
    out["speedup"] = metrics.speedup(thr, out["baseline_throughput"])
    shared = max((c.get("speedup_between_run_variance") or 0.0 for c in cells), default=0.0)
    for low, high in (("speedup_low", "speedup_high"),
                      ("speedup_prompts_low", "speedup_prompts_high")):
        out[low], out[high] = combined_interval(
            out["speedup"], [(w, c["speedup"], c.get(low), c.get(high))
                             for w, c in zip(wall, cells)], shared)
    return out


def speedup_by_batch(cells: list[dict], pinned: dict[tuple, dict] | None) -> dict:
    """{batch size: pooled speedup over tasks} of one drafter's cells of one k and
    temperature, against their pinned baseline cells (None where a cell has none)."""
    by_b = defaultdict(list)
    for c in cells:
        by_b[c["batch_size"]].append(c)
    return {b: pooled(cs, pinned)["speedup"] for b, cs in sorted(by_b.items())}


def mark_ties(rows: list[dict]) -> None:
    """Ranks by speedup, from the rows' 95% intervals (`rank_ranges`): a row's rank is the
    best it could hold, 1 + the rows whose whole interval lies above its (as LMSYS Arena
    ranks), and it is marked tied ("=") when another ranked row's interval overlaps its.
    So the rank is always the first of the row's plausible rank range, and a row ranks
    below another only when their intervals do not overlap: a chain of overlaps (A
    overlaps B, B overlaps C, not A and C) gives C rank 2, not A's rank. Rows listed by
    speedup may therefore show a rank that is not their position (a wide interval ranks
    high). Rows without a speedup, and rows of a run still measuring (provisional: a subset
    of the cells), get no rank and take none: the finished rows rank as if they were not
    there."""
    rank_ranges(rows)
    for r in rows:
        r["rank"] = r["rank_low"]
        r["tied"] = r["rank_low"] is not None and r["rank_high"] > r["rank_low"]


def _ranked_interval(r: dict):
    """(low, high) of a row that takes a rank (`mark_ties`'s rows), else None. A missing
    bound is the estimate itself, as in `mark_ties`."""
    if r.get("speedup") is None or (r.get("run") or {}).get("measuring"):
        return None
    lo, hi = r.get("speedup_low"), r.get("speedup_high")
    return (r["speedup"] if lo is None else lo), (r["speedup"] if hi is None else hi)


def rank_ranges(rows: list[dict]) -> None:
    """Each row's plausible rank range by speedup from the rows' 95% intervals, as public
    model leaderboards give it (LMSYS Arena's "rank (UB)"), over the rows `mark_ties` ranks
    (the same rows: rows of a run still measuring and rows without a speedup get None and
    count for no other row). For a row with interval [lo, hi]:

        rank_low  (best)  = 1 + the number of rows whose low is above hi
                            (their whole interval lies above this one's);
        rank_high (worst) = the number of rows whose high is at or above lo
                            (their interval does not lie wholly below this one's), itself
                            included.

    Intervals that touch count as overlapping. A row without an interval
    counts as the point [speedup, speedup], so without intervals the range is its position
    (equal speedups aside). Pairwise, hence independent of the rows' order; the row's
    position in speedup order always lies in its range; `mark_ties` takes its rank from it.
    Non-overlap of two 95% intervals is a conservative test of a difference, so the ranges
    are wide rather than narrow."""
    bounds = [_ranked_interval(r) for r in rows]
    ranked = [b for b in bounds if b is not None]
    lows = np.sort(np.array([lo for lo, _ in ranked], dtype=float))
    highs = np.sort(np.array([hi for _, hi in ranked], dtype=float))
    n = len(ranked)
    for r, b in zip(rows, bounds):
        if b is None:
            r["rank_low"] = r["rank_high"] = None
            continue
        lo, hi = b
        r["rank_low"] = 1 + n - int(np.searchsorted(lows, hi, side="right"))
        r["rank_high"] = n - int(np.searchsorted(highs, lo, side="left"))


def half_width(row: dict, prefix: str = "speedup"):
    """The larger half-width of a figure's interval (what the pages print after ±)."""
    v, lo, hi = row.get(prefix), row.get(f"{prefix}_low"), row.get(f"{prefix}_high")
    if v is None or lo is None or hi is None:
        return None
    return max(v - lo, hi - v)
