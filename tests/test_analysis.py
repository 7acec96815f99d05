"""When does acceptance pay (worker/analysis/, the "When does it pay?" page, the drafter
page's section, GET /api/protocols/{slug}/{version}/analysis, GET /api/recommend and the
export's analysis columns).

The records are synthetic with known answers: the target's forward time is
t_fwd(n) = C0 + C1 * n for n tokens in the batch, the baseline's requests take
TTFT + (m) x t_fwd(b) for m decode tokens, a drafter's take TTFT + the sum over its decode
steps of (t_fwd(b(d+1)) for a step that drafted d tokens, t_fwd(b) for one that drafted
nothing) + its draft cost per step, and the cells' figures are computed from those records
by worker.measure.cell_figures, as a worker does.
"""
import csv
import io
import json
import re

import pytest
from django.urls import reverse

from worker import analysis, metrics
from worker.measure import cell_figures
from worker.metrics import counts_from_steps

# Every test may use the database (the pure ones do not); the browser test is transactional.
pytestmark = pytest.mark.django_db

C0, C1 = 0.010, 0.001
TTFT = 0.002
K = 3


def t_fwd(n):
    return C0 + C1 * n


# Two prompts; the outputs are the same for every drafter (temperature 0, lossless).
OUTPUTS = {"p1": list(range(100, 109)), "p2": list(range(200, 207))}   # 9 and 7 tokens
# Step patterns (tokens per engine step, the prefill's first; accepted per verification step)
GOOD = {"p1": ([1, 4, 2, 1, 1], [3, 1, 0]), "p2": ([1, 3, 3], [2, 2])}   # 14 tokens, 6 steps
LATE = {"p1": ([1, 1, 1, 1, 1, 4], [0, 0, 0, 0, 3]), "p2": ([1, 3, 3], [2, 2])}  # 7 steps


def baseline_record(task, pid, b):
    out = OUTPUTS[pid]
    latency = TTFT + (len(out) - 1) * t_fwd(b)
    return {"prompt_id": pid, "task": task, "batch_size": b, "temperature": 0.0, "k": 0,
            "repetition": 0, "seed": None, "output_token_ids": out, "prompt_tokens": 5,
            "ttft": TTFT, "latency": latency, "finish_reason": "stop",
            "tpot": metrics.tpot(latency, TTFT, len(out))}


def forward_time(pattern, pid, b, k=K, drafted=None):
    """The target's forward time of one request's decode steps: t_fwd(b(d+1)) for a step
    that drafted d tokens, t_fwd(b) for one that drafted nothing."""
    step_tokens, accepted = pattern[pid]
    drafted = drafted or [k] * len(accepted)
    non_spec = len(step_tokens) - 1 - len(accepted)
    return sum(t_fwd(b * (d + 1)) for d in drafted) + non_spec * t_fwd(b)


def spec_record(task, pid, b, pattern, draft_cost, k=K, drafted=None, outputs=None):
    out = (outputs or OUTPUTS)[pid]
    step_tokens, accepted = pattern[pid]
    drafted = drafted or [k] * len(accepted)
    assert sum(step_tokens) == len(out)
    steps = len(step_tokens) - 1
    latency = TTFT + forward_time(pattern, pid, b, k, drafted) + steps * draft_cost
    counts = counts_from_steps(accepted, drafted, k)
    return {"prompt_id": pid, "task": task, "batch_size": b, "temperature": 0.0, "k": k,
            "repetition": 0, "seed": None, "output_token_ids": out, "prompt_tokens": 5,
            "ttft": TTFT, "latency": latency, "finish_reason": "stop",
            "tpot": metrics.tpot(latency, TTFT, len(out)),
            "drafts": counts.drafts, "draft_tokens": counts.draft_tokens,
            "accepted_tokens": counts.accepted_tokens, "accepted_at": counts.accepted_at,
            "cut_after_end": 0,
            "vllm_spec_decode": {"num_spec_steps": len(accepted), "per_step_accepted": accepted,
                                 "per_step_drafted": drafted},
            "step_tokens": step_tokens}


def make_cell(task, b, k, records, speculative):
    counts = metrics.SpecCounts(0, 0, 0, [0] * k)
    if speculative:
        for r in records:
            counts = counts + metrics.SpecCounts(r["drafts"], r["draft_tokens"],
                                                 r["accepted_tokens"], r["accepted_at"])
    wall = sum(r["latency"] for r in records) / b     # b requests in flight
    figures = cell_figures(counts, [len(r["output_token_ids"]) for r in records],
                           [r["ttft"] for r in records], [r["latency"] for r in records], wall)
    return {"task": task, "batch_size": b, "temperature": 0.0, "k": k, **figures,
            "records": records}


def baseline_cells(tasks=("chat",), sizes=(1, 2, 8)):
    return [make_cell(t, b, 0, [baseline_record(t, p, b) for p in OUTPUTS], False)
            for t in tasks for b in sizes]


def drafter_cells(pattern, draft_cost, tasks=("chat",), sizes=(1, 2, 8)):
    return [make_cell(t, b, K, [spec_record(t, p, b, pattern, draft_cost) for p in OUTPUTS],
                      True) for t in tasks for b in sizes]


def with_speedup(cells, base):
    thr = {(c["task"], c["batch_size"]): c["output_throughput"] for c in base}
    return [{**c, "speedup": metrics.speedup(c["output_throughput"],
                                             thr[(c["task"], c["batch_size"])])} for c in cells]


# ---- pure computations -----------------------------------------------------------------

def test_the_cost_model_recovers_the_targets_forward_time_from_the_baseline():
    models = analysis.fit_cost_models(baseline_cells(("chat", "code")))
    assert set(models) == {("chat", 0.0), ("code", 0.0)}
    m = models[("chat", 0.0)]
    assert m.c0 == pytest.approx(C0) and m.c1 == pytest.approx(C1)
    assert m(32) == pytest.approx(t_fwd(32))
    # one batch size: a constant; a falling time: the mean, never a negative slope
    assert analysis.fit_line([(4, 0.02)]).c1 == 0.0
    falling = analysis.fit_line([(1, 0.03), (4, 0.01)])
    assert falling.c1 == 0.0 and falling.c0 == pytest.approx(0.02)


def test_the_baselines_prefills_give_the_cost_of_each_further_token_of_a_sequence():
    c_tok = 0.0002          # a prompt token of a prefill costs a fifth of a decode sequence
    base = baseline_cells()
    for c in base:
        if c["batch_size"] == 1:
            for i, r in enumerate(c["records"]):
                r["prompt_tokens"] = 10 + 40 * i
                r["ttft"] = 0.005 + c_tok * r["prompt_tokens"]
    m = analysis.fit_cost_models(base)[("chat", 0.0)]
    assert (m.c0, m.c1, m.c_tok) == (pytest.approx(C0), pytest.approx(C1), pytest.approx(c_tok))
    assert m.to_dict()["c_tok_from"] == "prefill slope over 2 requests"
    assert m(8) == pytest.approx(t_fwd(8))                       # a decode step, q = 1
    assert m(2, K + 1) == pytest.approx(C0 + 2 * C1 + 2 * K * c_tok)
    # a drafter cell's verification costs t_fwd(b, k+1) of that model, not t_fwd(b(k+1))
    cells = with_speedup(drafter_cells(GOOD, 0.003), base)
    a = next(r for r in analysis.analyse_run(cells, base, "draft_model") if r["batch_size"] == 2)
    tv = C0 + 2 * C1 + 2 * K * c_tok
    assert a["t_verify"] == pytest.approx(tv) and tv < t_fwd(2 * (K + 1))
    # these records took t_fwd(8) per verification step (5 of the 6 decode steps; the
    # sixth drafted nothing and took t_fwd(2), as the model says): the model's smaller
    # verification leaves the difference in the measured remainder
    assert a["t_draft"] == pytest.approx(0.003 + 5 * (t_fwd(8) - tv) / 6)
    # no slope (one prompt length, or TTFT falling with the prompt): each token costs c1
    assert analysis.prefill_slope([{"prompt_tokens": 5, "ttft": 0.01}] * 3) == (None, 0)
    falling = [{"prompt_tokens": 10, "ttft": 0.02}, {"prompt_tokens": 50, "ttft": 0.01}]
    assert analysis.prefill_slope(falling) == (None, 0)
    plain = analysis.fit_cost_models(baseline_cells())[("chat", 0.0)]
    assert plain.c_tok is None and plain(2, K + 1) == pytest.approx(t_fwd(2 * (K + 1)))
    # a further token of a sequence never costs more than a further sequence's share of a
    # decode step (t_fwd(b) / b): the step's fixed part stays >= 0
    steep = analysis.CostModel(0.0, 0.001, c_tok=0.05)
    assert steep(4, 3) == pytest.approx(0.004 * 3)
    assert steep(4, 3) - 2 * 4 * steep.token_cost(4) >= 0


def test_a_vllm_cell_breakdown_bounds_and_efficiency_equal_the_hand_computed_values():
    base = baseline_cells()
    cells = with_speedup(drafter_cells(GOOD, 0.003), base)
    rows = analysis.analyse_run(cells, base, "draft_model")
    a = next(r for r in rows if r["batch_size"] == 2)
    t1, tv = t_fwd(2), t_fwd(8)                        # 0.012 and 0.018
    assert (a["tokens"], a["steps"], a["verify_steps"]) == (14, 6, 5)
    assert a["tokens_per_step"] == pytest.approx(14 / 6)
    assert a["t_fwd_b"] == pytest.approx(t1) and a["t_verify"] == pytest.approx(tv)
    # 5 verification steps of k + 1 tokens, 1 step that drafted nothing: a one-token forward
    forward = 5 * tv + t1
    assert a["t_forward"] == pytest.approx(forward / 6)
    assert a["t_draft"] == pytest.approx(0.003)
    # breakdown: TTFTs, the target's forwards, the rest; shares of the request time
    request_time = 2 * TTFT + forward + 6 * 0.003
    assert a["shares"]["prefill"] == pytest.approx(2 * TTFT / request_time)
    assert a["shares"]["verification"] == pytest.approx(forward / request_time)
    assert a["shares"]["drafting_other"] == pytest.approx(6 * 0.003 / request_time)
    assert sum(a["breakdown"].values()) == pytest.approx(a["wall_seconds"], rel=0.02)
    base_time = 2 * TTFT + 14 * t1                     # the baseline's requests
    assert a["baseline_time"] == pytest.approx(base_time)
    assert a["predicted_speedup"] == pytest.approx(base_time / request_time)   # 1.387
    # oracle: 8 tokens in steps of 4 + 4, 6 tokens in 4 + 2, each step verifying what it
    # emits, no draft cost
    assert a["oracle_tokens_per_step"] == pytest.approx(3.5)
    oracle_time = 2 * TTFT + 3 * t_fwd(8) + t_fwd(4)
    assert a["oracle_speedup"] == pytest.approx(base_time / oracle_time)       # 2.389
    # no-waste: the drafter's own steps (emitting 4, 2, 1, 1 and 3, 3) verifying only
    # what they emit, with the draft cost
    no_waste_time = (2 * TTFT + t_fwd(8) + t_fwd(4) + 2 * t_fwd(2) + 2 * t_fwd(6)
                     + 6 * 0.003)
    assert a["no_waste_speedup"] == pytest.approx(base_time / no_waste_time)   # 1.564
    measured = (2 * TTFT + 14 * t1) / request_time
    assert a["measured_speedup"] == pytest.approx(measured)
    assert a["engine_efficiency"] == pytest.approx(measured / a["predicted_speedup"])
    for r in rows:   # the bounds are at least the measured speedup, the oracle the highest
        assert r["oracle_speedup"] >= r["no_waste_speedup"] >= r["predicted_speedup"]
        assert r["predicted_speedup"] >= r["measured_speedup"] * (1 - 1e-9)
        assert r["oracle_speedup"] >= r["measured_speedup"]
        assert not r["measured_above_oracle"] and r["efficiency_note"] is None
        assert not r["verification_capped"]


def test_ngram_is_predicted_without_draft_cost_and_its_overhead_lowers_efficiency():
    base = baseline_cells()
    cells = with_speedup(drafter_cells(GOOD, 0.003), base)
    ngram = analysis.analyse_run(cells, base, "ngram")
    weighted = analysis.analyse_run(cells, base, "draft_model")
    for n, w in zip(ngram, weighted):
        b = n["batch_size"]
        forward = sum(forward_time(GOOD, p, b) for p in OUTPUTS)
        assert n["t_draft"] == 0.0 and n["t_overhead"] == pytest.approx(0.003)
        assert n["predicted_speedup"] == pytest.approx(
            (2 * TTFT + 14 * t_fwd(b)) / (2 * TTFT + forward))
        assert n["predicted_speedup"] > w["predicted_speedup"]
        assert n["engine_efficiency"] < w["engine_efficiency"]
        assert n["shares"] == w["shares"]
    # within the range, no note; 12 ms of overhead per step against 11-19 ms forwards puts
    # the efficiency below 0.8, and the note says what the model leaves out
    assert [n["efficiency_note"] for n in ngram] == [None] * len(ngram)
    slow = analysis.analyse_run(with_speedup(drafter_cells(GOOD, 0.012), base), base, "ngram")
    for n in slow:
        assert n["engine_efficiency"] < analysis.EFFICIENCY_RANGE[0]
        assert "no drafting cost" in n["efficiency_note"] and "12.00 ms" in n["efficiency_note"]


# An n-gram-like run: half the decode steps find no match and draft nothing, and the
# matches draft 4 or 2 tokens (k = 4). Outputs of 13 and 9 tokens (the prefill's first).
NGRAM_OUTPUTS = {"p1": list(range(300, 313)), "p2": list(range(400, 409))}
NGRAM = {"p1": ([1, 1, 5, 1, 3, 1, 1], [4, 2, 0]),      # 12 decode tokens in 6 steps
         "p2": ([1, 1, 3, 1, 3], [2, 2])}                # 8 decode tokens in 4 steps
NGRAM_DRAFTED = {"p1": [4, 2, 4], "p2": [4, 2]}


def ngram_cells(sizes=(1, 2, 8), overhead=0.0):
    """Cells of that run whose requests took exactly the target's forwards of the steps
    they ran (what the model says), plus `overhead` per decode step."""
    cells = []
    for b in sizes:
        recs = [spec_record("chat", p, b, NGRAM, overhead, k=4, drafted=NGRAM_DRAFTED[p],
                            outputs=NGRAM_OUTPUTS) for p in NGRAM_OUTPUTS]
        cells.append(make_cell("chat", b, 4, recs, True))
    return cells


def ngram_baseline(sizes=(1, 2, 8)):
    cells = []
    for b in sizes:
        recs = []
        for p, out in NGRAM_OUTPUTS.items():
            latency = TTFT + (len(out) - 1) * t_fwd(b)
            recs.append({"prompt_id": p, "repetition": 0, "output_token_ids": out,
                         "prompt_tokens": 5, "ttft": TTFT, "latency": latency})
        cells.append(make_cell("chat", b, 0, recs, False))
    return cells


def test_an_ngram_run_whose_steps_often_draft_nothing_is_predicted_at_its_measured_time():
    base = ngram_baseline()
    cells = with_speedup(ngram_cells(), base)
    old_efficiency = []
    for a, c in zip(analysis.analyse_run(cells, base, "ngram"), cells):
        b = a["batch_size"]
        assert (a["tokens"], a["steps"], a["verify_steps"]) == (20, 10, 5)
        assert a["tokens_per_step"] == pytest.approx(2.0)          # AL is 1 + 10/5 = 3
        assert a["drafted_tokens"] == 16
        # the model charges what these requests took: 5 one-token forwards, 3 steps
        # verifying 5 tokens, 2 verifying 3
        forward = 5 * t_fwd(b) + 3 * t_fwd(5 * b) + 2 * t_fwd(3 * b)
        assert a["modelled_forward_seconds"] == pytest.approx(forward)
        assert not a["verification_capped"]
        assert a["predicted_speedup"] == pytest.approx(a["measured_speedup"])
        assert a["engine_efficiency"] == pytest.approx(1.0)
        assert a["efficiency_note"] is None and not a["measured_above_oracle"]
        assert a["oracle_speedup"] >= a["no_waste_speedup"] >= a["predicted_speedup"]
        # the old model charged every decode step a (k+1)-token verification: more than
        # the measured decode time, so it was capped and the efficiency far above 1
        decode = sum(r["latency"] - r["ttft"] for r in c["records"])
        old_verification = 10 * t_fwd(5 * b)
        assert old_verification > decode
        old_predicted = 2.0 * t_fwd(b) / t_fwd(5 * b)
        old_efficiency.append(a["measured_speedup"] / old_predicted)
    assert min(old_efficiency) > 1.1 and max(old_efficiency) > analysis.EFFICIENCY_RANGE[1]
    # the cell's stored tokens per step stands in where there are no records (older runs)
    bare = analysis.analyse_cell({"task": "chat", "batch_size": 2, "temperature": 0.0, "k": 4,
                                  "decode_tokens": 20, "decode_steps": 10}, None, "ngram")
    assert bare["tokens_per_step"] == 2.0 and bare["predicted_speedup"] is None


def test_the_cut_last_step_is_charged_the_verification_it_ran():
    # drafted 3, all accepted, but EOS after 1 of them: the step emitted 2 tokens and was
    # verified with 4
    r = {"prompt_id": "x", "k": 3, "output_token_ids": list(range(7)), "ttft": 0.0,
         "latency": 1.0, "vllm_spec_decode": {"per_step_accepted": [3, 3],
                                              "per_step_drafted": [3, 3]},
         "step_tokens": [1, 4, 2]}
    rs = analysis.request_steps(r)
    assert rs.step_list == [(3, 4), (3, 2)] and rs.tokens == 6
    cell = {"task": "chat", "batch_size": 1, "temperature": 0.0, "k": 3, "records": [r],
            "wall_seconds": 1.0, "speedup": 1.0}
    a = analysis.analyse_cell(cell, analysis.CostModel(C0, C1), "draft_model")
    assert a["modelled_forward_seconds"] == pytest.approx(2 * t_fwd(4))
    # no-waste verifies only what each step emitted: 4, then 2
    assert a["no_waste_time"] == pytest.approx(t_fwd(4) + t_fwd(2) + 2 * a["t_draft"])


def random_records(rng, k, b, costs):
    """Requests with random step patterns: steps that draft nothing, drafts of 1..k with
    random acceptance, a last step cut at a random point; latencies from `costs`."""
    records = []
    for i in range(rng.randint(1, 4)):
        step_tokens, accepted, drafted, latency = [1], [], [], 0.0
        for _ in range(rng.randint(1, 12)):
            d = rng.choice([0, 0] + list(range(1, k + 1)))
            if d == 0:
                step_tokens.append(1)
            else:
                a = rng.randint(0, d)
                accepted.append(a)
                drafted.append(d)
                step_tokens.append(a + 1)
            latency += costs(d)
        if drafted and step_tokens[-1] > 1 and rng.random() < 0.5:   # the last step cut
            step_tokens[-1] = rng.randint(1, step_tokens[-1] - 1)
        n = sum(step_tokens)
        records.append({"prompt_id": f"r{i}", "k": k, "output_token_ids": list(range(n)),
                        "ttft": 0.001, "latency": 0.001 + latency,
                        "vllm_spec_decode": {"per_step_accepted": accepted,
                                             "per_step_drafted": drafted},
                        "step_tokens": step_tokens})
    return records


def test_oracle_no_waste_and_predicted_keep_their_order_on_random_records_and_models():
    import random

    rng = random.Random(14)
    checked = 0
    for trial in range(300):
        k, b = rng.randint(1, 6), rng.choice([1, 2, 4, 16])
        model = analysis.CostModel(rng.uniform(0, 0.02), rng.uniform(0, 0.003),
                                   c_tok=rng.choice([None, 0.0, rng.uniform(0, 0.05)]))
        slow = rng.uniform(0.3, 2.0)   # the run against the model: faster or slower
        records = random_records(rng, k, b, lambda d: slow * model(b, d + 1))
        cell = {"task": "chat", "batch_size": b, "temperature": 0.0, "k": k,
                "records": records, "wall_seconds": 1.0,
                "speedup": rng.uniform(0.2, 5.0)}
        for method in ("ngram", "draft_model"):
            a = analysis.analyse_cell(cell, model, method)
            if a["predicted_speedup"] is None:
                continue
            assert a["oracle_speedup"] >= a["no_waste_speedup"] >= a["predicted_speedup"], trial
            checked += 1
            assert a["measured_above_oracle"] == (cell["speedup"] > a["oracle_speedup"])
            if a["measured_above_oracle"]:
                assert "above the oracle bound" in a["efficiency_note"]
            lo, hi = analysis.EFFICIENCY_RANGE
            if not lo <= a["engine_efficiency"] <= hi:
                assert a["efficiency_note"], (trial, a["engine_efficiency"])
    assert checked > 400
    # reference-engine traces too
    prefill = {"drafting": 0.0, "verification": 0.020, "sampling": 0.0, "other": 0.001}
    for trial in range(100):
        step = {"drafting": rng.uniform(0, 0.01), "verification": rng.uniform(0.005, 0.03),
                "sampling": 0.001, "other": 0.001}
        seqs = {}
        for i in range(rng.randint(1, 3)):
            steps = [(0, 0, 1)]
            for _ in range(rng.randint(1, 6)):
                d = rng.randint(0, 3)
                a = rng.randint(0, d)
                steps.append((d, a, a + 1))
            seqs[f"p{i}"] = steps
        times = [prefill] + [step] * max(len(v) for v in seqs.values())
        cell = {"task": "chat", "batch_size": len(seqs), "temperature": 0.0, "k": 3,
                "records": trace_records(times, seqs), "wall_seconds": 1.0, "speedup": 1.5}
        model = rng.choice([analysis.CostModel(C0, C1), analysis.CostModel(C0, 0.0),
                            analysis.CostModel(C0, C1, c_tok=0.01)])
        a = analysis.analyse_cell(cell, model, "draft_model")
        assert a["oracle_speedup"] >= a["no_waste_speedup"] >= a["predicted_speedup"], trial


def test_a_measured_speedup_above_the_oracle_is_flagged_with_a_note():
    base = ngram_baseline()
    fast = ngram_cells()
    for c in fast:   # the drafter's requests ran in a fifth of the time the model says
        for r in c["records"]:
            r["latency"] = r["ttft"] + (r["latency"] - r["ttft"]) * 0.2
    cells = [make_cell(c["task"], c["batch_size"], c["k"], c["records"], True) for c in fast]
    rows = analysis.analyse_run(with_speedup(cells, base), base, "ngram")
    for a in rows:
        assert a["measured_speedup"] > a["oracle_speedup"] and a["measured_above_oracle"]
        assert a["verification_capped"]
        assert "above the oracle bound" in a["efficiency_note"]
        assert "exceed the cell's measured decode time" in a["efficiency_note"]


def test_verification_above_the_measured_decode_time_is_capped_so_shares_still_add_up():
    base = baseline_cells(sizes=(1, 2))
    fast = drafter_cells(GOOD, 0.0, sizes=(1, 2))
    for c in fast:   # the drafter ran faster than the cost model says a step can
        for r in c["records"]:
            r["latency"] = r["ttft"] + (r["latency"] - r["ttft"]) * 0.5
    a = analysis.analyse_run(fast, base, "ngram")[0]
    assert a["verification_capped"] and a["shares"]["drafting_other"] == 0.0
    assert sum(a["shares"].values()) == pytest.approx(1.0)


def trace_records(step_times, sequences):
    """Reference-engine records of one generation: per sequence, its steps (drafted,
    accepted, emitted); the batch step times are shared by the sequences."""
    records = []
    for pid, steps in sequences.items():
        out, trace = [], []
        for i, (drafted, accepted, emitted) in enumerate(steps):
            tokens = list(range(len(out), len(out) + emitted))
            out += tokens
            trace.append({"step": i, "seq": 0, "drafted": list(range(drafted)),
                          "accepted": accepted, "bonus": 1, "emitted": tokens,
                          "times": step_times[i], "finished": i == len(steps) - 1})
        records.append({"prompt_id": pid, "output_token_ids": out, "steps": trace})
    return records


def test_reference_traces_use_the_measured_phases_which_add_up_to_the_wall_time():
    prefill = {"drafting": 0.0, "verification": 0.020, "sampling": 0.0, "other": 0.001}
    step = {"drafting": 0.004, "verification": 0.016, "sampling": 0.002, "other": 0.001}
    times = [prefill, step, step, step]
    records = trace_records(times, {
        "p1": [(0, 0, 1), (3, 3, 4), (3, 1, 2), (3, 2, 3)],     # 9 decode tokens, 3 steps
        "p2": [(0, 0, 1), (3, 0, 1), (3, 3, 4)],                 # 5 decode tokens, 2 steps
    })
    wall = sum(sum(t.values()) for t in times)
    cell = {"task": "chat", "batch_size": 2, "temperature": 0.0, "k": 3, "records": records,
            "wall_seconds": wall, "speedup": 1.2}
    model = analysis.CostModel(C0, C1)
    a = analysis.analyse_cell(cell, model, "draft_model")
    assert a["source"] == "reference traces"
    assert sum(a["breakdown"].values()) == pytest.approx(wall, rel=0.02)
    assert a["breakdown"]["drafting"] == pytest.approx(3 * 0.004)
    assert a["breakdown"]["sampling"] == pytest.approx(3 * 0.002)
    assert a["t_draft"] == pytest.approx(0.004) and a["t_verify"] == pytest.approx(0.016)
    assert (a["tokens"], a["steps"]) == (14, 5)
    assert a["predicted_speedup"] == pytest.approx(14 / 5 * t_fwd(2) / 0.020)
    # oracle: 9 tokens in steps of 4 + 4 + 1, 5 in 4 + 1; a step of k + 1 tokens at the
    # measured verification cost, a one-token step scaled by the cost model's shape
    one = 0.016 * t_fwd(2) / t_fwd(8)
    assert a["oracle_speedup"] == pytest.approx(14 * t_fwd(2) / (3 * 0.016 + 2 * one))
    assert a["oracle_speedup"] >= a["predicted_speedup"] >= a["measured_speedup"]


def test_a_cut_last_step_and_non_speculative_steps_are_read_from_the_step_record():
    r = {"prompt_id": "x", "output_token_ids": list(range(8)), "ttft": 0.0, "latency": 1.0,
         "vllm_spec_decode": {"per_step_accepted": [2, 0, 3]},
         "step_tokens": [1, 3, 1, 1, 2]}          # verify(2), non-spec or verify(0), ..., cut
    rs = analysis.request_steps(r)
    assert rs.aligned and rs.tokens == 7 and rs.steps == 4
    assert rs.spans == [(1, 2), (4, 0), (6, 2)] and rs.non_spec == 1
    assert analysis.accepted_from(rs) == [0, 2, 1, 0, 0, 0, 2, 1]


def test_the_oracle_combination_takes_the_furthest_reach_of_any_drafter():
    good = drafter_cells(GOOD, 0.003, sizes=(2,))[0]["records"]
    late = drafter_cells(LATE, 0.001, sizes=(2,))[0]["records"]
    model = analysis.CostModel(C0, C1)
    res = analysis.oracle_combine({"good": good, "late": late}, K, model, 2,
                                  {p: out for p, out in OUTPUTS.items()})
    # p1: good reaches position 5 from 1, late 9 from 5 -> 2 steps; p2: both 2 steps
    assert (res["tokens"], res["steps"], res["requests"]) == (14, 4, 2)
    assert res["al_combine"] == pytest.approx(3.5)
    assert res["drafter_tokens_per_step"] == {"good": pytest.approx(14 / 6),
                                              "late": pytest.approx(2.0)}
    assert res["al_combine"] >= max(res["drafter_tokens_per_step"].values())
    assert res["speedup_bound"] == pytest.approx(3.5 * t_fwd(2) / t_fwd(8))
    # a drafter whose output differs from the baseline's is left out of a request
    bad = json.loads(json.dumps(late))
    bad[0]["output_token_ids"] = bad[0]["output_token_ids"][:-1] + [0]
    bad[0]["step_tokens"] = [1, 1, 1, 1, 1, 4]
    res = analysis.oracle_combine({"good": good, "late": bad}, K, model, 2, OUTPUTS)
    assert res["requests"] == 1 and res["tokens"] == 6


def test_crossover_matrix_recommender_and_pareto_on_crafted_results():
    assert analysis.crossover({1: 1.5, 2: 1.2, 8: 0.8}) == {
        "measured": 8, "interpolated": pytest.approx(2 ** (1 + 0.2 / 0.4 * 2))}
    assert analysis.crossover({1: 1.5, 2: 1.1}) == {"measured": None, "interpolated": None}
    assert analysis.crossover({1: 0.9})["measured"] == 1
    entries = [{"drafter": "a", "k": 2, "task": "chat", "batch_size": 1, "speedup": 1.8},
               {"drafter": "b", "k": 4, "task": "chat", "batch_size": 1, "speedup": 2.1},
               {"drafter": "a", "k": 2, "task": "chat", "batch_size": 8, "speedup": 0.9}]
    m = analysis.best_matrix(entries, ["chat"], [1, 8])
    assert (m[("chat", 1)]["drafter"], m[("chat", 1)]["k"]) == ("b", 4)
    assert m[("chat", 8)]["drafter"] is None and m[("chat", 8)]["best_drafter_speedup"] == 0.9
    # a is fast on chat, b on code; throughput in tokens/s
    base = [{"task": "chat", "batch_size": 4, "output_throughput": 100.0},
            {"task": "code", "batch_size": 4, "output_throughput": 100.0}]
    cells = [{"drafter": "a", "k": 2, "task": "chat", "batch_size": 4, "output_throughput": 300.0},
             {"drafter": "a", "k": 2, "task": "code", "batch_size": 4, "output_throughput": 110.0},
             {"drafter": "b", "k": 3, "task": "chat", "batch_size": 4, "output_throughput": 150.0},
             {"drafter": "b", "k": 3, "task": "code", "batch_size": 4, "output_throughput": 250.0}]
    chat = analysis.recommend(cells, base, {"chat": 0.9, "code": 0.1}, 5)
    assert chat["batch_size"] == 4 and (chat["best"]["drafter"], chat["best"]["k"]) == ("a", 2)
    expected = 1 / (0.9 / 300 + 0.1 / 110)
    assert chat["best"]["throughput"] == pytest.approx(expected)
    assert chat["best"]["speedup"] == pytest.approx(expected / 100.0)
    assert (chat["best"]["speedup_min"], chat["best"]["speedup_max"]) == (
        pytest.approx(1.1), pytest.approx(3.0))
    code = analysis.recommend(cells, base, {"chat": 1, "code": 3}, 4)
    assert code["best"]["drafter"] == "b"
    slow = [dict(c, output_throughput=80.0) for c in cells]
    assert analysis.recommend(slow, base, {"chat": 1}, 4)["best"]["drafter"] is None
    with pytest.raises(ValueError):
        analysis.normalise_mix({"chat": 0})
    pts = analysis.pareto([{"cost": 0.0, "al": 1.8}, {"cost": 0.1, "al": 2.5},
                           {"cost": 0.2, "al": 2.4}, {"cost": 0.3, "al": 3.1},
                           {"cost": None, "al": 4.0}])
    assert [p["frontier"] for p in pts] == [True, True, False, True, False]


# ---- break-even map ----------------------------------------------------------------------

def test_the_break_even_is_the_draft_cost_plus_the_verification_over_a_forward():
    model = analysis.fit_cost_models(baseline_cells())[("chat", 0.0)]
    # no prefill slope in these records (one prompt length): c_tok = c1, t_fwd(b, q) = t_fwd(b q)
    for b in (1, 2, 8):
        for cost in (0.0, 0.3, 1.7):
            expected = cost + t_fwd(b * (K + 1)) / t_fwd(b)
            assert analysis.break_even_acceptance(model, b, K, cost) == pytest.approx(expected)
    # a share s of the steps drafts: tau* counts s k drafted tokens a step, AL* = 1 + (tau*-1)/s
    be = analysis.break_even(model, 2, K, 0.25, drafting_share=0.5)
    tau = 0.25 + t_fwd(2 * (1 + 0.5 * K)) / t_fwd(2)
    assert be["tokens_per_step"] == pytest.approx(tau)
    assert be["acceptance_length"] == pytest.approx(1 + (tau - 1) / 0.5)
    assert be["reachable"] == (be["acceptance_length"] <= K + 1)
    assert analysis.break_even(model, 2, K, 0.0, drafting_share=0.0)["acceptance_length"] is None


def test_a_drafter_exactly_at_its_break_even_is_predicted_and_measured_at_one():
    """The GOOD pattern at b=2 (14 decode tokens in 6 steps, 5 verifying k + 1 tokens), with
    the draft cost per step chosen so that its tokens per step equal its break-even: the
    map, the predicted speedup (prefill included: it does not move the break-even) and the
    cell's measured speedup are all 1.0x; a cheaper drafter is above it and pays."""
    b = 2
    forwards = 5 * t_fwd(b * (K + 1)) + t_fwd(b)
    at_break_even = (14 * t_fwd(b) - forwards) / 6
    assert at_break_even > 0
    base = baseline_cells()      # b = 1, 2, 8: the fit recovers C0 and C1
    for cost, pays in ((at_break_even, None), (at_break_even / 2, True)):
        cell = with_speedup(drafter_cells(GOOD, cost, sizes=(b,)), base)[0]
        a = analysis.analyse_run([cell], base, "draft_model")[0]
        assert a["tokens_per_step"] == pytest.approx(14 / 6)
        assert a["draft_cost_relative"] == pytest.approx(cost / t_fwd(b))
        own = analysis.break_even(analysis.fit_cost_models(base)[("chat", 0.0)], b, K,
                                  a["draft_cost_relative"], drafting_share=5 / 6)
        assert a["break_even_tokens_per_step"] == pytest.approx(own["tokens_per_step"])
        if pays is None:
            assert a["break_even_tokens_per_step"] == pytest.approx(14 / 6)
            for figure in ("map_speedup", "predicted_speedup", "measured_speedup"):
                assert a[figure] == pytest.approx(1.0), figure
        else:
            assert a["map_speedup"] > 1 and a["measured_speedup"] > 1
            # without prefill the map speedup is the predicted speedup's decode-only part
            assert a["map_speedup"] == pytest.approx(14 * t_fwd(b) / (forwards + 6 * cost))


def test_break_even_curves_rise_with_draft_cost_batch_size_and_k_and_stop_at_k_plus_one():
    import random

    rng = random.Random(7)
    for _ in range(200):
        c0, c1 = rng.uniform(0, 0.02), rng.uniform(0, 0.003)
        c_tok = rng.choice([None, rng.uniform(0, 0.01)])
        if c0 + c1 == 0:
            continue
        model = analysis.CostModel(c0, c1, c_tok=c_tok)
        costs = sorted(rng.uniform(0, 3) for _ in range(6))
        for k in (1, 2, 4):
            for b in (1, 2, 4, 8, 16):
                taus = [analysis.break_even_acceptance(model, b, k, x) for x in costs]
                assert taus == sorted(taus)
                assert taus[0] >= 1 + costs[0] - 1e-12      # at least one forward's worth
                # growing b or k never lowers what a drafter needs
                assert analysis.break_even_acceptance(model, 2 * b, k, costs[0]) \
                    >= taus[0] - 1e-12
                assert analysis.break_even_acceptance(model, b, k + 1, costs[0]) \
                    >= taus[0] - 1e-12
                curve = analysis.break_even_curve(model, b, k, costs)
                ys = [p["tokens_per_step"] for p in curve]
                assert ys == sorted(ys) and all(y <= k + 1 + 1e-12 for y in ys)
                if taus[-1] > k + 1 and curve:
                    assert curve[-1]["tokens_per_step"] == k + 1   # where no drafter pays


def test_the_break_even_refuses_inputs_no_drafter_can_have():
    model = analysis.CostModel(C0, C1)
    for args, kwargs, match in (
            ((None, 2, K, 0.1), {}, "cost model"),
            ((model, 0, K, 0.1), {}, "batch size"),
            ((model, 2, 0, 0.1), {}, "k must be"),
            ((model, 2, K, -0.1), {}, "draft cost"),
            ((model, 2, K, float("nan")), {}, "draft cost"),
            ((model, 2, K, float("inf")), {}, "draft cost"),
            ((model, 2, K, 0.1), {"drafting_share": 1.5}, "share"),
            ((model, 2, K, 0.1), {"drafted_tokens": K + 1}, "drafts within"),
            ((model, 2, K, 0.1), {"drafted_tokens": 0}, "drafts within"),
            ((analysis.CostModel(0.0, 0.0), 2, K, 0.1), {}, "no positive forward")):
        with pytest.raises(ValueError, match=match):
            analysis.break_even(*args, **kwargs)


# ---- site and API -------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def no_page_cache(settings):
    settings.SPECBOARD_PAGE_CACHE_SECONDS = 0


SIZES = (1, 2, 8)
DRAFT_COST = 0.002     # the draft model's cost per step; the n-gram drafter's overhead 0.0005


def good_predicted(b, cost):
    """The predicted speedup of the GOOD pattern at batch size b: 14 decode tokens in 6
    steps, 5 of them verifying k + 1 tokens and one that drafted nothing."""
    return (2 * TTFT + 14 * t_fwd(b)) / (2 * TTFT + 5 * t_fwd(b * (K + 1)) + t_fwd(b)
                                         + 6 * cost)


def good_oracle(b):
    """The oracle speedup of the GOOD outputs (8 and 6 decode tokens: steps of 4+4, 4+2)."""
    return (2 * TTFT + 14 * t_fwd(b)) / (2 * TTFT + 3 * t_fwd(b * 4) + t_fwd(b * 2))


@pytest.fixture
def pays_board(media):
    """A protocol (chat, code; b 1, 2, 8; k 3; temperature 0) with a baseline, a draft
    model that is good on chat (GOOD) and late on code, and an n-gram drafter the other way
    round; every cell's records written to the storage as a worker writes them."""
    from leaderboard import records
    from leaderboard.models import Result
    from leaderboard.services import runs

    from . import factories as f

    target = f.make_target(slug="pays-target")
    protocol = f.make_protocol(target, slug="pays", hardware="pays-hw", tasks=("chat", "code"),
                               batch_sizes=SIZES, temperatures=(0.0,), ks=(K,))

    def store(run, cells, base=None):
        rows = []
        for c in cells:
            records.write_cell(run.pk, {**c, "temperature": 0.0}, c["records"])
            figures = {k: v for k, v in c.items() if k not in ("task", "batch_size",
                                                                "temperature", "k", "records")}
            r = Result(run=run, task=c["task"], batch_size=c["batch_size"], temperature=0.0,
                       k=c["k"], **figures)
            if base is not None:
                b = base[(c["task"], c["batch_size"])]
                r.baseline_result, r.lossless_share = b, 1.0
                r.speedup = metrics.speedup(r.output_throughput, b.output_throughput)
            r.save()
            rows.append(r)
        run.artifact = records.write_artifact(run.pk, (c["records"] for c in cells))
        run.save(update_fields=["artifact"])
        if base is not None:   # what runs.finish does for a succeeded drafter run
            assert runs.record_analysis(run) == len(rows)
        return rows

    base_run = f.make_run(protocol)
    base_rows = store(base_run, baseline_cells(("chat", "code"), SIZES))
    base = {(r.task, r.batch_size): r for r in base_rows}
    eagle = f.make_drafter(target, "Pays draft", method="draft_model")
    ngram = f.make_drafter(target, "Pays ngram", method="ngram")
    store(f.make_run(protocol, eagle),
          drafter_cells(GOOD, DRAFT_COST, ("chat",), SIZES)
          + drafter_cells(LATE, DRAFT_COST, ("code",), SIZES),
          base)
    store(f.make_run(protocol, ngram),
          drafter_cells(LATE, 0.0005, ("chat",), SIZES) + drafter_cells(GOOD, 0.0005, ("code",), SIZES),
          base)
    return {"protocol": protocol, "eagle": eagle, "ngram": ngram, "baseline": base_run}


def test_the_pays_page_shows_matrix_bounds_pareto_combine_and_definitions(
        client, pays_board, django_assert_max_num_queries):
    url = reverse("protocol_pays", args=["pays", 1])
    with django_assert_max_num_queries(4):
        response = client.get(url)
    assert response.status_code == 200
    html = response.content.decode()
    data = response.context["data"]
    # chat: the draft model wins at b=1; code: the n-gram drafter (GOOD pattern, cheaper)
    matrix = {row["task"]: row["cells"] for row in data["matrix"]}
    assert matrix["chat"][0]["drafter"]["slug"] == "pays-draft"
    assert matrix["code"][0]["drafter"]["slug"] == "pays-ngram"
    for row in data["matrix"]:
        for c in row["cells"]:
            assert c["drafter"] is None or c["speedup"] > 1
    curves = {c["drafter"]["slug"]: c for c in data["curves"]}
    for c in curves.values():
        for r in c["by_batch"]:
            assert r["oracle_speedup"] >= r["predicted_speedup"]
            assert r["oracle_speedup"] >= r["measured_speedup"]
            assert sum(r["shares"].values()) == pytest.approx(1.0, abs=0.02)
        measured = {r["batch_size"]: r["measured_speedup"] for r in c["by_batch"]}
        assert c["crossover"] == analysis.crossover(measured)
    assert curves["pays-draft"]["crossover"]["measured"] == 8      # 0.9x at b=8
    # combine on each (task, b): both drafters, known AL
    combine = {(c["task"], c["batch_size"]): c for c in data["combine"]}
    assert combine[("chat", 2)]["al_combine"] == pytest.approx(3.5)
    assert combine[("chat", 2)]["speedup_bound"] == pytest.approx(3.5 * t_fwd(2) / t_fwd(8))
    points = {p["drafter"]["slug"]: p for p in data["pareto"]}
    assert points["pays-ngram"]["cost"] < points["pays-draft"]["cost"]
    assert points["pays-ngram"]["frontier"]
    for needle in ("Best drafter per task and batch size", "Oracle combination",
                   "Cost model (vLLM runs)", "cannot separate drafting from rejection sampling",
                   'id="fig-bounds"', 'id="fig-pareto"', 'id="fig-breakdown"', "Pays draft"):
        assert needle in html, needle
    # every number on the page comes from the data: a figure's value is in its JSON
    figs = {m.group(1): json.loads(m.group(2)) for m in re.finditer(
        r'<script type="application/json" id="fig-([\w-]+)">(.*?)</script>', html, re.S)}
    oracle_trace = next(t for t in figs["bounds"]["data"] if t["name"].startswith("Pays draft")
                        and t["name"].endswith("oracle"))
    assert oracle_trace["y"] == pytest.approx(
        [r["oracle_speedup"] for r in curves["pays-draft"]["by_batch"]])
    # linked from the protocol page, the leaderboard and the drafter page
    for page in (reverse("protocol", args=["pays", 1]), reverse("home") + "?protocol=pays@1",
                 reverse("drafter", args=["pays-draft"])):
        assert url in client.get(page).content.decode(), page


def test_the_pays_page_places_every_measured_drafter_on_the_break_even_map(client, pays_board):
    from leaderboard.models import Result

    url = reverse("protocol_pays", args=["pays", 1])
    response = client.get(url)
    html = response.content.decode()
    data = response.context["data"]
    assert data["map"]["baseline_run_id"] == pays_board["baseline"].pk
    tasks = {t["task"]: t for t in data["map"]["tasks"]}
    assert set(tasks) == {"chat", "code"}
    for t in tasks.values():
        assert sorted((p["drafter"]["slug"], p["batch_size"]) for p in t["points"]) == sorted(
            (slug, b) for slug in ("pays-draft", "pays-ngram") for b in SIZES)
        assert sorted((c["batch_size"], c["k"]) for c in t["curves"]) == [(b, K) for b in SIZES]
        for c in t["curves"]:   # starts at no draft cost: one verification of k + 1 tokens
            b = c["batch_size"]
            assert c["points"][0] == {"draft_cost": 0.0, "tokens_per_step": pytest.approx(
                t_fwd(b * (K + 1)) / t_fwd(b))}
    # the draft model on chat (GOOD: 5 of 6 steps draft k tokens), at b = 2: its own
    # break-even, the map's speedup, and the measured speedup of its result row beside it
    point = next(p for p in tasks["chat"]["points"]
                 if p["drafter"]["slug"] == "pays-draft" and p["batch_size"] == 2)
    assert point["draft_cost"] == pytest.approx(DRAFT_COST / t_fwd(2))
    needs = (DRAFT_COST + t_fwd(2 * (1 + 5 / 6 * K))) / t_fwd(2)
    assert point["break_even_tokens_per_step"] == pytest.approx(needs)
    assert point["map_speedup"] == pytest.approx((14 / 6) / needs)
    row = Result.objects.get(run__drafter=pays_board["eagle"], task="chat", batch_size=2)
    assert point["speedup"] == pytest.approx(row.speedup)
    assert point["acceptance_length"] == pytest.approx(row.acceptance_length)
    # drawn: the curves and the measured markers of each task, and the table beside it
    figs = {m.group(1): json.loads(m.group(2)) for m in re.finditer(
        r'<script type="application/json" id="fig-([\w-]+)">(.*?)</script>', html, re.S)}
    chat_map = {t["name"]: t for t in figs["map_0"]["data"]}
    assert {f"pays above: b={b}, k={K}" for b in SIZES} <= set(chat_map)
    marker = chat_map[f"Pays draft (k={K})"]
    chat_draft = [p for p in tasks["chat"]["points"] if p["drafter"]["slug"] == "pays-draft"]
    assert marker["y"] == pytest.approx([p["tokens_per_step"] for p in chat_draft])
    assert [c[0] for c in marker["customdata"]] == list(SIZES)     # its batch sizes
    # GOOD drafts on 5 of its 6 steps: its own break-even is drawn below its line's
    assert point["drafting_share"] == pytest.approx(5 / 6) and not point["drafts_every_step"]
    own = chat_map["its own break-even (not every step drafted k)"]
    assert own["y"] == pytest.approx([p["break_even_tokens_per_step"]
                                      for p in tasks["chat"]["points"]
                                      if not p["drafts_every_step"]])
    assert 'id="map-how-to-read"' in html and 'id="map-points"' in html
    assert "no such calibration has been run" in html


def test_the_pays_page_plots_throughput_against_per_user_speed_from_the_result_rows(
        client, pays_board):
    from leaderboard.models import Drafter, Result

    # rows measured under protocol v2 carry a 95% interval of their throughput
    rows = Result.objects.filter(run__drafter=pays_board["eagle"], task="code")
    for r in rows:
        r.output_throughput_low, r.output_throughput_high = (0.9 * r.output_throughput,
                                                             1.2 * r.output_throughput)
        r.save(update_fields=["output_throughput_low", "output_throughput_high"])
    Drafter.objects.filter(pk=pays_board["ngram"].pk).update(name="<b>Pays</b> ngram")
    html = client.get(reverse("protocol_pays", args=["pays", 1])).content.decode()
    figs = {m.group(1): json.loads(m.group(2)) for m in re.finditer(
        r'<script type="application/json" id="fig-([\w-]+)">(.*?)</script>', html, re.S)}
    for i, task in enumerate(("chat", "code")):
        lines = {t["name"]: t for t in figs[f"operating_{i}"]["data"]}
        for name, run in ((f"Pays draft (k={K})", f"run__drafter={pays_board['eagle'].pk}"),
                          (f"&lt;b&gt;Pays&lt;/b&gt; ngram (k={K})",
                           f"run__drafter={pays_board['ngram'].pk}"),
                          ("target alone (no drafter)", f"run={pays_board['baseline'].pk}")):
            key, pk = run.split("=")
            cells = Result.objects.filter(task=task, **{key: int(pk)}).order_by("batch_size")
            assert lines[name]["x"] == pytest.approx([1 / c.tpot_mean for c in cells]), name
            assert lines[name]["y"] == pytest.approx([c.output_throughput for c in cells]), name
            assert lines[name]["text"] == [f"b={c.batch_size}" for c in cells]
    code = {t["name"]: t for t in figs["operating_1"]["data"]}
    bars = code[f"Pays draft (k={K})"]["error_y"]
    assert bars["array"] == pytest.approx([0.2 * r.output_throughput for r in rows])
    assert bars["arrayminus"] == pytest.approx([0.1 * r.output_throughput for r in rows])
    assert not code["target alone (no drafter)"].get("error_y")   # no interval stored
    assert 'id="operating"' in html


def test_the_recommender_form_picks_the_known_best_drafter(client, pays_board):
    url = reverse("protocol_pays", args=["pays", 1])
    chat = client.get(url, {"w_chat": "1", "w_code": "0", "batch_size": "2"})
    rec = chat.context["rec"]
    assert rec["best"]["drafter"]["slug"] == "pays-draft" and rec["best"]["k"] == K
    assert 'id="recommendation"' in chat.content.decode()
    code = client.get(url, {"w_chat": "0", "w_code": "1", "batch_size": "3"})
    assert code.context["rec"]["batch_size"] == 2       # nearest measured
    assert code.context["rec"]["best"]["drafter"]["slug"] == "pays-ngram"
    big = client.get(url, {"w_chat": "1", "w_code": "1", "batch_size": "8"}).context["rec"]
    assert big["best"]["drafter"] is None               # nothing pays at b=8
    bad = client.get(url, {"w_chat": "-1", "w_code": "0", "batch_size": "2"})
    assert bad.status_code == 200 and bad.context["rec_error"]


def test_the_drafter_page_shows_its_breakdown_bounds_and_crossover(
        client, pays_board, django_assert_max_num_queries):
    with django_assert_max_num_queries(8):
        response = client.get(reverse("drafter", args=["pays-draft"]))
    html = response.content.decode()
    assert 'id="pays"' in html and 'id="fig-pays_bounds"' in html and 'id="pays-cells"' in html
    from leaderboard import pays

    cells = {(a["task"], a["batch_size"]): a
             for a in pays.drafter_analysis(response.context["page"])["cells"]}
    assert cells[("chat", 2)]["predicted_speedup"] == pytest.approx(good_predicted(2, DRAFT_COST))


def test_the_analysis_api_returns_the_page_figures(client, pays_board):
    response = client.get("/api/protocols/pays/1/analysis")
    assert response.status_code == 200
    body = response.json()
    assert body["temperature"] == 0.0 and body["has_records"]
    assert [r["task"] for r in body["matrix"]] == ["chat", "code"]
    assert body["matrix"][0]["cells"][0]["drafter"]["slug"] == "pays-draft"
    curve = next(c for c in body["curves"] if c["drafter"]["slug"] == "pays-draft")
    assert curve["crossover"]["measured"] == 8
    assert [d[0] for d in body["definitions"]][:2] == ["Decode steps of a request",
                                                        "Cost model (vLLM runs)"]
    assert "Break-even map" in [d[0] for d in body["definitions"]]
    # the map and the per-user chart's figures, as the page shows them
    chat = next(t for t in body["map"]["tasks"] if t["task"] == "chat")
    point = next(p for p in chat["points"]
                 if p["drafter"]["slug"] == "pays-draft" and p["batch_size"] == 2)
    assert point["break_even_tokens_per_step"] == pytest.approx(
        (DRAFT_COST + t_fwd(2 * (1 + 5 / 6 * K))) / t_fwd(2))
    line = next(x for x in body["operating"]["baselines"] if x["task"] == "chat")
    assert [p["batch_size"] for p in line["points"]] == list(SIZES)
    assert client.get("/api/protocols/pays/9/analysis").status_code == 404
    assert client.get("/api/protocols/pays/1/analysis", {"temperature": 0.7}).status_code == 422


def test_the_recommend_api_picks_the_known_best_and_refuses_a_bad_mix(client, pays_board):
    ok = client.get("/api/recommend", {"protocol": "pays@1", "batch_size": 1,
                                       "mix": "chat:0.95,code:0.05"})
    assert ok.status_code == 200
    body = ok.json()
    assert body["best"]["drafter"]["slug"] == "pays-draft" and body["batch_size"] == 1
    assert [m["weight"] for m in body["mix"]] == pytest.approx([0.95, 0.05])
    options = {(o["drafter"] or {}).get("slug"): o for o in body["options"]}
    assert options[None]["speedup"] == 1.0
    best = body["best"]
    assert best["speedup_min"] <= best["speedup"] <= best["speedup_max"]
    code = client.get("/api/recommend", {"protocol": "pays", "batch_size": 1, "mix": "code:1"})
    assert code.json()["best"]["drafter"]["slug"] == "pays-ngram"
    for mix in ("poetry:1", "chat:x", "chat:0"):
        bad = client.get("/api/recommend", {"protocol": "pays@1", "batch_size": 1, "mix": mix})
        assert bad.status_code == 422 and bad.json()["detail"][0]["field"] == "mix", mix
    assert client.get("/api/recommend", {"protocol": "nope", "batch_size": 1}).status_code == 404


def test_the_results_export_carries_the_analysis_columns(client, pays_board):
    from leaderboard.selectors import results

    response = client.get("/api/results", {"protocol": "pays@1", "format": "csv"})
    reader = csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode()))
    assert reader.fieldnames == list(results.RESULT_COLUMNS)
    rows = list(reader)
    row = next(r for r in rows if r["drafter"] == "pays-draft" and r["task"] == "chat"
               and r["batch_size"] == "2")
    assert float(row["predicted_speedup"]) == pytest.approx(good_predicted(2, DRAFT_COST))
    assert float(row["oracle_speedup"]) == pytest.approx(good_oracle(2))
    assert float(row["engine_efficiency"]) == pytest.approx(
        float(row["speedup"]) / float(row["predicted_speedup"]))
    shares = [float(row[c]) for c in ("prefill_share", "verification_share",
                                      "drafting_other_share")]
    assert sum(shares) == pytest.approx(1.0)
    assert all(r["predicted_speedup"] == "" for r in rows if r["method"] == "baseline")
    page = client.get("/api/results", {"protocol": "pays@1", "drafter": "pays-draft"}).json()
    first = page["items"][0]
    assert first["oracle_speedup"] is not None and first["tokens_per_step"] is not None


def test_the_analysis_is_cached_under_the_finished_runs_and_follows_a_new_run(
        client, pays_board, settings, media, django_assert_max_num_queries):
    import shutil

    from django.core.cache import cache

    from . import factories as f

    settings.SPECBOARD_PAGE_CACHE_SECONDS = 60
    cache.clear()
    url = "/api/protocols/pays/1/analysis"
    first = client.get(url).json()
    assert first["has_records"]
    # the records are not read again: the figures stay when the files are gone
    shutil.rmtree(media / "runs")
    with django_assert_max_num_queries(2):   # the protocol, the succeeded runs
        assert client.get(url).json() == first
    # a new succeeded run changes the key: its drafter shows up (without records here)
    late = f.make_drafter(pays_board["protocol"].target, "Late comer")
    f.make_run(pays_board["protocol"], late)
    again = client.get(url).json()
    assert "late-comer" in [d["drafter"]["slug"] for d in again["drafters"]]
    assert not again["has_records"]
    cache.clear()


def two_repetitions(records, differ_in, offset=1000):
    """The records of a cell measured twice: repetition 0 as given, repetition 1 the same
    but, where `differ_in` says, with a different last token. Repetition 1 is written
    first, so neither the first nor the last record of a prompt is repetition 0."""
    second = []
    for r in records:
        out = list(r["output_token_ids"])
        if 1 in differ_in:
            out[-1] += offset
        second.append({**r, "repetition": 1, "output_token_ids": out})
    first = [{**r, "repetition": 0, "output_token_ids": list(r["output_token_ids"])
              [:-1] + [r["output_token_ids"][-1] + (2000 if 0 in differ_in else 0)]}
             for r in records]
    return second + first + [dict(x) for x in second]


def test_the_lossless_share_compares_repetition_zero_in_every_caller(media):
    """metrics.lossless_outputs is the rule; records.outputs, the run service's
    divide_by_baseline (through the records in storage) and the oracle combination's
    reference all take repetition 0. Fails if a caller takes the first or last record."""
    from leaderboard import pays, records
    from leaderboard.models import Result
    from leaderboard.services import runs
    from worker.protocol import Cell

    from . import factories as f

    base_recs = baseline_cells(sizes=(2,))[0]["records"]
    # the drafter's repetition 0 equals the baseline's; its repetition 1 does not
    same0 = two_repetitions(drafter_cells(GOOD, 0.001, sizes=(2,))[0]["records"], {1})
    # the drafter's repetition 0 differs; its repetition 1 equals the baseline's
    diff0 = two_repetitions(drafter_cells(GOOD, 0.001, sizes=(2,))[0]["records"], {0})
    assert metrics.lossless_outputs(same0) == {r["prompt_id"]: r["output_token_ids"]
                                               for r in base_recs}
    assert records.outputs(same0) == metrics.lossless_outputs(same0)
    assert metrics.lossless_share(records.outputs(same0), records.outputs(base_recs)) == 1.0
    assert metrics.lossless_share(records.outputs(diff0), records.outputs(base_recs)) == 0.0

    target = f.make_target(slug="lossless-target")
    protocol = f.make_protocol(target, slug="lossless", hardware="lossless-hw",
                               tasks=("chat",), batch_sizes=(2,), ks=(K,))
    base_run = f.make_run(protocol)
    # the baseline was measured twice too; its repetition 1 differs from everything
    base_two = two_repetitions(base_recs, {1}, offset=3000)
    cell = Cell("chat", 2, 0.0, 0)
    records.write_cell(base_run.pk, cell, base_two)
    base_cell = baseline_cells(sizes=(2,))[0]
    figures = {k: v for k, v in base_cell.items()
               if k not in ("task", "batch_size", "temperature", "k", "records")}
    Result.objects.create(run=base_run, task="chat", batch_size=2, temperature=0.0, k=0,
                          **figures)
    for name, recs, expected in (("Same first", same0, 1.0), ("Differs first", diff0, 0.0),
                                 ("Same first too", same0, 1.0)):
        run = f.make_run(protocol, f.make_drafter(target, name, method="draft_model"))
        dcell = Cell("chat", 2, 0.0, K)
        records.write_cell(run.pk, dcell, recs)
        run.artifact = records.write_artifact(run.pk, [recs])
        run.save(update_fields=["artifact"])
        result = Result.objects.create(run=run, task="chat", batch_size=2, temperature=0.0,
                                       k=K, **figures)
        assert runs.divide_by_baseline(result, records.RunRecords(run.pk).outputs(dcell))
        result.refresh_from_db()
        assert result.lossless_share == expected, name
    # the oracle combination takes the baseline's repetition 0 as the reference: the two
    # "Same first" drafters match it on p1 and p2 of their repetition 0 (the baseline's
    # repetition 1 would match no request, and the combination would be empty)
    data = pays.protocol_pays(protocol)
    combine = {(c["task"], c["batch_size"]): c for c in data["combine"]}
    assert combine[("chat", 2)]["requests"] == 2


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)
def test_the_pays_page_draws_its_charts_in_a_browser(live_server, pays_board, artifacts_dir,
                                                     monkeypatch):
    """Headless Chromium, under the site's Content-Security-Policy: the page's figures are
    drawn by the local plotly.js without a script error, and the recommender form answers."""
    from .conftest import chromium_page

    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    errors = []
    with chromium_page(bypass_csp=False) as page:
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(live_server.url + reverse("protocol_pays", args=["pays", 1]))
        # bounds, matrix, breakdown, Pareto, a map and a per-user chart per task
        page.wait_for_function(
            "document.querySelectorAll('div.chart .main-svg').length >= 8")
        for chart in ("map_0", "map_1", "operating_0", "operating_1"):
            assert page.locator(f"#chart-{chart} .main-svg").count() >= 1, chart
        # the measured markers are drawn (scatter points), not only the curves
        assert page.locator("#chart-map_0 .scatterlayer .point").count() >= 6
        page.fill("input[name=w_chat]", "0")
        page.fill("input[name=batch_size]", "1")
        page.click("#recommend-form button[type=submit]")
        page.wait_for_selector("#recommendation")
        assert "Pays ngram" in page.inner_text("#recommendation")
        page.screenshot(path=str(artifacts_dir / "pays.png"), full_page=True)
        page.goto(live_server.url + reverse("drafter", args=["pays-draft"]))
        page.wait_for_selector("#chart-pays_bounds .main-svg")
        page.wait_for_selector("#chart-operating .main-svg")
    assert errors == []
