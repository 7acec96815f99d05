"""A group's passes (worker.measure.measure_group): loaded passes measured again with their
pairing kept, and adaptive passes stopping on the target, the budget or the maximum. The
passes are seeded records (no engine): a group-pass's records come from a seeded model of
prompts and pass-to-pass timing noise, and the half-widths from worker.intervals itself.
The real engine with a CPU hog is tests/test_vllm_measure.py::test_a_hog_*."""
from dataclasses import replace

import numpy as np
import pytest

from worker.cell import PassResult
from worker.measure import group_half_widths, measure_group, relative_half_width, stop_reason
from worker.metrics import SpecCounts
from worker.protocol import Cell, ProtocolSpec, TaskSpec

GROUP = [Cell("chat", 4, 0.0, 0), Cell("chat", 4, 0.0, 2), Cell("chat", 4, 0.0, 4)]
SPEEDUP = {0: 1.0, 2: 1.2, 4: 1.3}


def spec(**changes):
    base = dict(slug="p", version=3, target="t", target_sha256="0" * 64, engine="vllm",
                hardware="cpu", tasks=(TaskSpec("chat", "mt-bench", "a" * 64, 8),),
                batch_sizes=(1, 4), ks=(2, 4), repetitions=2)
    return ProtocolSpec(**{**base, **changes})


class SeededPasses:
    """measure(cell, rep) and records_of(cell, pass) over a seeded model: 8 prompts of
    40-120 tokens, a speedup per k with a small per-prompt effect, and timing noise of
    `noise` (relative sd) per request and pass. `loaded(cell, rep, attempt)` says which
    passes the host loaded; `pass_s` advances the clock per cell-pass."""

    def __init__(self, noise=0.15, prompt_effect=0.01, loaded=lambda c, r, a: False,
                 pass_s=10.0, seed=7):
        self.rng = np.random.default_rng(seed)
        self.tokens = self.rng.integers(40, 120, size=8)
        self.effect = 1 + prompt_effect * self.rng.standard_normal(8)
        self.noise, self.loaded, self.pass_s = noise, loaded, pass_s
        self.now, self.attempts, self.records, self.calls = 0.0, {}, {}, []

    def clock(self):
        return self.now

    def measure(self, cell, rep):
        attempt = self.attempts.get((cell, rep), 0)
        self.attempts[(cell, rep)] = attempt + 1
        self.calls.append((cell.k, rep))
        self.now += self.pass_s
        loaded = self.loaded(cell, rep, attempt)
        p = PassResult(rep, [], [], self.pass_s, cell.batch_size, SpecCounts(),
                       host_load=0.02, engine_core_load=0.6 if loaded else 0.01,
                       engine_cores=(0,))
        rate = 30.0 * (SPEEDUP[cell.k] * self.effect if cell.k else 1.0)
        jitter = np.exp(self.noise * self.rng.standard_normal(8))
        self.records[id(p)] = [
            {"prompt_id": str(i), "repetition": rep, "output_token_ids": [1] * int(t),
             "time_share": float(t / (rate[i] if cell.k else rate) * jitter[i])}
            for i, t in enumerate(self.tokens)]
        return p

    def records_of(self, cell, p):
        return self.records[id(p)]

    def run(self, spec, log=None):
        lines = []
        out = measure_group(GROUP, spec, self.measure, self.records_of,
                            log=log or lines.append, clock=self.clock)
        return out, lines


def widths_after(model, out, n):
    """The group's half-widths from its kept passes 0..n-1."""
    return group_half_widths({cell: [r for p in out.passes[cell][:n]
                                     for r in model.records_of(cell, p)] for cell in GROUP})


# ----------------------------------------------------------------------- the stopping rule

def test_without_a_target_a_group_measures_exactly_its_repetitions():
    s = spec(repetitions=3)
    assert stop_reason(s, 2, 0.0, 1.0) is None
    assert stop_reason(s, 3, 1e9, 1e9, [0.5]) == "fixed"
    model = SeededPasses()
    out, _ = model.run(s)
    assert out.stop == "fixed"
    assert [[p.repetition for p in out.passes[c]] for c in GROUP] == [[0, 1, 2]] * 3


def test_the_rule_in_its_order_target_then_max_then_budget():
    s = spec(target_half_width=0.05, max_repetitions=6, cell_time_budget_s=100.0)
    assert stop_reason(s, 1, 0.0, 1.0, [0.01]) is None            # below the minimum
    assert stop_reason(s, 2, 0.0, 1.0, [0.04, 0.05]) == "target"
    assert stop_reason(s, 2, 0.0, 1.0, [0.04, None]) is None      # no interval yet
    assert stop_reason(s, 6, 0.0, 1.0, [0.06]) == "max"
    assert stop_reason(s, 3, 80.0, 21.0, [0.06]) == "budget"     # another pass: 101 s
    assert stop_reason(s, 3, 80.0, 20.0, [0.06]) is None
    assert relative_half_width(2.0, 1.8, 2.1) == pytest.approx(0.1)


def test_a_group_measures_passes_until_its_speedups_reach_the_target():
    """Timing noise that more passes average out: the group stops on the first pass whose
    half-widths are all under the target, not before."""
    s = spec(target_half_width=0.06, max_repetitions=40)
    model = SeededPasses(noise=0.15)
    out, lines = model.run(s)
    n = len(out.passes[GROUP[0]])
    assert out.stop == "target" and s.repetitions < n < 40
    assert all(w <= 0.06 for w in widths_after(model, out, n))
    assert any(w > 0.06 for w in widths_after(model, out, n - 1))
    assert len(widths_after(model, out, n)) == 2          # one per drafter cell
    assert "(stopped: target)" in lines[-1]


def test_a_target_the_prompts_cannot_reach_stops_at_the_budget_or_the_maximum():
    """Per-prompt spread that no number of passes removes."""
    unreachable = dict(target_half_width=0.001, prompt_effect=0.3)
    model = SeededPasses(prompt_effect=unreachable["prompt_effect"])
    out, _ = model.run(spec(target_half_width=0.001, max_repetitions=5))
    assert out.stop == "max" and len(out.passes[GROUP[0]]) == 5
    # 3 cells x 10 s a group-pass: after 3 passes (90 s) a fourth would end at 120 s > 100.
    model = SeededPasses(prompt_effect=unreachable["prompt_effect"])
    out, _ = model.run(spec(target_half_width=0.001, cell_time_budget_s=100.0))
    assert out.stop == "budget" and len(out.passes[GROUP[0]]) == 3 and model.now <= 100.0


def test_a_baseline_run_is_judged_by_its_throughput_interval():
    cell = Cell("chat", 4, 0.0, 0)
    model = SeededPasses(noise=0.15)
    recs = [r for rep in range(3) for r in model.records_of(cell, model.measure(cell, rep))]
    [width] = group_half_widths({cell: recs})
    from worker.intervals import throughput_interval

    point = sum(len(r["output_token_ids"]) for r in recs) / sum(r["time_share"] for r in recs)
    assert width == pytest.approx(relative_half_width(point, *throughput_interval(recs)))
    assert 0 < width < 1


# ----------------------------------------------------------------------- loaded passes

def test_a_loaded_pass_is_measured_again_with_the_whole_group_and_the_same_repetition():
    # The k=2 cell's pass 1 is loaded on its first attempt only.
    model = SeededPasses(loaded=lambda c, r, a: c.k == 2 and r == 1 and a == 0)
    out, lines = model.run(spec(repetitions=3))
    # Every cell of the group measured pass 1 twice, in the group's order (pairing kept).
    assert model.calls == [(0, 0), (2, 0), (4, 0), (0, 1), (2, 1), (4, 1),
                           (0, 1), (2, 1), (4, 1), (0, 2), (2, 2), (4, 2)]
    for cell in GROUP:
        assert [p.repetition for p in out.passes[cell]] == [0, 1, 2]
        assert [p.repetition for p in out.remeasured[cell]] == [1]
        assert not any(p.loaded for p in out.passes[cell])     # the loaded one was dropped
    assert out.remeasured[GROUP[1]][0].loaded
    assert sum("measuring it again" in line for line in lines) == 1
    assert "0.60 on the engine's cores [0]" in lines[0]


def test_remeasures_stop_at_the_protocols_limit_and_the_cell_stays_loaded():
    always = SeededPasses(loaded=lambda c, r, a: c.k == 0 and r == 0)
    out, lines = always.run(spec(repetitions=2, max_loaded_remeasures=1))
    assert [len(out.remeasured[c]) for c in GROUP] == [1, 1, 1]
    assert out.passes[GROUP[0]][0].loaded                  # kept: no remeasure left
    assert [p.repetition for p in out.passes[GROUP[0]]] == [0, 1]
    default = SeededPasses(loaded=lambda c, r, a: True)
    out, _ = default.run(spec(repetitions=2))
    assert [len(out.remeasured[c]) for c in GROUP] == [2, 2, 2]   # 2 per group, not per pass
    assert replace(spec(), max_loaded_remeasures=0).loaded_remeasure_limit == 0


# ----------------------------------------------------------------------- engine starts

def test_a_later_engine_start_continues_the_groups_passes_under_its_own_limits():
    """Protocol v4 (engine_starts): each start's round measures under ``per_start`` limits,
    continues the repetition indices (pairs and seeds stay distinct), keeps the earlier
    passes and counts its minimum, budget and remeasures from its own passes."""
    s = spec(repetitions=2, target_half_width=0.001, max_repetitions=4,
             cell_time_budget_s=100.0, engine_starts=2)
    one = s.per_start()
    model = SeededPasses(prompt_effect=0.3)      # a target no pass count reaches
    first = measure_group(GROUP, one, model.measure, model.records_of, log=lambda m: None,
                          clock=model.clock)
    # 3 cells x 10 s a group-pass: a second pass would end at 60 s > 50 s (half the budget)
    assert first.stop == "budget" and [p.repetition for p in first.passes[GROUP[0]]] == [0]
    starts = []

    def second_start(cell, rep):          # as worker.measure marks a later start's passes
        starts.append(rep)
        p = model.measure(cell, rep)
        p.engine_start = 1
        return p

    second = measure_group(GROUP, one, second_start, model.records_of, log=lambda m: None,
                           clock=model.clock, earlier=first)
    assert second.stop == "budget" and starts == [1, 1, 1]
    for cell in GROUP:
        assert [(p.repetition, p.engine_start) for p in second.passes[cell]] == [(0, 0), (1, 1)]
        assert first.passes[cell] == second.passes[cell][:1]   # the earlier start's, kept
    # a start that is loaded remeasures up to the limit again (the limit is per start)
    loaded = SeededPasses(loaded=lambda c, r, a: r == 1 and a < 2)
    a = measure_group(GROUP, spec(repetitions=1), loaded.measure, loaded.records_of,
                      log=lambda m: None, clock=loaded.clock)
    b = measure_group(GROUP, spec(repetitions=1), loaded.measure, loaded.records_of,
                      log=lambda m: None, clock=loaded.clock, earlier=a)
    assert [len(b.remeasured[c]) for c in GROUP] == [2, 2, 2]
    assert [p.repetition for p in b.passes[GROUP[0]]] == [0, 1]
    assert not any(p.loaded for p in b.passes[GROUP[0]])


def test_a_later_start_judges_the_half_widths_on_every_start_s_passes():
    """The target is judged on the passes of all starts so far: a second start that adds
    the passes the target needs stops on it, though the start alone could not reach it."""
    s = spec(repetitions=2, target_half_width=0.06, max_repetitions=80, engine_starts=2)
    model = SeededPasses(noise=0.15)
    alone = SeededPasses(noise=0.15).run(s)[0]
    needed = len(alone.passes[GROUP[0]])          # one start alone reaches it after this many
    assert needed > 2
    first = measure_group(GROUP, replace(s.per_start(), max_repetitions=needed - 1),
                          model.measure, model.records_of, log=lambda m: None,
                          clock=model.clock)
    assert first.stop == "max" and len(first.passes[GROUP[0]]) == needed - 1
    second = measure_group(GROUP, s.per_start(), model.measure, model.records_of,
                           log=lambda m: None, clock=model.clock, earlier=first)
    assert second.stop == "target" and len(second.passes[GROUP[0]]) == needed
