"""The speedup's two intervals (issue #33): the one the leaderboard ranks by (a rerun on the
protocol's prompts: the passes with the prompts fixed, plus the protocol's between-run
variance) and the one across prompts; how both pool over cells with the between-run
variance counted once; adaptive passes stopping on the ranking one; ranks taken from the
rank ranges. Seeded records and rows, no engine (the stored figures through the run
service are tests/test_calibration.py::TestCalibrateProtocol)."""
import math

import numpy as np
import pytest

from worker import calibration as cal
from worker.analysis.speedups import combined_interval, mark_ties, pooled
from worker.calibration import Z
from worker.measure import group_half_widths, relative_half_width

from .test_adaptive_passes import GROUP, SeededPasses


def test_the_rerun_interval_is_passes_and_between_run_variance_in_log_space():
    lo, hi = cal.rerun_interval(1.5, 0.01, 0.02 ** 2)
    half = Z * math.hypot(0.01, 0.02)
    assert (lo, hi) == (pytest.approx(1.5 * math.exp(-half)), pytest.approx(1.5 * math.exp(half)))
    # a calibration of 0 leaves the passes alone; no calibration or no passes: none
    assert cal.rerun_interval(1.5, 0.01, 0.0)[1] == pytest.approx(1.5 * math.exp(Z * 0.01))
    assert cal.rerun_interval(1.5, 0.01, None) == (None, None)
    assert cal.rerun_interval(1.5, None, 0.01) == (None, None)


def cell(speedup, log_half, variance=None, wall=10.0, prompts_half=None, **extra):
    c = {"speedup": speedup, "speedup_low": speedup * math.exp(-log_half),
         "speedup_high": speedup * math.exp(log_half), "wall_seconds": wall,
         "speedup_between_run_variance": variance}
    if prompts_half is not None:
        c["speedup_prompts_low"] = speedup * math.exp(-prompts_half)
        c["speedup_prompts_high"] = speedup * math.exp(prompts_half)
    return {**c, **extra}


def log_half(point, lo, hi):
    return max(math.log(point / lo), math.log(hi / point))


def test_pooling_counts_the_between_run_variance_once():
    tau2, p = 0.015 ** 2, 0.004
    half = Z * math.sqrt(p * p + tau2)
    parts = [(10.0, 1.2, 1.2 * math.exp(-half), 1.2 * math.exp(half))] * 4
    lo, hi = combined_interval(1.2, parts, tau2)
    # four equal cells: the passes' part shrinks by 2, tau^2 stays whole
    assert log_half(1.2, lo, hi) == pytest.approx(Z * math.sqrt(p * p / 4 + tau2))
    # without saying which part is shared, it would have averaged tau^2 down by 2 as well
    lo0, hi0 = combined_interval(1.2, parts)
    assert log_half(1.2, lo0, hi0) == pytest.approx(half / 2)
    assert log_half(1.2, lo, hi) > 1.9 * log_half(1.2, lo0, hi0)
    # never narrower than tau^2 alone, whatever the cells
    assert log_half(1.2, lo, hi) >= Z * math.sqrt(tau2)


def test_one_cell_pools_to_its_own_stored_intervals():
    c = cell(1.3, 0.03, 0.01 ** 2, prompts_half=0.1, task="chat", batch_size=4,
             temperature=0.0, k=2)
    lo, hi = combined_interval(1.3, [(1.0, 1.3, c["speedup_low"], c["speedup_high"])], 0.01)
    assert (lo, hi) == (c["speedup_low"], c["speedup_high"])


def figures_cell(task, speedup, tau2, p, prompts_half):
    half = Z * math.sqrt(p * p + tau2)
    c = cell(speedup, half, tau2, prompts_half=math.sqrt(prompts_half ** 2 + Z * Z * tau2),
             task=task, batch_size=4, temperature=0.0, k=2, generated_tokens=1000,
             output_throughput=100.0 * speedup, drafts=0, accepted_tokens=0,
             acceptance_length=None)
    c["wall_seconds"] = 1000 / c["output_throughput"]
    return c


def test_pooled_rows_carry_both_intervals_with_the_shift_once():
    tau2 = 0.02 ** 2
    cells = [figures_cell(t, 1.25, tau2, 0.005, 0.08) for t in ("chat", "code", "math")]
    pinned = {(t, 4, 0.0): {"generated_tokens": 1000, "wall_seconds": 10.0}
              for t in ("chat", "code", "math")}
    out = pooled(cells, pinned)
    assert out["speedup"] == pytest.approx(1.25)
    rank = log_half(out["speedup"], out["speedup_low"], out["speedup_high"])
    prompts = log_half(out["speedup"], out["speedup_prompts_low"], out["speedup_prompts_high"])
    assert rank == pytest.approx(Z * math.sqrt(0.005 ** 2 / 3 + tau2))
    assert prompts == pytest.approx(math.sqrt((0.08 ** 2) / 3 + Z * Z * tau2))
    assert rank < prompts


def test_adaptive_passes_stop_on_the_ranking_interval_once_calibrated():
    """The same seeded passes: with prompt-to-prompt spread that passes cannot remove, the
    interval across prompts stays wide; the rerun interval (prompts fixed) is narrow."""
    model = SeededPasses(noise=0.05, prompt_effect=0.3)
    recs = {c: [r for rep in range(3) for r in model.records_of(c, model.measure(c, rep))]
            for c in GROUP}
    across = group_half_widths(recs)
    tau2 = 0.01 ** 2
    ranking = group_half_widths(recs, between_run_variance=tau2)
    assert len(ranking) == 2 and all(w is not None for w in ranking)
    assert all(r < a for r, a in zip(ranking, across))
    assert all(a > 0.1 for a in across)
    # each is the rerun interval of the pooled records, relative to the speedup
    from worker import intervals

    for c, w in zip(GROUP[1:], ranking):
        point = intervals.throughput(recs[c]) / intervals.throughput(recs[GROUP[0]])
        se = intervals.speedup_passes_standard_error(recs[c], recs[GROUP[0]])
        assert w == pytest.approx(relative_half_width(point, *cal.rerun_interval(point, se,
                                                                                 tau2)))
        assert w >= math.expm1(Z * 0.01) * 0.999


def test_one_pass_has_no_ranking_interval_to_stop_on():
    model = SeededPasses()
    recs = {c: model.records_of(c, model.measure(c, 0)) for c in GROUP}
    assert group_half_widths(recs, between_run_variance=0.0001) == [None, None]


def test_a_rank_is_the_best_of_its_range_and_ties_follow_overlaps():
    rng = np.random.default_rng(5)
    for _ in range(100):
        rows = []
        for i in range(rng.integers(1, 10)):
            s = float(rng.uniform(0.9, 1.6))
            h = float(rng.uniform(0.0, 0.1))
            rows.append({"speedup": s, "speedup_low": s - h, "speedup_high": s + h,
                         "run": {"measuring": False}, "name": str(i)})
        rows.sort(key=lambda r: -r["speedup"])
        mark_ties(rows)
        for r in rows:
            assert r["rank"] == r["rank_low"]
            overlaps = [o for o in rows if o is not r and o["speedup_low"] <= r["speedup_high"]
                        and o["speedup_high"] >= r["speedup_low"]]
            assert r["tied"] == bool(overlaps)
            above = [o for o in rows if o["speedup_low"] > r["speedup_high"]]
            assert r["rank"] == 1 + len(above)

