"""Bootstrap intervals (worker.intervals) on synthetic per-request records."""
import random
import time

import pytest

from worker.intervals import (acceptance_length_interval, drift, speedup_interval,
                              throughput_interval)


def cell(n_prompts=20, reps=3, seed=0, speed=25.0, noise=0.15, prompt_effect=None,
         drafts=True):
    """Records of one cell: prompt p has a length and (optionally) a shared slowness."""
    rng = random.Random(seed)
    out = []
    for p in range(n_prompts):
        length = 20 + (p * 37) % 200
        for r in range(reps):
            slow = prompt_effect[p] if prompt_effect else 1.0
            t = length / speed * slow * (1 + rng.uniform(-noise, noise))
            rec = {"prompt_id": f"p{p}", "repetition": r, "output_token_ids": [1] * length,
                   "time_share": t}
            if drafts:
                rec["drafts"] = length // 3
                rec["accepted_tokens"] = rng.randint(0, 2 * (length // 3))
            out.append(rec)
    return out


def test_intervals_contain_the_point():
    records = cell()
    point = sum(len(r["output_token_ids"]) for r in records) / sum(r["time_share"]
                                                                   for r in records)
    lo, hi = throughput_interval(records)
    assert lo < point < hi
    assert hi - lo < 0.2 * point
    al = 1 + sum(r["accepted_tokens"] for r in records) / sum(r["drafts"] for r in records)
    lo, hi = acceptance_length_interval(records)
    assert lo < al < hi
    s, lo, hi = speedup_interval(cell(seed=1, speed=40.0), cell(seed=2))
    assert lo < s < hi
    assert s == pytest.approx(40 / 25, rel=0.05)


def test_the_same_records_give_the_same_interval():
    records = cell(seed=3)
    assert throughput_interval(records) == throughput_interval(list(records))


def test_pairing_by_prompt_narrows_the_interval_on_correlated_data():
    # Prompts differ in how slow they run (shared by both cells): pairing cancels it.
    rng = random.Random(7)
    effect = [rng.uniform(0.5, 2.0) for _ in range(20)]
    drafter = cell(seed=4, speed=40.0, noise=0.05, prompt_effect=effect)
    baseline = cell(seed=5, speed=25.0, noise=0.05, prompt_effect=effect)
    point, lo, hi = speedup_interval(drafter, baseline)
    # The same data with prompt ids that do not match: resampled independently.
    renamed = [dict(r, prompt_id="x" + r["prompt_id"]) for r in baseline]
    point2, lo2, hi2 = speedup_interval(drafter, renamed)
    assert point == pytest.approx(point2)
    assert lo <= point <= hi and lo2 <= point2 <= hi2
    assert (hi - lo) < 0.5 * (hi2 - lo2)


def test_pairing_follows_prompt_and_repetition_not_record_order():
    rng = random.Random(8)
    effect = [rng.uniform(0.5, 2.0) for _ in range(20)]
    drafter = cell(seed=4, speed=40.0, noise=0.05, prompt_effect=effect)
    baseline = cell(seed=5, speed=25.0, noise=0.05, prompt_effect=effect)
    shuffled = list(baseline)
    random.Random(1).shuffle(shuffled)
    assert speedup_interval(drafter, shuffled) == speedup_interval(drafter, baseline)


def test_a_constant_ratio_gives_a_tight_interval():
    # Every request of the drafter runs exactly 1.5x as fast as its baseline request.
    baseline = cell(seed=6, noise=0.3)
    drafter = [dict(r, time_share=r["time_share"] / 1.5) for r in baseline]
    point, lo, hi = speedup_interval(drafter, baseline)
    assert point == pytest.approx(1.5)
    assert lo == pytest.approx(1.5) and hi == pytest.approx(1.5)
    # Every request at the same throughput: a point, not an error.
    same = [dict(r, time_share=len(r["output_token_ids"]) / 30.0) for r in baseline]
    lo, hi = throughput_interval(same)
    assert lo == pytest.approx(30.0) and hi == pytest.approx(30.0)


def test_degenerate_cells_return_the_point():
    one = cell(n_prompts=1, reps=1)
    thr = len(one[0]["output_token_ids"]) / one[0]["time_share"]
    assert throughput_interval(one) == (thr, thr)
    lo, hi = acceptance_length_interval(one)
    assert lo == hi == 1 + one[0]["accepted_tokens"] / one[0]["drafts"]
    point, lo, hi = speedup_interval(one, cell(n_prompts=1, reps=1, seed=9))
    assert lo == hi == point
    two = cell(n_prompts=2, reps=1)
    lo, hi = throughput_interval(two)
    assert lo <= hi
    assert throughput_interval([]) == (None, None)
    assert acceptance_length_interval(cell(drafts=False)) == (None, None)
    assert acceptance_length_interval([dict(r, drafts=0) for r in cell()]) == (None, None)
    assert speedup_interval([], cell()) == (None, None, None)


def test_decode_tokens_stand_in_for_output_token_ids():
    records = [{"prompt_id": r["prompt_id"], "repetition": r["repetition"],
                "decode_tokens": len(r["output_token_ids"]), "time_share": r["time_share"]}
               for r in cell(seed=10)]
    assert throughput_interval(records) == throughput_interval(cell(seed=10))


def test_bootstrap_is_fast_enough_for_a_cell():
    records = cell(n_prompts=60, reps=3)
    t0 = time.perf_counter()
    throughput_interval(records)
    speedup_interval(records, cell(n_prompts=60, reps=3, seed=11))
    assert time.perf_counter() - t0 < 5.0


def test_drift_between_passes():
    assert drift([100, 110]) == pytest.approx(10 / 105)
    assert drift([100, 110]) == pytest.approx(0.0952, abs=1e-4)
    assert drift([100]) == 0.0 and drift([]) == 0.0
    assert drift([50, 50, 50]) == 0.0
    assert drift([90, 100, 110]) == pytest.approx(0.2)
