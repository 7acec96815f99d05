"""A protocol's between-run component of the speedup interval, and the rerun z-table.

A cell's speedup interval (worker.intervals) covers its own run's prompts and passes. Two
runs of the same drafter differ by more: the engine start, the machine's state, drift over
the hour between them. The model, in log space, for the speedup of cell c in run r on the
protocol's prompts:

    log s_rc = mu_c + P_c + delta_rc + e_rc

P_c: which prompts the protocol drew (the same in every run of the protocol); e_rc: the
timing noise between passes within the run, variance p_rc^2; delta_rc: the between-run
shift, variance tau^2, one figure per protocol. A cell's bootstrap interval has the
within-run standard error w_rc (prompts and passes: Var(P) + p^2). The stored interval, in
log space, has half-width^2 = (z w)^2 + z^2 tau^2 (``widen``): an interval for the drafter's
speedup on the task that holds for a new run, not only for its own.

Estimating tau^2 (``between_run_variance``): the same drafter measured in R >= 2 runs gives
each cell R log-speedups on the SAME prompts, so P_c cancels in their spread:
E[sum (y - mean)^2] = (R - 1) tau^2 + (R - 1) / R * sum p^2. The method of moments pools
that over cells: tau^2 = sum over cells of (SS - (R - 1) / R * sum p^2) / sum (R - 1),
floored at 0 (a negative estimate means the runs agree better than their passes say). With
two runs a cell contributes (d^2 - p_1^2 - p_2^2) / 2, d the difference of its two
log-speedups. p comes from the passes alone, prompts held fixed
(worker.intervals.speedup_passes_standard_error). Subtracting the full w^2 instead would
subtract the prompts' variance, which a rerun on the same prompts does not see, and
underestimate tau^2 by it (where prompts set the interval's width, to 0). A cell without
p (one pass) uses w: conservative for the interval, low for tau^2.

The z-table (``z_rows``): for a cell measured in two runs, z = (log s_1 - log s_2) / se.
From the stored intervals (``between_run=None``): se = sqrt(se_1^2 + se_2^2), each the log
half-width of that run's interval on the side facing the other run / z; those intervals
include the prompts' variance, which cancels between runs on the same prompts, so this z is
conservative (|z| <= 1.96 in 95% of cells or more). The rerun z (``between_run=tau^2``):
se = sqrt(p_1^2 + p_2^2 + 2 tau^2), the variance of d under the model: calibrated means
|z| <= 1.96 in about 95% of cells (``share_within``). With tau^2 from the same runs that is
true on average by construction; the held-out z (``held_out_rows``) takes each task's tau^2
from the other tasks' cells, so a task's differences are judged by an estimate they did
not make: the out-of-sample check one pair of runs can give."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

from scipy.special import ndtri

CONFIDENCE = 0.95
Z = float(ndtri(1 - (1 - CONFIDENCE) / 2))   # 1.959964...


def _positive(*xs) -> bool:
    return all(x is not None and x > 0 and math.isfinite(x) for x in xs)


def log_standard_error(point, low, high, side: str | None = None) -> float | None:
    """The standard error of log(point) a 95% interval implies: its log width / (2 z), or
    with ``side`` "low" / "high" that side's log half-width / z. None without an
    interval."""
    if not _positive(point, low, high):
        return None
    if side == "low":
        return (math.log(point) - math.log(low)) / Z
    if side == "high":
        return (math.log(high) - math.log(point)) / Z
    return (math.log(high) - math.log(low)) / (2 * Z)


def widen(point, low, high, variance: float, z: float = Z):
    """(low, high) of an interval with the between-run ``variance`` of the log figure added:
    each side's log half-width h becomes sqrt(h^2 + z^2 variance). An interval that is
    missing stays missing; a variance of 0 changes nothing."""
    if not variance or variance <= 0 or not _positive(point, low, high):
        return low, high
    extra = z * z * variance
    below = math.sqrt((math.log(point) - math.log(low)) ** 2 + extra)
    above = math.sqrt((math.log(high) - math.log(point)) ** 2 + extra)
    return point * math.exp(-below), point * math.exp(above)


def rerun_interval(point, passes_se, variance, z: float = Z):
    """(low, high) of the interval a rerun on the same prompts would fall in: the passes'
    log standard error (prompts held fixed) and the between-run ``variance``, log
    half-width z sqrt(passes_se^2 + variance). This is the interval the leaderboard ranks
    by: two drafters of one protocol are measured on the same prompts, so what the prompts
    add (P_c in the model above) is common to both and cannot reorder them; what can is the
    pass-to-pass noise and the between-run shift. (None, None) without a passes_se, or
    without a calibration (``variance`` None): a passes-only interval would claim a
    precision that reruns do not show."""
    if passes_se is None or variance is None or not _positive(point) or passes_se < 0:
        return None, None
    half = z * math.sqrt(passes_se * passes_se + max(variance, 0.0))
    return point * math.exp(-half), point * math.exp(half)


@dataclass(frozen=True)
class Measured:
    """One cell of one run: its key (drafter, task, batch size, temperature, k: what must
    agree for two runs to measure the same thing), its run, its speedup with an interval
    (within-run, or as stored), and the log standard error from its passes alone, prompts
    held fixed (None when unknown)."""
    key: tuple
    run_id: int
    speedup: float
    low: float
    high: float
    passes_se: float | None = None

    def rerun_variance(self) -> float | None:
        """The within-run variance a rerun on the same prompts sees: passes_se^2, else the
        interval's (conservative)."""
        if self.passes_se is not None:
            return self.passes_se ** 2
        se = log_standard_error(self.speedup, self.low, self.high)
        return None if se is None else se * se


@dataclass(frozen=True)
class Estimate:
    """The pooled between-run variance of the log-speedup and what it came from."""
    variance: float                 # floored at 0: what is applied
    raw_variance: float | None      # the method-of-moments figure before the floor
    cells: int                      # cells measured in two or more runs
    degrees_of_freedom: int         # sum over those cells of (runs - 1)
    run_ids: tuple = field(default=())


def between_run_variance(measured) -> Estimate:
    """Method-of-moments estimate of tau^2 (the module's docstring) from ``Measured`` cells
    (``rerun_variance`` as each one's within-run variance): grouped by key; a key measured
    in fewer than two runs, or a cell without an interval, adds nothing. A run that
    measured a key twice counts once (the first)."""
    groups: dict = {}
    for m in measured:
        variance = m.rerun_variance()
        if variance is None or not _positive(m.speedup):
            continue
        runs = groups.setdefault(m.key, {})
        runs.setdefault(m.run_id, (math.log(m.speedup), variance))
    numerator, dof, cells, run_ids = 0.0, 0, 0, set()
    for runs in groups.values():
        r = len(runs)
        if r < 2:
            continue
        ys = [y for y, _ in runs.values()]
        mean = sum(ys) / r
        ss = sum((y - mean) ** 2 for y in ys)
        numerator += ss - (r - 1) / r * sum(v for _, v in runs.values())
        dof += r - 1
        cells += 1
        run_ids.update(runs)
    if not dof:
        return Estimate(0.0, None, 0, 0, ())
    raw = numerator / dof
    return Estimate(max(raw, 0.0), raw, cells, dof, tuple(sorted(run_ids)))


@dataclass(frozen=True)
class ZRow:
    """A cell measured in two runs: both speedups, the combined standard error of their
    log difference, and z (None without intervals)."""
    key: tuple
    run_a: int
    run_b: int
    speedup_a: float
    speedup_b: float
    standard_error: float | None
    z: float | None


def z_row(a: Measured, b: Measured, between_run: float | None = None) -> ZRow:
    """z = (log s_a - log s_b) / se. ``between_run`` None: se = sqrt(se_a^2 + se_b^2),
    each from the side of its interval that faces the other speedup (stored intervals).
    Else the rerun se = sqrt(a's and b's ``rerun_variance`` + 2 between_run)."""
    diff = math.log(a.speedup) - math.log(b.speedup) if _positive(a.speedup, b.speedup) \
        else None
    se = None
    if diff is not None and between_run is None:
        se_a = log_standard_error(a.speedup, a.low, a.high, side="low" if diff >= 0 else "high")
        se_b = log_standard_error(b.speedup, b.low, b.high, side="high" if diff >= 0 else "low")
        if se_a is not None and se_b is not None:
            se = math.hypot(se_a, se_b)
    elif diff is not None:
        va, vb = a.rerun_variance(), b.rerun_variance()
        if va is not None and vb is not None:
            se = math.sqrt(va + vb + 2 * max(between_run, 0.0))
    if se is None:
        return ZRow(a.key, a.run_id, b.run_id, a.speedup, b.speedup, None, None)
    if se == 0:
        z = 0.0 if diff == 0 else math.copysign(math.inf, diff)
    else:
        z = diff / se
    return ZRow(a.key, a.run_id, b.run_id, a.speedup, b.speedup, se, z)


def z_rows(measured, between_run: float | None = None) -> list[ZRow]:
    """A row (``z_row``) for every key and every pair of runs that measured it (runs in id
    order), sorted by key, then runs."""
    by_key: dict = {}
    for m in measured:
        by_key.setdefault(m.key, {}).setdefault(m.run_id, m)
    rows = []
    for key in sorted(by_key, key=repr):
        runs = by_key[key]
        for ra, rb in itertools.combinations(sorted(runs), 2):
            rows.append(z_row(runs[ra], runs[rb], between_run))
    return rows


def task_of(key) -> str:
    """The task of a cell key (drafter, task, batch size, temperature, k): the default fold
    of ``held_out_rows``."""
    return key[1]


def held_out_estimates(measured, fold=task_of) -> dict:
    """{fold: the ``between_run_variance`` estimate of the cells of every OTHER fold}, the
    folds in a stable order: what ``held_out_rows`` judges each fold's cells by."""
    measured = list(measured)
    return {f: between_run_variance([m for m in measured if fold(m.key) != f])
            for f in sorted({fold(m.key) for m in measured}, key=repr)}


def held_out_rows(measured, fold=task_of) -> list[ZRow]:
    """The rerun z (``z_rows`` with a between-run variance) with each cell's tau^2 estimated
    from the cells of the OTHER folds only (``between_run_variance`` over the cells whose
    ``fold(key)`` differs; by default the other tasks): an out-of-sample check of the
    calibration from the same runs. The in-sample z uses a tau^2 that these very
    differences made, so it is calibrated on average by construction; a fold whose
    shifts are larger or smaller than the rest's shows here as |z| > 1.96 too often or too
    seldom. A row whose complement has no estimate (a single fold) gets no z."""
    measured = list(measured)
    rows = []
    for f, rest in held_out_estimates(measured, fold).items():
        inside = [m for m in measured if fold(m.key) == f]
        if not rest.degrees_of_freedom:
            rows += [replace(r, standard_error=None, z=None) for r in z_rows(inside)]
            continue
        rows += z_rows(inside, between_run=rest.variance)
    return sorted(rows, key=lambda r: (repr(r.key), r.run_a, r.run_b))


def count_within(zs, bound: float = 1.96) -> tuple[int, int]:
    """(how many of the z's that are not None have |z| <= bound, how many are not None)."""
    zs = [z for z in zs if z is not None]
    return sum(abs(z) <= bound for z in zs), len(zs)


def _share(zs, bound: float = 1.96) -> float | None:
    within, judged = count_within(zs, bound)
    return within / judged if judged else None


def share_within(rows, bound: float = 1.96) -> float | None:
    """The share of rows with a z whose |z| <= bound (calibrated: about 95% at 1.96); None
    when no row has a z."""
    return _share((r.z for r in rows), bound)


def widened(measured, variance: float) -> list[Measured]:
    """The cells with the between-run ``variance`` added to their intervals (``widen``)."""
    out = []
    for m in measured:
        lo, hi = widen(m.speedup, m.low, m.high, variance)
        out.append(Measured(m.key, m.run_id, m.speedup, lo, hi, m.passes_se))
    return out


Z_COLUMNS = ("z_stored", "z_within", "z_rerun", "z_held_out")


def rerun_table(stored, within, between_run: float, fold=task_of) -> list[dict]:
    """The rerun z-table: a row for every key and pair of runs in ``stored`` (the cells as
    the site stores them), with four z's -- ``z_stored`` from the stored intervals,
    ``z_within`` from the within-run intervals in ``within`` (the same cells before any
    calibration: what the issue measured), ``z_rerun`` from the passes and
    ``between_run`` (the variance of the difference under the model), and ``z_held_out``
    the same with tau^2 from the other folds' cells of ``within`` (``held_out_rows``) --
    and the speedups' difference in percent. A z that cannot be computed is None."""
    def by_pair(rows):
        return {(r.key, r.run_a, r.run_b): r for r in rows}

    columns = {"z_within": by_pair(z_rows(within)),
               "z_rerun": by_pair(z_rows(within, between_run=between_run)),
               "z_held_out": by_pair(held_out_rows(within, fold))}
    out = []
    for row in z_rows(stored):
        pair = (row.key, row.run_a, row.run_b)
        found = {name: rows.get(pair) for name, rows in columns.items()}
        out.append({
            "key": row.key, "run_a": row.run_a, "run_b": row.run_b,
            "speedup_a": row.speedup_a, "speedup_b": row.speedup_b,
            "difference_pct": ((row.speedup_a / row.speedup_b - 1) * 100
                               if _positive(row.speedup_a, row.speedup_b) else None),
            "z_stored": row.z,
            **{name: r.z if r else None for name, r in found.items()},
        })
    return out


def table_shares(rows, bound: float = 1.96) -> dict:
    """{column: share of its rows with |z| <= bound} for each z column of ``rerun_table``
    (None where no row has that z), and "cells": the rows."""
    out = {"cells": len(rows)}
    for column in Z_COLUMNS:
        out[column] = _share((r[column] for r in rows), bound)
    return out


@dataclass(frozen=True)
class StartComponents:
    """How far one run's pass speedups move within an engine start and between starts
    (ProtocolSpec.engine_starts), in log space. ``within``: the variance of one pass's
    log-speedup about its start's, from cells with two or more passes in a start;
    ``between``: half the mean squared difference of two passes in different starts, which
    is ``within`` plus the engine start's own variance; ``start`` = between - within (the
    part an engine start fixes, floored at 0). None where no pair of that kind exists."""
    within: float | None
    between: float | None
    start: float | None
    within_pairs: int
    between_pairs: int


def pass_log_speedup(drafter_records, baseline_records) -> dict:
    """{(engine start, repetition): log speedup of that pass} of a paired cell: each
    repetition's drafter requests over the baseline's of the same repetition (tokens /
    time shares, as the cell's figure). Passes without both sides are left out."""
    def sums(records):
        out: dict = {}
        for r in records:
            key = (r.get("engine_start", 0), r.get("repetition", 0))
            tokens, seconds = out.get(key, (0, 0.0))
            out[key] = (tokens + len(r["output_token_ids"]), seconds + r["time_share"])
        return out

    d, b = sums(drafter_records), sums(baseline_records)
    found = {}
    for key in d.keys() & b.keys():
        (dt, ds), (bt, bs) = d[key], b[key]
        if dt > 0 and ds > 0 and bt > 0 and bs > 0:
            found[key] = math.log((dt / ds) / (bt / bs))
    return found


def start_components(cells) -> StartComponents:
    """StartComponents from ``cells``: one ``pass_log_speedup`` dict per cell. Every pair of
    passes of a cell counts once: half its squared difference estimates the variance of
    one pass when both are in one start (within), and that plus the start's variance when
    they are in different starts (between)."""
    within, between = [], []
    for passes in cells:
        for (ka, ya), (kb, yb) in itertools.combinations(sorted(passes.items()), 2):
            (within if ka[0] == kb[0] else between).append((ya - yb) ** 2 / 2)
    w = sum(within) / len(within) if within else None
    b = sum(between) / len(between) if between else None
    start = max(b - w, 0.0) if w is not None and b is not None else None
    return StartComponents(w, b, start, len(within), len(between))
