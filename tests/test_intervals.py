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


# ---- prompts as clusters (issue #33) --------------------------------------------------------

def half_width(lo, hi, point):
    return (hi - lo) / 2 / point


def thr(records):
    return (sum(len(r["output_token_ids"]) for r in records)
            / sum(r["time_share"] for r in records))


def test_identical_passes_do_not_narrow_the_interval_like_independent_prompts():
    # At temperature 0 the passes of a prompt repeat its tokens: 3 identical passes of 20
    # prompts are 20 draws of the prompt set, not 60.
    one_pass = cell(n_prompts=20, reps=1, seed=12, noise=0.4)
    three_identical = [dict(r, repetition=rep) for rep in range(3) for r in one_pass]
    sixty_prompts = cell(n_prompts=60, reps=1, seed=12, noise=0.4)
    w1 = half_width(*throughput_interval(one_pass), thr(one_pass))
    w3 = half_width(*throughput_interval(three_identical), thr(three_identical))
    w60 = half_width(*throughput_interval(sixty_prompts), thr(sixty_prompts))
    assert thr(three_identical) == pytest.approx(thr(one_pass))
    # Resampling requests as if independent would narrow by about sqrt(3) (0.58x).
    assert w3 == pytest.approx(w1, rel=0.1)
    assert w60 < 0.75 * w3


def test_timing_noise_between_passes_widens_the_interval():
    # The same prompts and tokens; passes that differ in time add the passes' noise.
    quiet = cell(n_prompts=12, reps=3, seed=13, noise=0.0)
    noisy = cell(n_prompts=12, reps=3, seed=13, noise=0.5)
    wq = half_width(*throughput_interval(quiet), thr(quiet))
    wn = half_width(*throughput_interval(noisy), thr(noisy))
    assert wn > wq
    # One prompt measured in several passes: an interval from its passes alone.
    single = cell(n_prompts=1, reps=5, seed=14, noise=0.3)
    lo, hi = throughput_interval(single)
    assert lo < thr(single) < hi


def test_prompts_with_different_numbers_of_passes():
    records = [r for r in cell(n_prompts=10, reps=4, seed=15)
               if not (r["prompt_id"] in ("p1", "p2") and r["repetition"] >= 2)]
    lo, hi = throughput_interval(records)
    assert lo < thr(records) < hi
    point, lo, hi = speedup_interval(records, cell(n_prompts=10, reps=4, seed=16)[:len(records)])
    assert lo <= point <= hi


def test_two_stage_intervals_are_deterministic():
    d, b = cell(n_prompts=24, reps=3, seed=17, speed=40.0), cell(n_prompts=24, reps=3, seed=18)
    assert speedup_interval(d, b) == speedup_interval([dict(r) for r in d], list(b))
    assert throughput_interval(d) == throughput_interval(list(d))
    assert acceptance_length_interval(d) == acceptance_length_interval(list(d))


def test_expansion_for_few_prompts():
    from worker.intervals import expansion

    assert expansion(1) == 1.0
    assert expansion(8) == pytest.approx(1.29, abs=0.01)   # sqrt(8/7) x t7 / z
    assert expansion(24) == pytest.approx(1.078, abs=0.005)
    assert expansion(8) > expansion(24) > expansion(200) > 1.0


def test_paired_speedup_intervals_cover_the_true_speedup():
    # Cells of 8 prompts (3 passes, temperature 0: identical tokens) drawn from a known
    # population whose prompts differ in length, in slowness shared by both sides and in
    # how much the drafter speeds them up. 95% intervals should cover the population's
    # speedup in about 95% of cells; resampling requests as independent covered ~70%.
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(33)
    population = 20000
    length = rng.integers(20, 300, population).astype(float)
    gain = rng.lognormal(0.0, 0.15, population)
    slow = rng.lognormal(0.0, 0.3, population)
    true = ((length.sum() / (length / (37.5 * gain) * slow).sum())
            / (length.sum() / (length / 25 * slow).sum()))
    covered, n_cells = 0, 150
    for _ in range(n_cells):
        prompts = rng.choice(population, 8, replace=False)
        drafter, baseline = [], []
        for p in prompts:
            for rep in range(3):
                nb, nd = rng.normal(0, 0.03, 2)
                common = {"prompt_id": int(p), "repetition": rep,
                          "output_tokens": int(length[p])}
                baseline.append(dict(common, time_share=length[p] / 25 * slow[p] * (1 + nb)))
                drafter.append(dict(common, time_share=length[p] / (37.5 * gain[p]) * slow[p]
                                    * (1 + nd)))
        _, lo, hi = speedup_interval(drafter, baseline)
        covered += lo <= true <= hi
    assert covered / n_cells >= 0.88
