"""The reference engine: its Llama forward against transformers, lossless greedy speculative
decoding (ngram, draft model; batch 1 and 4), per-sequence stops in a batch, KV rollback,
the packed (fused, oneDNN) projections against the plain ones, the output distribution of
speculative sampling, the step trace's time breakdown, the CLI.

Costly pieces (the demo target, transformers' model, the batch-1 baselines) are module
fixtures built once. The sampling test uses a tiny random Llama so thousands of runs are cheap.
"""
import argparse
import json
import math
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from worker import generate as generate_cli
from worker import metrics, traces
from worker.engines.reference import ReferenceEngine, StepTrace
from worker.llama import Llama, PackedLinear
from worker.methods import make_proposer
from worker.proposers import DraftModelProposer, NgramProposer

NEW_TOKENS = 16
PROMPTS = [
    "Compose an engaging travel blog post about a recent trip to Hawaii.",
    "What is 2+2?",
    "Write a Python function that returns the n-th Fibonacci number, then explain how it works "
    "and what its time complexity is, step by step.",
    "Name three primary colors. Then name them again.",
]


# One torch thread for every test of this module (conftest.one_torch_thread).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hf_model(demo_target_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(demo_target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(engine):
    return [engine.encode_chat(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def plain_outputs(engine, prompt_ids):
    """Each prompt's plain greedy output, decoded alone (batch 1)."""
    return [engine.generate([ids], max_new_tokens=NEW_TOKENS)[0].output_ids for ids in prompt_ids]


def first_layers_draft(target_dir: Path, out: Path, num_layers=2) -> Path:
    """A draft model sharing the target's tokenizer: its first layers, norm and head."""
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((target_dir / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config))
    with safe_open(str(target_dir / "model.safetensors"), "pt") as f:
        weights = {name: f.get_tensor(name) for name in f.keys()
                   if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers}
    save_file(weights, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def draft_dir(demo_target_dir, tmp_path_factory):
    return first_layers_draft(Path(demo_target_dir), tmp_path_factory.mktemp("draft"))


@pytest.fixture(scope="module")
def proposers(draft_dir):
    return {"ngram": make_proposer("ngram", prompt_lookup_min=1, prompt_lookup_max=3),
            "draft_model": make_proposer("draft_model", str(draft_dir))}


def test_logits_equal_transformers(engine, hf_model, prompt_ids):
    # Two prompts of different lengths in one right-padded forward: each row's logits must
    # equal transformers' for that prompt alone.
    short, long = prompt_ids[1], prompt_ids[2]
    cache = engine.model.new_cache(2, len(long))
    pad = [0] * (len(long) - len(short))
    ours = engine.model(torch.tensor([short + pad, long]), cache)
    with torch.no_grad():
        for row, ids in enumerate([short, long]):
            theirs = hf_model(torch.tensor([ids])).logits[0]
            torch.testing.assert_close(ours[row, :len(ids)], theirs, atol=1e-3, rtol=1e-4)


def test_plain_greedy_equals_transformers_generate(hf_model, prompt_ids, plain_outputs):
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids[0]]), max_new_tokens=NEW_TOKENS,
                                do_sample=False, pad_token_id=2)
    assert plain_outputs[0] == out[0, len(prompt_ids[0]):].tolist()


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_greedy_equals_plain_greedy(engine, proposers, prompt_ids, plain_outputs,
                                                method, batch):
    results = engine.generate(prompt_ids[:batch], proposer=proposers[method], k=4,
                              max_new_tokens=NEW_TOKENS)
    assert [r.output_ids for r in results] == plain_outputs[:batch]
    assert traces.spec_counts(results).drafts > 0
    for r in results:  # the trace tells the whole output
        assert [t for s in r.steps for t in s.emitted] == r.output_ids


@pytest.mark.parametrize("method", [None, "draft_model"])
def test_batch_with_different_lengths_and_stops_equals_each_batch1_run(
        engine, proposers, prompt_ids, plain_outputs, method):
    # Sequence 1 meets an EOS early (its 4th token is declared one), 2 and 3 run out of
    # budget at different steps, 0 runs to the full budget unless it meets the EOS too.
    eos = {plain_outputs[1][3]}
    budgets = [NEW_TOKENS, NEW_TOKENS, 10, 5]
    results = engine.generate(prompt_ids, proposer=proposers.get(method), k=4,
                              max_new_tokens=budgets, eos_ids=eos)
    for i, r in enumerate(results):
        # A greedy batch-1 run with this EOS and budget stops at the first EOS or the budget;
        # greedy decoding is prefix-deterministic, so that run is the truncated plain output.
        expected = metrics.truncate_at_eos(plain_outputs[i], eos)[:budgets[i]]
        assert r.output_ids == expected, f"sequence {i}"
        assert [t for s in r.steps for t in s.emitted] == r.output_ids
    assert results[1].finish_reason == "eos" and results[1].output_ids[-1] in eos
    assert len(results[1].output_ids) <= 4
    assert len({len(r.steps) for r in results}) > 1  # they did stop at different steps


def test_kv_cache_rollback_gives_from_scratch_logits(engine, prompt_ids):
    model = engine.model
    prompts = [prompt_ids[1], prompt_ids[0]]
    cache = model.new_cache(2, 128)
    width = max(map(len, prompts))
    model(torch.tensor([p + [0] * (width - len(p)) for p in prompts]), cache)
    cache.lengths[:] = torch.tensor([len(p) for p in prompts])
    # A verification step: each row feeds a token and three drafts, then keeps a different
    # prefix (row 0 rejects the first draft, row 1 accepts two), as after a rejection.
    fed = [[100, 200, 300, 400], [500, 600, 700, 800]]
    model(torch.tensor(fed), cache)
    kept = [fed[0][:1], fed[1][:3]]
    for row, tokens in enumerate(kept):
        cache.rollback(row, len(prompts[row]) + len(tokens))
    following = [[11], [22]]
    logits = model(torch.tensor(following), cache)[:, 0]
    for row in range(2):
        full = prompts[row] + kept[row] + following[row]
        scratch = model(torch.tensor([full]), model.new_cache(1, len(full)))[0, -1]
        torch.testing.assert_close(logits[row], scratch, atol=1e-4, rtol=1e-4)


def test_draft_model_cache_rolls_back_to_what_the_target_kept(draft_dir, prompt_ids):
    class Target:  # the proposer asks the engine only for the target's vocabulary
        config = argparse.Namespace(vocab_size=49152)

    def fresh_proposer():
        p = DraftModelProposer(draft_dir)
        p.start(Target, 1, 128, temperature=1.0)
        return p

    proposer = fresh_proposer()
    context = prompt_ids[1]
    first = proposer.propose([0], [context], [3], [torch.Generator().manual_seed(1)])[0]
    # The target kept the first draft and corrected the second: the draft's cache must drop
    # drafts 2 and 3 and continue exactly as a draft model that never saw them.
    rejected = first.tokens[1]
    context = context + [first.tokens[0], (rejected + 1) % 49152]
    after = proposer.propose([0], [context], [3], [torch.Generator().manual_seed(2)])[0]
    scratch = fresh_proposer().propose([0], [context], [3], [torch.Generator().manual_seed(2)])[0]
    assert after.tokens == scratch.tokens
    torch.testing.assert_close(after.probs, scratch.probs, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("in_features", [576, 1536])
def test_packed_linear_rows_do_not_depend_on_how_many_are_computed(in_features):
    # Fused projections equal the separate ones; with oneDNN, a row's result is the same bits
    # whether 1 or 9 rows are computed, so plain decoding (one row) and verification (k + 1
    # rows) see identical projections. 1536 inputs is the MLP's down projection, where
    # oneDNN's own one-row kernel would sum in another order.
    torch.manual_seed(0)
    first, second = torch.nn.Linear(in_features, 576), torch.nn.Linear(in_features, 192)
    packed = PackedLinear(first, second)
    x = torch.randn(9, in_features)
    with torch.inference_mode():
        full = packed(x)
        torch.testing.assert_close(full, torch.cat([first(x), second(x)], dim=-1),
                                   atol=1e-4, rtol=1e-4)
        assert packed(x.view(3, 3, in_features)).shape == (3, 3, 768)
        if packed.onednn:
            for rows in range(1, 9):
                assert torch.equal(packed(x[:rows]), full[:rows]), f"{rows} rows"


# ----------------------------------------------------------------------------- tiny models

def save_tiny_llama(folder: Path, seed: int, noisy_copy_of: Path | None = None, noise=0.0):
    """A random Llama (vocab 16, 2 layers, hidden 32) saved as config.json + safetensors.
    A large init range makes its next-token distributions peaked and far from uniform.
    With ``noisy_copy_of``: that model's weights plus Gaussian noise (a draft that agrees
    with its target often, not always)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.3, tie_word_embeddings=False, eos_token_id=None,
                         bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config)
    if noisy_copy_of is not None:
        with safe_open(str(noisy_copy_of / "model.safetensors"), "pt") as f:
            source = {name: f.get_tensor(name) for name in f.keys()}
        state = model.state_dict()
        model.load_state_dict({name: source[name] + noise * torch.randn_like(state[name])
                               for name in source}, strict=False)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    target = save_tiny_llama(root / "target", seed=0)
    draft = save_tiny_llama(root / "draft", seed=1, noisy_copy_of=target, noise=0.15)
    return ReferenceEngine(target), draft


def test_tiny_speculative_greedy_equals_plain_with_partial_acceptance(tiny):
    engine, draft_dir = tiny
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10], [11, 12, 13, 14]]
    budgets = [40, 33, 17, 40]
    plain = [engine.generate([p], max_new_tokens=m, eos_ids=[])[0].output_ids
             for p, m in zip(prompts, budgets)]
    results = engine.generate(prompts, proposer=make_proposer("draft_model", str(draft_dir)), k=3,
                              max_new_tokens=budgets, eos_ids=[])
    assert [r.output_ids for r in results] == plain
    spans = traces.accepted_span_lengths(results[0]) | traces.accepted_span_lengths(results[3])
    # Rejections at the first draft, in the middle, and full acceptance all happened.
    assert {0, 1, 3} <= set(spans)


def test_packed_model_equals_unpacked_model_through_rollback(tiny):
    # The same weights without packing (separate projections, F.linear): a right-padded
    # batch of different lengths, a verification step whose rows keep different prefixes,
    # then one more token each; every logit agrees.
    engine, _ = tiny
    packed = engine.model
    plain = Llama(packed.config)
    plain.load_state_dict(packed.state_dict())
    plain.eval()
    assert plain.layers[0].self_attn.packed_qkv is None and packed.packed_lm_head is not None
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10], [11, 12, 13, 14]]
    width = max(map(len, prompts))
    fed = torch.tensor([[2, 3, 4, 5], [6, 7, 8, 9], [1, 1, 1, 1], [15, 14, 13, 12]])
    kept = [1, 4, 2, 3]
    outputs = []
    for model in (packed, plain):
        cache = model.new_cache(4, 32)
        first = model(torch.tensor([p + [0] * (width - len(p)) for p in prompts]), cache)
        cache.lengths[:] = torch.tensor([len(p) for p in prompts])
        verify = model(fed, cache)
        for row, n in enumerate(kept):
            cache.rollback(row, len(prompts[row]) + n)
        following = model(torch.tensor([[3], [2], [1], [0]]), cache)
        single = model(torch.tensor([[5]]), cache, rows=torch.tensor([2]))  # one row, one token
        outputs.append((first, verify, following, single))
    for ours, theirs in zip(*outputs):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def chi_square_critical_value(df: int, z: float) -> float:
    """Upper quantile of the chi-square distribution by the Wilson-Hilferty approximation,
    chi2 ~ df * (1 - 2/(9 df) + z sqrt(2/(9 df)))^3, with z the standard normal quantile.
    At the 0.999 quantile it errs by +1.2% at df 5 and under +0.6% from df 10 on (df 15:
    37.84 against the exact 37.70), slightly conservative and far below what a broken
    sampler adds to the statistic (several times the critical value)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: dict, expected_probs: dict, n: int):
    """Pearson's statistic over cells with an expected count >= 5; the others are pooled
    into one cell (the usual validity rule). Returns (statistic, degrees of freedom)."""
    big = {cell for cell, p in expected_probs.items() if p * n >= 5}
    observed = [counts.get(cell, 0) for cell in big]
    expected = [expected_probs[cell] * n for cell in big]
    rest_expected = n - sum(expected)
    if rest_expected > 1e-9:
        observed.append(n - sum(observed))
        expected.append(rest_expected)
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    return statistic, len(expected) - 1


def exact_joint(model: Llama, prompt: list[int], length: int, temperature: float):
    """P(t1..t_length | prompt) under the target, for every continuation (16^length of them)."""
    vocab = model.config.vocab_size
    joint = torch.ones(1)
    prefixes = torch.tensor([prompt])
    for _ in range(length):
        cache = model.new_cache(len(prefixes), prefixes.shape[1])
        logits = model(prefixes, cache)[:, -1]
        step = torch.softmax(logits.double() / temperature, dim=-1)  # [prefixes, vocab]
        joint = (joint[:, None] * step).reshape(-1)
        prefixes = torch.cat([prefixes.repeat_interleave(vocab, 0),
                              torch.arange(vocab).repeat(len(prefixes))[:, None]], dim=1)
    return joint.reshape([vocab] * length)


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_speculative_sampling_matches_target_distribution(tiny, method):
    engine, draft_dir = tiny
    temperature, runs, new_tokens = 0.8, 2500, 4
    if method == "draft_model":
        prompt, proposer = [3, 1, 4, 1, 5], make_proposer("draft_model", str(draft_dir))
    else:  # the prompt is the target's own greedy text, so lookups are often plausible
        prompt = [3] + engine.generate([[3]], max_new_tokens=40, eos_ids=[])[0].output_ids
        proposer = make_proposer("ngram", prompt_lookup_min=1, prompt_lookup_max=2)
    # Sequence i samples with seed i: one batch of `runs` sequences is `runs` seeded runs.
    results = engine.generate([prompt] * runs, proposer=proposer, k=3, max_new_tokens=new_tokens,
                              temperature=temperature, seed=0, eos_ids=[])
    outputs = [tuple(r.output_ids) for r in results]
    assert all(len(o) == new_tokens for o in outputs)
    counts = traces.spec_counts(results)
    # Both branches of the sampler ran often: acceptance, and rejection with resampling.
    rejections = sum(1 for r in results for s in r.steps if s.accepted < len(s.drafted))
    assert counts.accepted_tokens > 300 and rejections > 300

    joint = exact_joint(engine.model, prompt, new_tokens, temperature)
    z = 3.0902  # standard normal 0.999 quantile: each check fails by chance once in 1000
    # The first token comes from the prefill; tokens 2 and 3 (jointly) and 4 come out of
    # verification: accepted drafts, resampled corrections and bonus tokens.
    pair = joint.sum(dim=(0, 3))
    checks = {
        "tokens 2 and 3": ({(a, b): float(pair[a, b]) for a in range(16) for b in range(16)},
                           lambda o: (o[1], o[2])),
        "token 4": ({a: float(p) for a, p in enumerate(joint.sum(dim=(0, 1, 2)))},
                    lambda o: o[3]),
    }
    for name, (probs, cell_of) in checks.items():
        observed = {}
        for o in outputs:
            observed[cell_of(o)] = observed.get(cell_of(o), 0) + 1
        statistic, df = chi_square(observed, probs, runs)
        assert df >= 5
        critical = chi_square_critical_value(df, z)
        assert statistic < critical, f"{name}: chi2 {statistic:.1f} >= {critical:.1f} (df {df})"


def test_chi_square_critical_value_matches_tables():
    # Published 0.999 quantiles (e.g. NIST/SEMATECH e-Handbook, table 1.3.6.7.4).
    for df, exact in [(5, 20.515), (10, 29.588), (15, 37.697), (30, 59.703), (100, 149.449)]:
        assert abs(chi_square_critical_value(df, 3.0902) - exact) / exact < 0.015


# ----------------------------------------------------------------------------- traces, CLI

def test_trace_time_breakdown_adds_up_to_wall_time(engine, proposers, prompt_ids):
    seen = []
    started = time.perf_counter()
    results = engine.generate(prompt_ids[:2], proposer=proposers["ngram"], k=4, max_new_tokens=8,
                              on_step=seen.append)
    wall = time.perf_counter() - started
    assert len(seen) == sum(len(r.steps) for r in results)
    for r in results:
        t = r.timings
        parts = t["drafting"] + t["verification"] + t["sampling"] + t["other"]
        assert abs(parts - t["wall"]) <= 0.02 * t["wall"]
        assert t["verification"] > 0 and t["sampling"] > 0 and t["drafting"] > 0
    breakdown = traces.time_breakdown(results)
    assert abs(breakdown["wall"] - wall) <= 0.02 * wall
    assert abs(max(r.timings["wall"] for r in results) - wall) <= 0.02 * wall
    assert abs(sum(breakdown["shares"].values()) - 1) < 1e-9


def test_trace_analyses_agree_with_the_metric_definitions():
    def step(n, drafted, accepted):
        return StepTrace(step=n, seq=0, drafted=drafted, accepted=accepted, bonus=7,
                         emitted=drafted[:accepted] + [7], times={})

    class Result:
        steps = [step(0, [], 0), step(1, [1, 2, 3], 3), step(2, [1, 2, 3], 1),
                 step(3, [1, 2, 3], 0), step(4, [1], 1)]

    assert traces.accepted_span_lengths(Result) == {0: 1, 1: 2, 3: 1}
    counts = traces.spec_counts([Result], k=3)
    assert (counts.drafts, counts.draft_tokens, counts.accepted_tokens) == (4, 10, 5)
    assert counts.accepted_at == [3, 1, 1]
    assert traces.per_position_acceptance([Result], k=3) == [0.75, 0.25, 0.25]
    assert traces.acceptance_length([Result]) == 1 + 5 / 4
    # the one SpecCounts-from-steps (the vLLM records and the demo use it too): a step that
    # drafted nothing is no draft; without k, accepted_at is as long as the longest draft
    assert metrics.counts_from_steps([0, 3, 1, 0, 1], [0, 3, 3, 3, 1], 3) == counts
    assert metrics.counts_from_steps([2, 0], [2, 0]) == metrics.SpecCounts(1, 2, 2, [1, 1])


def test_ngram_proposer_prefers_the_longest_match():
    proposer = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    # "5 6" occurs once followed by 7 8 9; the lone 6 occurs earlier followed by 1.
    assert proposer.lookup([6, 1, 5, 6, 7, 8, 9, 5, 6], 3) == [7, 8, 9]
    assert proposer.lookup([1, 2, 3], 3) == []


def test_cli_prints_json_with_output_ids(engine, demo_target_dir, capsys, monkeypatch):
    # The CLI builds its engine from --target; hand it the loaded one to spare a reload.
    monkeypatch.setattr("worker.engines.reference.ReferenceEngine", lambda *a, **kw: engine)
    parser = argparse.ArgumentParser()
    generate_cli.add_cli_arguments(parser)
    args = parser.parse_args(["--target", str(demo_target_dir), "--drafter", "ngram", "--k", "3",
                              "--prompt", "Say hello.", "--max-new-tokens", "6",
                              "--temperature", "0", "--seed", "1", "--json"])
    assert generate_cli.cli(args) == 0
    report = json.loads(capsys.readouterr().out)
    sequence = report["sequences"][0]
    assert 1 <= len(sequence["output_ids"]) <= 6
    assert all(isinstance(t, int) for t in sequence["output_ids"])
    assert sequence["steps"][0]["step"] == 0 and "times" in sequence["steps"][0]
    assert isinstance(sequence["text"], str)


def test_the_reference_ngram_proposer_takes_ngrams_one_rule():
    from worker.methods import make_proposer
    from worker.methods.ngram import lookup_bounds

    for given in ({}, {"prompt_lookup_max": 3}, {"prompt_lookup_min": 2, "prompt_lookup_max": 4}):
        bounds, _ = lookup_bounds(given)
        proposer = make_proposer("ngram", **given)
        assert (proposer.min_n, proposer.max_n) == (bounds["prompt_lookup_min"],
                                                     bounds["prompt_lookup_max"])
    with pytest.raises(ValueError, match="larger than prompt_lookup_max"):
        make_proposer("ngram", prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="from 1 to 16"):
        make_proposer("ngram", prompt_lookup_min=0, prompt_lookup_max=2)
