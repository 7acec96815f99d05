"""The between-run component of speedup intervals and the rerun z-table (issue #33):
worker.calibration on data drawn from a known model, the same on seeded per-request records
through worker.intervals, and `manage.py calibrate_protocol` on a seeded database through the
run service's own record path."""
import io
import math

import numpy as np
import pytest
from django.core.management import CommandError, call_command

from worker import calibration as cal
from worker.calibration import Measured, Z
from worker.intervals import speedup_interval, speedup_passes_standard_error

# ---- data from the model ---------------------------------------------------------------------


def model_cells(seed, n_keys, tau, runs=2, prompt_sd=0.05, pass_sd=(0.005, 0.02)):
    """Cells of `runs` runs drawn from log s = mu + P + delta + e (worker.calibration's
    model): P the prompts' effect, the same in every run of a key; delta ~ N(0, tau^2) per
    run and cell; e ~ N(0, p^2) with p drawn per cell. The stored-like interval is the
    within-run one: log half-width z x sqrt(prompt_sd^2 + p^2)."""
    rng = np.random.default_rng(seed)
    out = []
    for key in range(n_keys):
        mu = rng.uniform(0.0, 0.5) + rng.normal(0.0, prompt_sd)
        for run in range(runs):
            p = rng.uniform(*pass_sd)
            y = mu + rng.normal(0.0, tau) + rng.normal(0.0, p)
            w = math.hypot(prompt_sd, p)
            out.append(Measured(("d", key), 1000 * seed + run, math.exp(y),
                                math.exp(y - Z * w), math.exp(y + Z * w), passes_se=p))
    return out


def test_the_estimate_recovers_the_between_run_variance():
    tau = 0.04
    est = cal.between_run_variance(model_cells(1, 400, tau))
    assert est.cells == 400 and est.degrees_of_freedom == 400
    assert est.variance == pytest.approx(tau ** 2, rel=0.2)
    three = cal.between_run_variance(model_cells(2, 200, tau, runs=3))
    assert three.degrees_of_freedom == 400
    assert three.variance == pytest.approx(tau ** 2, rel=0.2)


def test_without_a_between_run_shift_the_estimate_is_about_zero():
    est = cal.between_run_variance(model_cells(3, 400, 0.0))
    assert est.variance >= 0.0
    assert est.variance < 0.1 * 0.01 ** 2 * 10  # well under the passes' own variance
    assert est.raw_variance is not None


def test_the_prompts_variance_is_not_subtracted():
    # Two runs on the same prompts do not differ by the prompts: subtracting the whole
    # interval (prompts and passes) would take tau^2 to the floor where prompts dominate.
    tau = 0.03
    cells = model_cells(4, 400, tau, prompt_sd=0.06)
    assert cal.between_run_variance(cells).variance == pytest.approx(tau ** 2, rel=0.25)
    no_passes = [Measured(m.key, m.run_id, m.speedup, m.low, m.high) for m in cells]
    assert cal.between_run_variance(no_passes).variance < 0.2 * tau ** 2


def test_nothing_to_estimate_from_single_runs():
    cells = [m for m in model_cells(5, 20, 0.05) if m.run_id % 1000 == 0]
    est = cal.between_run_variance(cells)
    assert (est.variance, est.raw_variance, est.cells, est.degrees_of_freedom) == (0.0, None, 0, 0)


def test_widen_adds_in_quadrature_in_log_space():
    lo, hi = cal.widen(2.0, 1.8, 2.3, 0.05 ** 2)
    below, above = math.log(2.0 / 1.8), math.log(2.3 / 2.0)
    assert math.log(2.0 / lo) == pytest.approx(math.hypot(below, Z * 0.05))
    assert math.log(hi / 2.0) == pytest.approx(math.hypot(above, Z * 0.05))
    assert cal.widen(2.0, 1.8, 2.3, 0.0) == (1.8, 2.3)
    assert cal.widen(2.0, None, None, 0.01) == (None, None)
    # A point interval gets the between-run component alone.
    lo, hi = cal.widen(1.5, 1.5, 1.5, 0.02 ** 2)
    assert hi / 1.5 == pytest.approx(math.exp(Z * 0.02))


def test_z_from_stored_intervals_uses_the_facing_sides():
    a = Measured("c", 1, 1.2, 1.1, 1.4)
    b = Measured("c", 2, 1.0, 0.9, 1.05)
    row = cal.z_row(a, b)
    se = math.hypot(math.log(1.2 / 1.1) / Z, math.log(1.05 / 1.0) / Z)
    assert row.standard_error == pytest.approx(se)
    assert row.z == pytest.approx(math.log(1.2) / se)
    assert cal.z_row(b, a).z == pytest.approx(-row.z)
    assert cal.z_row(a, Measured("c", 3, 1.0, None, None)).z is None
    assert cal.share_within([row, cal.z_row(a, a)]) == 0.5   # |z| = 1.96 ... and 0
    assert cal.share_within([]) is None


def test_z_table_is_calibrated_with_the_estimated_component_only():
    tau = 0.05
    cells = model_cells(6, 400, tau, prompt_sd=0.02)
    rows = cal.z_rows(cells, between_run=0.0)
    assert len(rows) == 400
    # Without the between-run component |z| exceeds 1.96 far more than 5% of cells.
    assert cal.share_within(rows) < 0.6
    est = cal.between_run_variance(model_cells(7, 400, tau, prompt_sd=0.02))  # other runs
    share = cal.share_within(cal.z_rows(cells, between_run=est.variance))
    assert 0.92 <= share <= 0.98
    # Stored intervals: within-run only they miss too often; widened, they are conservative
    # (the prompts' variance is in them, and cancels between runs on the same prompts).
    assert cal.share_within(cal.z_rows(cells)) < 0.8
    assert cal.share_within(cal.z_rows(cal.widened(cells, est.variance))) >= 0.95


def task_cells(seed, task, tau, n_keys=300):
    """model_cells of one task: keys (drafter, task, key), run ids 0 and 1."""
    return [Measured(("d", task, m.key[1]), m.run_id % 1000, m.speedup, m.low, m.high,
                     m.passes_se) for m in model_cells(seed, n_keys, tau)]


def test_held_out_z_takes_a_tasks_between_run_variance_from_the_other_tasks():
    a, b = task_cells(20, "a", 0.04), task_cells(21, "b", 0.04)
    rows = cal.held_out_rows(a + b, fold=lambda key: key[1])
    assert len(rows) == 600
    # Each task judged by the estimate the other made: exactly the rerun z with it.
    tau2_b = cal.between_run_variance(b).variance
    expected = {(r.key, r.run_a): r.z for r in cal.z_rows(a, between_run=tau2_b)}
    assert all(r.z == pytest.approx(expected[(r.key, r.run_a)])
               for r in rows if r.key[1] == "a")
    # One shift in both tasks: held out, as calibrated as in-sample.
    assert 0.92 <= cal.share_within(rows) <= 0.98
    # A task whose runs move more than the other's: in-sample the pooled estimate hides it
    # (calibrated on average), held out its cells miss far more often.
    quiet, loud = task_cells(22, "quiet", 0.01), task_cells(23, "loud", 0.06)
    pooled = cal.between_run_variance(quiet + loud).variance
    in_sample = cal.share_within(cal.z_rows(loud, between_run=pooled))
    held_out = cal.share_within(
        [r for r in cal.held_out_rows(quiet + loud) if r.key[1] == "loud"])
    assert held_out < 0.6 < in_sample
    # A single task has no other to estimate from: no held-out z.
    assert all(r.z is None for r in cal.held_out_rows(a))


def test_z_rows_pair_every_two_runs_of_a_key():
    cells = model_cells(8, 5, 0.02, runs=3)
    rows = cal.z_rows(cells)
    assert len(rows) == 5 * 3
    assert all(r.run_a < r.run_b for r in rows)


# ---- the same, on per-request records through worker.intervals -----------------------------

def prompt_set(rng, n_prompts, gain_sd=0.05):
    """Prompts of a cell: output length, slowness shared by both sides, the drafter's gain
    (log sd `gain_sd` between prompts: what the prompts add to the speedup's interval)."""
    return [(int(rng.integers(20, 200)), float(rng.lognormal(0, 0.3)),
             float(rng.lognormal(0.4, gain_sd))) for _ in range(n_prompts)]


def cell_records(prompts, rng, shift=1.0, passes=3, noise=0.04):
    """(drafter, baseline) records of one paired cell: every pass of every prompt, the
    drafter's times multiplied by the run's `shift`."""
    drafter, baseline = [], []
    for p, (length, slow, gain) in enumerate(prompts):
        for rep in range(passes):
            common = {"prompt_id": f"p{p}", "repetition": rep, "output_token_ids": [7] * length}
            baseline.append(dict(common, time_share=length / 25 * slow
                                 * (1 + rng.normal(0, noise))))
            drafter.append(dict(common, drafts=length // 2, accepted_tokens=length // 3,
                                time_share=length / (25 * gain) * slow * shift
                                * (1 + rng.normal(0, noise))))
    return drafter, baseline


def measured_runs(seed, n_keys, tau, runs=2):
    rng = np.random.default_rng(seed)
    out = []
    for key in range(n_keys):
        prompts = prompt_set(rng, 8)
        for run in range(runs):
            d, b = cell_records(prompts, rng, shift=math.exp(rng.normal(0, tau)))
            point, lo, hi = speedup_interval(d, b)
            out.append(Measured(("ngram", key), run, point, lo, hi,
                                speedup_passes_standard_error(d, b)))
    return out


def test_passes_standard_error_holds_the_prompts_fixed():
    rng = np.random.default_rng(9)
    prompts = prompt_set(rng, 8)
    quiet = cell_records(prompts, rng, noise=0.0)
    noisy = cell_records(prompts, rng, noise=0.1)
    assert speedup_passes_standard_error(*quiet) == pytest.approx(0.0, abs=1e-12)
    se = speedup_passes_standard_error(*noisy)
    # 24 requests a side, each +-10% (sd) in time: about 0.1 x sqrt(2 / 24) in log speedup.
    assert 0.5 * 0.1 * math.sqrt(2 / 24) < se < 2 * 0.1 * math.sqrt(2 / 24)
    one_pass = [r for r in noisy[0] if r["repetition"] == 0], \
        [r for r in noisy[1] if r["repetition"] == 0]
    assert speedup_passes_standard_error(*one_pass) is None


def test_rerun_z_table_on_seeded_records():
    tau = 0.06
    cells = measured_runs(10, 40, tau)
    est = cal.between_run_variance(cells)
    assert tau ** 2 / 3 < est.variance < 3 * tau ** 2
    without = cal.share_within(cal.z_rows(cells, between_run=0.0))
    with_component = cal.share_within(cal.z_rows(cells, between_run=est.variance))
    assert without < 0.6
    assert with_component >= 0.85
    # Within-run stored intervals alone miss more often than 5%; widened they hold.
    assert cal.share_within(cal.z_rows(cells)) < 0.9
    assert cal.share_within(cal.z_rows(cal.widened(cells, est.variance))) >= 0.95


# ---- manage.py calibrate_protocol on a seeded database ---------------------------------------

@pytest.mark.django_db
class TestCalibrateProtocol:

    def seed(self, shifts=(1.0, 1.15), seed=11):
        """A paired protocol (2 tasks x b 1, 4 x k 2, 4), an n-gram drafter measured in one
        run per shift, each cell landing through services.runs.record_cell with records
        drawn here (the same prompts in every run, the drafter's times x the run's shift);
        one cell of each run is slower by a further per-cell factor."""
        from leaderboard.services import runs

        from . import factories as f
        from worker.protocol import Cell

        protocol = f.make_protocol(f.make_target(), slug="calib", baseline="paired",
                                   repetitions=3)
        drafter = f.make_drafter(protocol.target, "ngram ref")
        rng = np.random.default_rng(seed)
        prompts = {c.key[:3]: prompt_set(rng, 8) for c in protocol.spec.cells(with_drafter=False)}
        made = []
        for shift in shifts:
            run = f.make_run(protocol, drafter)
            for c in protocol.spec.cells(with_drafter=False):
                per_cell = {k: shift * math.exp(rng.normal(0, 0.05)) for k in protocol.spec.ks}
                recs = {k: cell_records(prompts[c.key[:3]], rng, shift=per_cell[k])
                        for k in protocol.spec.ks}
                baseline_recs = recs[protocol.spec.ks[0]][1]
                for k in (0, *protocol.spec.ks):
                    cell = Cell(c.task, c.batch_size, c.temperature, k)
                    landing = f.landing_cell(run, cell)
                    landing.records = baseline_recs if k == 0 else [
                        {**d, "time_share": d["time_share"]} for d in recs[k][0]]
                    landing.outputs = {r["prompt_id"]: r["output_token_ids"]
                                       for r in landing.records if r["repetition"] == 0}
                    runs.record_cell(run, landing)
            made.append(run)
        return protocol, drafter, made

    def test_estimates_stores_and_applies(self):
        from leaderboard.models import ProtocolCalibration, Result
        from leaderboard.services import calibration as service
        from leaderboard.services import runs

        protocol, drafter, made = self.seed()
        # Before: stored intervals are the within-run ones.
        before = {r.pk: (r.speedup, r.speedup_low, r.speedup_high)
                  for r in Result.objects.filter(run__in=made, k__gt=0)}
        assert len(before) == 16 and all(lo < s < hi for s, lo, hi in before.values())
        # ... and, uncalibrated, the ranking interval is the one across prompts
        for r in Result.objects.filter(run__in=made, k__gt=0):
            assert (r.speedup_prompts_low, r.speedup_prompts_high) == before[r.pk][1:]
            assert r.speedup_between_run_variance is None and r.speedup_passes_se > 0
        # The expected estimate, from the records the service reads, by the pure function.
        measured = service.measured_within_run(made)
        assert len(measured) == 16 and all(m.passes_se for m in measured)
        expected = cal.between_run_variance(measured)
        assert expected.variance > 0.0

        out = io.StringIO()
        call_command("calibrate_protocol", protocol.slug, stdout=out)
        row = ProtocolCalibration.objects.get(protocol=protocol)
        assert row.between_run_variance == pytest.approx(expected.variance)
        assert (row.cells, row.degrees_of_freedom) == (8, 8)
        assert sorted(row.runs.values_list("pk", flat=True)) == [r.pk for r in made]
        assert row.drafters == [drafter.slug]
        assert ProtocolCalibration.variance_for(protocol.pk) == row.between_run_variance
        text = out.getvalue()
        assert "16 cell intervals changed" in text and f"runs {made[0].pk}, {made[1].pk}" in text
        held_out = [r.z for r in cal.held_out_rows(measured)]
        assert len(held_out) == 8 and all(z is not None for z in held_out)
        within = sum(abs(z) <= 1.96 for z in held_out)
        assert f"|z| <= 1.96 in {within} of 8 cell pairs" in text
        assert (row.held_out_within, row.held_out_pairs) == (within, 8)
        from django.test import Client
        html = Client().get(f"/protocols/{protocol.slug}/v{protocol.version}/").content.decode()
        assert f"Held out by task: <b>{within} of 8</b>" in html

        passes_se = {(m.run_id, *m.key[1:]): m.passes_se for m in measured}
        for r in Result.objects.filter(run__in=made, k__gt=0):
            s, lo, hi = before[r.pk]
            assert r.speedup == pytest.approx(s)
            # across prompts: the within-run interval widened by tau^2
            wlo, whi = cal.widen(s, lo, hi, row.between_run_variance)
            assert (r.speedup_prompts_low, r.speedup_prompts_high) == (pytest.approx(wlo),
                                                                       pytest.approx(whi))
            assert r.speedup_prompts_low < lo and r.speedup_prompts_high > hi
            # ranked by: the passes (prompts fixed) and tau^2, narrower than across prompts
            p = passes_se[(r.run_id, r.task, r.batch_size, float(r.temperature), r.k)]
            assert r.speedup_passes_se == pytest.approx(p)
            assert r.speedup_between_run_variance == pytest.approx(row.between_run_variance)
            half = cal.Z * math.sqrt(p ** 2 + row.between_run_variance)
            assert (r.speedup_low, r.speedup_high) == (pytest.approx(s * math.exp(-half)),
                                                       pytest.approx(s * math.exp(half)))
            assert r.speedup_prompts_low < r.speedup_low < s < r.speedup_high \
                < r.speedup_prompts_high

        # Again: the estimate comes from the records (within-run), not from the widened
        # stored bounds, so it is the same and nothing changes.
        out = io.StringIO()
        call_command("calibrate_protocol", protocol.slug, stdout=out)
        assert ProtocolCalibration.objects.filter(protocol=protocol).count() == 2
        assert ProtocolCalibration.variance_for(protocol.pk) == pytest.approx(
            row.between_run_variance)
        assert "0 cell intervals changed" in out.getvalue()

        # A cell recorded later (a new run's) lands with the calibration in it.
        from worker.protocol import Cell

        from . import factories as f
        new_run = f.make_run(protocol, drafter, state="running")
        rng = np.random.default_rng(99)
        d, b = cell_records(prompt_set(rng, 8), rng)
        base_cell, cell = Cell("chat", 4, 0.0, 0), Cell("chat", 4, 0.0, 2)
        for c, recs in ((base_cell, b), (cell, d)):
            landing = f.landing_cell(new_run, c)
            landing.records = recs
            landing.outputs = {r["prompt_id"]: r["output_token_ids"] for r in recs}
            runs.record_cell(new_run, landing)
        stored = Result.objects.get(run=new_run, k=2)
        point, lo, hi = speedup_interval(d, b)
        wlo, whi = cal.widen(point, lo, hi, row.between_run_variance)
        assert (stored.speedup_prompts_low, stored.speedup_prompts_high) == (
            pytest.approx(wlo), pytest.approx(whi))
        rlo, rhi = cal.rerun_interval(point, speedup_passes_standard_error(d, b),
                                      row.between_run_variance)
        assert (stored.speedup_low, stored.speedup_high) == (pytest.approx(rlo),
                                                             pytest.approx(rhi))

    def test_dry_run_stores_nothing(self):
        from leaderboard.models import ProtocolCalibration, Result

        protocol, _, made = self.seed()
        before = list(Result.objects.filter(run__in=made).values_list("speedup_low", flat=True))
        out = io.StringIO()
        call_command("calibrate_protocol", protocol.slug, "--dry-run", stdout=out)
        assert "dry run" in out.getvalue() and "between-run variance" in out.getvalue()
        assert not ProtocolCalibration.objects.exists()
        assert list(Result.objects.filter(run__in=made).values_list(
            "speedup_low", flat=True)) == before

    def test_refuses_without_repeated_runs(self):
        from leaderboard.models import ProtocolCalibration

        protocol, _, _ = self.seed(shifts=(1.0,))
        with pytest.raises(CommandError, match="two succeeded runs"):
            call_command("calibrate_protocol", protocol.slug, stdout=io.StringIO())
        assert not ProtocolCalibration.objects.exists()


def test_rerun_table_columns():
    tau = 0.06
    within = measured_runs(12, 30, tau)
    est = cal.between_run_variance(within)
    stored = cal.widened(within, est.variance)
    rows = cal.rerun_table(stored, within, est.variance)
    assert len(rows) == 30
    row = rows[0]
    assert row["difference_pct"] == pytest.approx((row["speedup_a"] / row["speedup_b"] - 1) * 100)
    # |z| from the widened stored intervals is below |z| from the within-run ones.
    assert all(abs(r["z_stored"]) <= abs(r["z_within"]) + 1e-12 for r in rows)
    shares = cal.table_shares(rows)
    assert shares["cells"] == 30
    assert shares["z_within"] < 0.85 <= shares["z_rerun"] and shares["z_stored"] >= 0.9
    # Every key its own fold here: each judged by the other 29 keys' estimate.
    assert all(r["z_held_out"] is not None for r in rows)
    assert shares["z_held_out"] >= 0.85
    assert cal.table_shares([]) == {"cells": 0, "z_stored": None, "z_within": None,
                                    "z_rerun": None, "z_held_out": None}


# ----------------------------------------------------------------------- engine starts

def _records(rate, passes, prompts=4, tokens=50):
    """Records of one cell: ``passes`` {(engine start, repetition): relative speed}, every
    prompt ``tokens`` long, at ``rate`` tokens/s x the pass's speed."""
    return [{"prompt_id": str(i), "engine_start": s, "repetition": r,
             "output_token_ids": [1] * tokens, "time_share": tokens / (rate * speed)}
            for (s, r), speed in passes.items() for i in range(prompts)]


def test_pass_log_speedup_divides_each_pass_by_the_baseline_pass_of_its_repetition():
    from worker.calibration import pass_log_speedup

    base = _records(30.0, {(0, 0): 1.0, (0, 1): 0.5, (1, 2): 1.0})
    drafter = _records(45.0, {(0, 0): 1.0, (0, 1): 0.5, (1, 2): 1.1, (1, 3): 1.0})
    got = pass_log_speedup(drafter, base)
    assert set(got) == {(0, 0), (0, 1), (1, 2)}         # pass 3 has no baseline pass
    assert got[(0, 0)] == pytest.approx(math.log(1.5))
    assert got[(0, 1)] == pytest.approx(math.log(1.5))  # a slow pass on both sides cancels
    assert got[(1, 2)] == pytest.approx(math.log(1.65))
    # records before engine starts (no key) are start 0
    old = [{k: v for k, v in r.items() if k != "engine_start"} for r in base]
    assert pass_log_speedup(old, old) == {(0, 0): 0.0, (0, 1): 0.0, (0, 2): 0.0}


def test_start_components_separate_the_engine_starts_variance_from_the_passes():
    """Seeded: 400 cells, two starts of two passes each; a pass's log-speedup is the cell's
    plus its start's effect (sd 3%) plus its own noise (sd 1%)."""
    from worker.calibration import start_components

    rng = np.random.default_rng(3)
    cells = []
    for _ in range(400):
        mu = rng.normal(0.2, 0.3)
        starts = rng.normal(0, 0.03, size=2)
        cells.append({(s, r): mu + starts[s] + rng.normal(0, 0.01)
                      for s, r in ((0, 0), (0, 1), (1, 2), (1, 3))})
    c = start_components(cells)
    assert (c.within_pairs, c.between_pairs) == (400 * 2, 400 * 4)
    assert math.sqrt(c.within) == pytest.approx(0.01, rel=0.1)
    assert math.sqrt(c.between) == pytest.approx(math.hypot(0.01, 0.03), rel=0.1)
    assert math.sqrt(c.start) == pytest.approx(0.03, rel=0.1)
    # one pass per start: no within pairs, so no start component either
    one = start_components([{(0, 0): 0.1, (1, 1): 0.2}])
    assert one.within is None and one.start is None and one.between == pytest.approx(0.005)
