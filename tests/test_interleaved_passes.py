"""Time slices (ProtocolSpec.interleave_s, protocol version 5): a group-pass whose engines
compute in turns, the others paused with their requests kept (worker.cell.sliced_group_pass),
and each pass's clock kept to its engine's turns (worker.cell.in_turns). Fake engines here
(no vLLM); the real engine's pause and resume are measured in tests/test_vllm_measure.py."""
import asyncio
import time

import pytest

from worker.cell import PassResult, PromptItem, in_turns, measure_pass, sliced_group_pass
from worker.engines.vllm_engine import RequestResult
from worker.metrics import SpecCounts
from worker.protocol import Cell, ProtocolSpec, TaskSpec

GROUP = [Cell("chat", 2, 0.0, 0), Cell("chat", 2, 0.0, 2)]


def spec(**changes):
    base = dict(slug="p", version=5, target="t", target_sha256="0" * 64, engine="vllm",
                hardware="cpu", tasks=(TaskSpec("chat", "mt-bench", "a" * 64, 6),),
                batch_sizes=(1, 2), ks=(2,), repetitions=2, max_new_tokens=8)
    return ProtocolSpec(**{**base, **changes})


def test_interleave_s_is_a_v5_key_validated_and_kept_per_engine_start():
    plain, sliced = spec(), spec(interleave_s=2)
    assert "interleave_s" not in plain.to_dict()   # earlier versions' hashes unchanged
    assert sliced.to_dict()["interleave_s"] == 2.0
    assert sliced.sha256() != plain.sha256()
    assert sliced.family_sha256() != plain.family_sha256()   # it changes what is measured
    assert ProtocolSpec.from_dict(sliced.to_dict()) == spec(interleave_s=2.0)
    assert spec(interleave_s=2, engine_starts=2).per_start().interleave_s == 2
    for bad in (0, -1, True, "2", 601):
        with pytest.raises(ValueError, match="interleave_s must be a number of seconds"):
            spec(interleave_s=bad)


def result(submitted, latency, ttft):
    return RequestResult("r", [1] * 4, 3, ttft, latency, "length", submitted=submitted)


def test_in_turns_counts_only_the_engines_turns():
    # turns 0-2 s and 5-7 s; request a from 0 to 6 s (TTFT 1 s), request b from 1.5 to 5.5 s
    # (its first token at 5.2 s: it waited, paused, through the other engine's turn)
    p = PassResult(0, [], [result(0.0, 6.0, 1.0), result(1.5, 4.0, 3.7)], 6.0, 2, SpecCounts())
    q = in_turns(p, [(0.0, 2.0), (5.0, 7.0)])
    assert [r.latency for r in q.results] == pytest.approx([3.0, 1.0])
    assert [r.ttft for r in q.results] == pytest.approx([1.0, 0.7])
    assert q.wall == pytest.approx(3.0)      # the pass: 0 to 6 s, of which 3 s in turns
    assert (q.repetition, q.max_in_flight) == (0, 2)


class FakeEngine:
    """A fake vLLM: a request makes a token every `step_s` seconds while the engine runs;
    pause() stops it at the next step, keeping the request. `running` (shared) lists the
    engines computing at each step, so a test can see that turns do not overlap."""

    def __init__(self, step_s, running):
        self.step_s, self.running, self.paused, self.frozen = step_s, running, False, False
        self.pauses, self.generated_tokens, self.last_token = 0, 0, None

    async def pause(self, freeze=False):
        self.paused, self.frozen = True, freeze
        self.pauses += 1

    async def resume(self):
        self.paused = self.frozen = False

    async def generate(self, prompt_ids, sampling, request_id):
        t0, tokens, ttft = time.perf_counter(), [], None
        while len(tokens) < sampling["max_tokens"]:
            while self.paused:
                await asyncio.sleep(0.001)
            self.running.append(frozenset(e for e in FAKES if not e.paused))
            self.frozen_meanwhile.append(frozenset(e for e in FAKES if e.frozen))
            await asyncio.sleep(self.step_s)
            tokens.append(7)
            self.generated_tokens += 1
            self.last_token = time.perf_counter()
            ttft = ttft or time.perf_counter() - t0
        return RequestResult(request_id, tokens, len(prompt_ids), ttft,
                             time.perf_counter() - t0, "length", submitted=t0)

    def spec_counts(self):
        return SpecCounts()

    frozen_meanwhile: list = []


FAKES = []


def test_a_sliced_group_pass_runs_one_engine_at_a_time_and_times_each_on_its_turns():
    running = []
    FAKES[:] = [FakeEngine(0.004, running), FakeEngine(0.002, running)]   # drafter 2x
    engines = dict(zip(GROUP, FAKES))
    s = spec(interleave_s=0.03)
    prompts = [PromptItem(str(i), ["x"]) for i in range(6)]
    ids = {p.id: [1, 2, 3] for p in prompts}

    async def run():
        return await sliced_group_pass(
            GROUP, engines, lambda c: measure_pass(engines[c], c, s, prompts, ids, 0, False),
            s.interleave_s)

    t0 = time.perf_counter()
    passes = asyncio.run(run())
    elapsed = time.perf_counter() - t0
    assert all(len(now) == 1 for now in running)   # every step: one engine computing
    assert all(not e.paused for e in FAKES)        # running again afterwards
    assert all(e.pauses > 2 for e in FAKES)        # several turns each
    base, drafter = passes[GROUP[0]], passes[GROUP[1]]
    for p in (base, drafter):
        assert [m[0].id for m in p.meta] == [q.id for q in prompts]
        assert all(len(r.output_token_ids) == 8 for r in p.results)
        assert p.max_in_flight == 2
        assert all(0 < r.latency <= p.wall + 1e-9 for r in p.results)
    # each pass's clock is its own turns: together about the elapsed time, not twice it
    assert base.wall + drafter.wall <= elapsed
    assert base.wall + drafter.wall > 0.7 * elapsed
    # 3 rounds of 8 steps at 4 ms against 2 ms: the drafter about twice as fast
    assert 1.4 < base.wall / drafter.wall < 2.8


def test_a_failed_pass_leaves_every_engine_running_and_raises():
    running = []
    FAKES[:] = [FakeEngine(0.002, running), FakeEngine(0.002, running)]
    engines = dict(zip(GROUP, FAKES))

    async def measure(cell):
        if cell.k:
            await asyncio.sleep(0.01)
            raise RuntimeError("engine died")
        await asyncio.sleep(0.05)
        return PassResult(0, [], [], 0.0, 0, SpecCounts())

    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(sliced_group_pass(GROUP, engines, measure, 0.01))
    assert all(not e.paused for e in FAKES)


def sliced_pass_of_fakes(step_s, fair, turn_s=0.01):
    """A sliced group-pass of a baseline and a drafter whose steps take ``step_s``."""
    running = []
    FAKES[:] = [FakeEngine(step, running) for step in step_s]
    FakeEngine.frozen_meanwhile = []
    engines = dict(zip(GROUP, FAKES))
    s = spec(interleave_s=turn_s, fair_turns=fair or None)
    prompts = [PromptItem(str(i), ["x"]) for i in range(6)]
    ids = {p.id: [1, 2, 3] for p in prompts}

    async def run():
        return await sliced_group_pass(
            GROUP, engines, lambda c: measure_pass(engines[c], c, s, prompts, ids, 0, False),
            s.interleave_s, fair=fair)

    return asyncio.run(run()), running


def test_fair_turns_end_the_group_passes_together_with_the_others_frozen():
    # the drafter three times as slow as the baseline (a speedup of 1/3)
    passes, running = sliced_pass_of_fakes((0.002, 0.006), fair=True)
    base, drafter = FAKES
    assert all(len(now) == 1 for now in running)
    # whoever computes, every other engine is frozen (no CPU for a paused engine's poll)
    assert all(frozen == frozenset(FAKES) - now
               for now, frozen in zip(running, FakeEngine.frozen_meanwhile))
    assert not any(e.frozen or e.paused for e in FAKES)      # running again afterwards
    # the drafter got about three times the baseline's turns, so the passes ended together:
    # within a turn or two (10 ms each), where round-robin turns let the drafter compute
    # alone for about 2/3 of its pass (~100 ms) after the baseline's ended
    fair_gap = abs(base.last_token - drafter.last_token)
    assert all(len(p.results) == 6 for p in passes.values())
    assert 2.0 < passes[GROUP[1]].wall / passes[GROUP[0]].wall < 4.2
    sliced_pass_of_fakes((0.002, 0.006), fair=False)
    round_robin_gap = abs(FAKES[0].last_token - FAKES[1].last_token)
    assert not any(FakeEngine.frozen_meanwhile)               # no freezing without fair turns
    assert fair_gap < 0.045 < round_robin_gap, (fair_gap, round_robin_gap)


def test_fair_turns_are_a_v6_key_that_needs_time_slices():
    fair = spec(interleave_s=2, fair_turns=True)
    assert fair.to_dict()["fair_turns"] is True
    assert "fair_turns" not in spec(interleave_s=2).to_dict()    # v5 hashes unchanged
    assert fair.family_sha256() != spec(interleave_s=2).family_sha256()
    assert ProtocolSpec.from_dict(fair.to_dict()) == fair
    assert fair.per_start().fair_turns is True
    with pytest.raises(ValueError, match="fair_turns needs interleave_s"):
        spec(fair_turns=True)
    with pytest.raises(ValueError, match="fair_turns must be true or false"):
        spec(interleave_s=2, fair_turns="yes")
