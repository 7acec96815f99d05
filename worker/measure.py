"""Measure a drafter (or the baseline) under a protocol on vLLM: the cells of the grid
(task x temperature x batch size x k), each with the figures of worker.metrics, the output
tokens and the raw per-request records.

How a cell is measured
- One engine per speculation budget k (vLLM fixes num_speculative_tokens when it builds the
  engine), reused for every task, batch size and temperature with that k; the baseline has
  one engine. Cells are measured engine by engine: the k's in protocol order, and within
  one k in ``ProtocolSpec.cells`` order (``measurement_order`` gives that order).
  ``spec.warmup_requests`` requests, not counted, follow each engine start.
- Batch size b is a client-side concurrency limit over that one engine, as
  ``vllm bench serve --max-concurrency b``: an asyncio.Semaphore(b) keeps b requests in
  flight while b or more remain. The cell's wall time runs from its first submission to its
  last completion. TTFT and latency are client side, from a request's submission.
- Prompts: only the first user turn is sent (protocol multi_turn "first_turn"), through the
  target's chat template when ``spec.chat_template``; the token ids are sent to the engine.
- Sampling: temperature T, max_tokens = spec.max_new_tokens, the target's EOS ids stop a
  request. At T > 0 each request has its own seed, derived from spec.seed, the prompt id
  and the repetition (so a cell is reproducible and the same prompt gets the same seed at
  every batch size and k). At T = 0 decoding is greedy and no seed is needed.
- Repetitions: with spec.repetitions = r every prompt is sent r times within the cell (all
  r x N requests share the concurrency limit); counts, tokens and wall time are summed over
  all of them and latency percentiles are taken over all of them. ``outputs`` holds the
  first repetition's output per prompt.

Speculation counts
- vLLM's counters (``vllm:spec_decode_*``) are cumulative per engine: a cell's counts are
  the difference of snapshots taken before its first request and after its last.
- vLLM counts a verification step's accepted drafts before it cuts the output at EOS or
  max_tokens, so drafts accepted past the end of an output are in its counters. Tokens after
  the end are never counted here: from vLLM's per-request step records (accepted and
  drafted per verification step) and the tokens each engine step delivered, the last step
  of a request that was cut is reduced to the drafted tokens that were kept (all of them
  accepted), and the difference is taken off the cell's counts. ``CellResult.checks`` keeps
  vLLM's own difference and the size of that correction.
"""
from __future__ import annotations

import argparse
import asyncio
import gzip
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from worker import metrics
from worker.methods import (check_supported, speculative_config, validate_drafter_files)
from worker.metrics import SpecCounts
from worker.protocol import MULTI_TURN_FIRST_TURN, Cell, ProtocolSpec

FIGURE_KEYS = (
    "requests", "generated_tokens", "wall_seconds", "drafts", "draft_tokens",
    "accepted_tokens", "accepted_at", "acceptance_length", "acceptance_rate",
    "per_position_acceptance", "conditional_acceptance", "output_throughput",
    "ttft_mean", "ttft_p50", "ttft_p90", "ttft_p99",
    "tpot_mean", "tpot_p50", "tpot_p90", "tpot_p99",
)


@dataclass
class PromptItem:
    id: str            # prompt external id
    turns: list[str]   # user turns; multi_turn "first_turn" => only turns[0] is sent


@dataclass
class DrafterSpec:
    method: str        # baseline, ngram, draft_model, eagle, eagle3, medusa, mtp
    path: str | None = None
    params: dict = field(default_factory=dict)


@dataclass
class MeasureJob:
    spec: ProtocolSpec
    target_path: str
    drafter: DrafterSpec
    prompts: dict[str, list[PromptItem]]   # task name -> prompts (the protocol's first N)
    skip: frozenset = frozenset()          # Cell.key tuples already measured


@dataclass
class CellResult:
    cell: Cell
    figures: dict                   # exactly FIGURE_KEYS
    outputs: dict[str, list[int]]   # prompt id -> output token ids (cut after EOS)
    records: list[dict]             # raw per-request lines
    # Diagnostics, not figures: vLLM's own counter difference, the correction for tokens
    # past the end of outputs, the most requests seen in flight.
    checks: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- engine info

def _speculative_configs(job) -> dict:
    if job.drafter.method == "baseline":
        return {0: None}
    return {k: speculative_config(job.drafter, k) for k in job.spec.ks}


def engine_info(job) -> dict:
    """What the run records about its engine, without starting it."""
    from worker.engines import vllm_engine as ve

    versions = ve.package_versions()
    return {
        "engine": ve.ENGINE_NAME,
        "engine_version": versions["vllm"],
        "versions": versions,
        "hardware_description": ve.hardware_description(job.spec.hardware),
        "engine_args": ve.resolve_engine_args(job.spec, job.target_path),
        "engine_env": ve.engine_env(job.spec.hardware),
        "speculative_configs": {str(k): v for k, v in _speculative_configs(job).items()},
        "per_request_spec_decode_metrics": "none" if job.drafter.method == "baseline"
        else "detailed",
    }


def measurement_order(job) -> list[Cell]:
    """The cells iter_cells measures, in the order it yields them (skipped cells left out):
    grouped by k (one engine each), the protocol's cell order within a group."""
    with_drafter = job.drafter.method != "baseline"
    cells = [c for c in job.spec.cells(with_drafter=with_drafter) if c.key not in job.skip]
    ks = list(job.spec.ks) if with_drafter else [0]
    return sorted(cells, key=lambda c: ks.index(c.k))  # stable: keeps cells() order


# --------------------------------------------------------------------------- prompts

def load_tokenizer(target_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(target_path))


def render_prompt(tokenizer, item: PromptItem, chat_template: bool) -> list[int]:
    """Token ids of a prompt's first user turn, through the chat template if asked."""
    turn = item.turns[0]
    if chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the protocol applies the chat template, but the target's "
                             "tokenizer has none")
        text = tokenizer.apply_chat_template([{"role": "user", "content": turn}],
                                             add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(turn)["input_ids"])


def eos_token_ids(tokenizer, target_path) -> set[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = Path(target_path) / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(int(v) for v in (value if isinstance(value, list) else [value])
                   if v is not None)
    return ids


def request_seed(seed: int, prompt_id: str, repetition: int) -> int:
    """Per-request seed: a hash of the protocol seed, the prompt id and the repetition."""
    digest = hashlib.sha256(f"{seed}:{prompt_id}:{repetition}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


# --------------------------------------------------------------------------- counts

def request_spec_counts(spec_metrics: dict | None, step_tokens: list[int], output_len: int,
                        k: int):
    """A request's speculation counts as vLLM counted them (``raw``) and with the tokens
    past the end of its output left out (``kept``), plus the number of tokens cut.

    ``step_tokens`` are the tokens each engine step delivered (the first is the prefill's
    token); a verification step yields accepted + 1 tokens, a step without drafts yields 1.
    What the engine produced minus what the output holds is what vLLM cut from the last
    step. Returns (raw, kept, cut); cut is None when the records do not add up (then
    kept == raw)."""
    if not spec_metrics:
        empty = SpecCounts(0, 0, 0, [0] * k)
        return empty, empty, 0
    accepted = spec_metrics.get("per_step_accepted")
    drafted = spec_metrics.get("per_step_drafted")
    if accepted is None or drafted is None:
        if spec_metrics.get("num_spec_steps", 0) == 0:
            empty = SpecCounts(0, 0, 0, [0] * k)
            return empty, empty, 0
        hist = spec_metrics["acceptance_histogram"]
        raw = SpecCounts(sum(hist), spec_metrics["num_draft_tokens"],
                         sum(j * c for j, c in enumerate(hist)),
                         [sum(hist[i + 1:]) for i in range(k)])
        return raw, raw, None
    raw = metrics.counts_from_steps(accepted, drafted, k)
    if not step_tokens or sum(step_tokens) != output_len:
        return raw, raw, None
    non_spec_steps = len(step_tokens) - 1 - len(accepted)
    produced = 1 + sum(a + 1 for a in accepted) + non_spec_steps
    cut = produced - output_len
    if cut == 0:
        return raw, raw, 0
    if cut < 0 or non_spec_steps < 0 or not accepted:
        return raw, raw, None
    kept_last = accepted[-1] + 1 - cut
    if not 1 <= kept_last <= accepted[-1]:
        return raw, raw, None
    kept = metrics.counts_from_steps(accepted[:-1] + [kept_last],
                                     drafted[:-1] + [min(drafted[-1], kept_last)], k)
    return raw, kept, cut


def _counts_dict(c: SpecCounts) -> dict:
    return {"drafts": c.drafts, "draft_tokens": c.draft_tokens,
            "accepted_tokens": c.accepted_tokens, "accepted_at": list(c.accepted_at)}


def cell_figures(counts: SpecCounts, output_lengths: list[int], ttfts: list, latencies: list,
                 wall_seconds: float) -> dict:
    """The figures of a cell, every one from worker.metrics."""
    generated = sum(output_lengths)
    tpots = [metrics.tpot(lat, t, n) if t is not None else None
             for lat, t, n in zip(latencies, ttfts, output_lengths)]
    ttft_s, tpot_s = metrics.summary(ttfts), metrics.summary(tpots)
    figures = {
        "requests": len(output_lengths),
        "generated_tokens": generated,
        "wall_seconds": wall_seconds,
        **metrics.acceptance_figures(counts),
        "output_throughput": metrics.output_throughput(generated, wall_seconds),
        **{f"ttft_{q}": ttft_s[q] for q in ("mean", "p50", "p90", "p99")},
        **{f"tpot_{q}": tpot_s[q] for q in ("mean", "p50", "p90", "p99")},
    }
    assert tuple(figures) == FIGURE_KEYS
    return figures


# --------------------------------------------------------------------------- one cell

async def _run_concurrent(engine, requests, concurrency):
    """Send requests (prompt ids, sampling, request id) with at most `concurrency` in flight.
    Returns (results in request order, wall seconds, the most requests seen in flight)."""
    sem = asyncio.Semaphore(concurrency)
    state = {"in_flight": 0, "max": 0, "first": None, "last": None}

    async def one(prompt_ids, sampling, rid):
        async with sem:
            now = time.perf_counter()
            if state["first"] is None:
                state["first"] = now
            state["in_flight"] += 1
            state["max"] = max(state["max"], state["in_flight"])
            try:
                return await engine.generate(prompt_ids, sampling, rid)
            finally:
                state["in_flight"] -= 1
                state["last"] = time.perf_counter()

    results = await asyncio.gather(*(one(*r) for r in requests))
    return results, state["last"] - state["first"], state["max"]


async def measure_cell(engine, cell: Cell, spec: ProtocolSpec, prompts: list[PromptItem],
                       prompt_ids: dict[str, list[int]], eos_ids: set[int],
                       speculative: bool) -> CellResult:
    k = cell.k
    requests, meta = [], []
    for rep in range(spec.repetitions):
        for item in prompts:
            sampling = {"temperature": cell.temperature, "max_tokens": spec.max_new_tokens,
                        "n": 1}
            seed = None
            if cell.temperature > 0:
                seed = request_seed(spec.seed, item.id, rep)
                sampling["seed"] = seed
            rid = f"{cell.task}|b{cell.batch_size}|t{cell.temperature:g}|k{k}|{item.id}|r{rep}"
            requests.append((prompt_ids[item.id], sampling, rid))
            meta.append((item, rep, seed))

    before = engine.spec_counts() if speculative else SpecCounts()
    results, wall, max_in_flight = await _run_concurrent(engine, requests, cell.batch_size)
    counts = SpecCounts()
    if speculative:
        after = engine.spec_counts()
        for _ in range(20):   # the output handler records stats right after the outputs
            await asyncio.sleep(0.01)
            latest = engine.spec_counts()
            if latest == after:
                break
            after = latest
        counts = after - before
        counts.accepted_at = (list(counts.accepted_at) + [0] * k)[:k]

    records, outputs, lengths, ttfts, lats = [], {}, [], [], []
    raw_sum, kept_sum = SpecCounts(0, 0, 0, [0] * k), SpecCounts(0, 0, 0, [0] * k)
    cut_tokens, unmatched = 0, 0
    for (item, rep, seed), res in zip(meta, results):
        out = metrics.truncate_at_eos(res.output_token_ids, eos_ids)
        if rep == 0:
            outputs[item.id] = out
        lengths.append(len(out))
        ttfts.append(res.ttft)
        lats.append(res.latency)
        record = {
            "prompt_id": item.id, "task": cell.task, "batch_size": cell.batch_size,
            "temperature": cell.temperature, "k": k, "repetition": rep, "seed": seed,
            "output_token_ids": out, "prompt_tokens": res.prompt_tokens,
            "ttft": res.ttft, "latency": res.latency, "finish_reason": res.finish_reason,
            "tpot": metrics.tpot(res.latency, res.ttft, len(out)) if res.ttft else None,
        }
        if speculative:
            raw, kept, cut = request_spec_counts(res.spec_metrics, res.step_tokens,
                                                 len(res.output_token_ids), k)
            raw_sum, kept_sum = raw_sum + raw, kept_sum + kept
            if cut is None:
                unmatched += 1
            else:
                cut_tokens += cut
            record.update(_counts_dict(kept))
            record["cut_after_end"] = cut
            record["vllm_spec_decode"] = res.spec_metrics
            record["step_tokens"] = res.step_tokens
        records.append(record)

    checks = {"max_in_flight": max_in_flight, "concurrency": cell.batch_size}
    if speculative:
        correction = raw_sum - kept_sum
        checks.update({
            "engine_counters": _counts_dict(counts),
            "per_request_sum": _counts_dict(raw_sum),
            "engine_matches_requests": _counts_dict(counts) == _counts_dict(raw_sum),
            "tokens_cut_after_end": cut_tokens,
            "requests_without_step_match": unmatched,
            "correction": _counts_dict(correction),
        })
        counts = counts - correction
        counts.accepted_at = list(counts.accepted_at)[:k]
    figures = cell_figures(counts, lengths, ttfts, lats, wall)
    return CellResult(cell, figures, outputs, records, checks)


async def _warm_up(engine, spec, prompt_ids: list[list[int]], tag: str):
    if spec.warmup_requests <= 0 or not prompt_ids:
        return
    requests = [(prompt_ids[i % len(prompt_ids)],
                 {"temperature": 0.0, "max_tokens": spec.max_new_tokens, "n": 1},
                 f"warmup|{tag}|{i}") for i in range(spec.warmup_requests)]
    await _run_concurrent(engine, requests, max(spec.batch_sizes))


# --------------------------------------------------------------------------- the run

def validate_job(job: MeasureJob):
    spec = job.spec
    if spec.engine != "vllm":
        raise ValueError(f"this worker measures with vllm; the protocol asks for {spec.engine!r}")
    if spec.multi_turn != MULTI_TURN_FIRST_TURN:
        raise ValueError(f"multi_turn {spec.multi_turn!r} is not supported "
                         f"(only {MULTI_TURN_FIRST_TURN!r})")
    check_supported(job.drafter.method, spec.hardware)
    _speculative_configs(job)          # parameter errors before anything starts
    validate_drafter_files(job.drafter)
    for task in spec.tasks:
        items = job.prompts.get(task.task)
        if not items:
            raise ValueError(f"no prompts for task {task.task!r}")
        for item in items:
            if not item.turns:
                raise ValueError(f"prompt {item.id!r} of task {task.task!r} has no turns")


def iter_cells(job: MeasureJob, log=print) -> Iterator[CellResult | dict]:
    """Yield {"type": "started", **engine_info(job)}, then one CellResult per measured cell
    (measurement_order(job)). Owns the engines: one per k, shut down when done, on an
    exception, or when the generator is closed."""
    validate_job(job)
    info = engine_info(job)
    yield {"type": "started", **info}
    order = measurement_order(job)
    if not order:
        return

    from worker.engines.vllm_engine import VllmEngine

    spec = job.spec
    tokenizer = load_tokenizer(job.target_path)
    eos_ids = eos_token_ids(tokenizer, job.target_path)
    prompt_ids = {task: {item.id: render_prompt(tokenizer, item, spec.chat_template)
                         for item in items} for task, items in job.prompts.items()}
    warm_ids = [ids for task in spec.tasks for ids in prompt_ids[task.task].values()]
    speculative = job.drafter.method != "baseline"
    configs = _speculative_configs(job)
    engine_args = info["engine_args"]

    loop = asyncio.new_event_loop()
    engine = None
    total, done, t_start = len(order), 0, time.monotonic()
    try:
        groups = {}
        for cell in order:
            groups.setdefault(cell.k, []).append(cell)
        for k, cells in groups.items():
            what = f"{job.drafter.method} k={k}" if speculative else "baseline"
            log(f"starting vLLM for {what} ({len(cells)} cells) ...")
            t0 = time.monotonic()
            engine = VllmEngine(engine_args, configs[k], spec.hardware)
            loop.run_until_complete(engine.start())
            loop.run_until_complete(_warm_up(engine, spec, warm_ids, f"k{k}"))
            log(f"engine ready in {time.monotonic() - t0:.0f} s "
                f"({spec.warmup_requests} warm-up requests done)")
            for cell in cells:
                result = loop.run_until_complete(measure_cell(
                    engine, cell, spec, job.prompts[cell.task], prompt_ids[cell.task],
                    eos_ids, speculative))
                done += 1
                f = result.figures
                al = f["acceptance_length"]
                log(f"cell {done}/{total} {cell.task} b={cell.batch_size} "
                    f"T={cell.temperature:g} k={cell.k}: {f['generated_tokens']} tokens in "
                    f"{f['wall_seconds']:.1f} s ({f['output_throughput'] or 0:.1f} tok/s)"
                    + (f", AL {al:.2f}" if al is not None else ""))
                yield result
            engine.shutdown()
            engine = None
    finally:
        if engine is not None:
            try:
                engine.shutdown()
            except Exception as e:  # noqa: BLE001 - do not hide the original error
                log(f"engine shutdown failed: {e}")
        try:
            loop.run_until_complete(asyncio.sleep(0))
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        finally:
            loop.close()
        log(f"measured {done} of {total} cells in {time.monotonic() - t_start:.0f} s")


# --------------------------------------------------------------------------- protocol files

def select_prompts(parsed, task) -> list[PromptItem]:
    """The task's prompts: those of its categories (all if none), the first N in file order."""
    wanted = set(task.categories)
    chosen = [p for p in parsed.prompts if not wanted or p.category in wanted][: task.prompts]
    if len(chosen) < task.prompts:
        raise ValueError(f"task {task.task!r} needs {task.prompts} prompts; {parsed.path} has "
                         f"{len(chosen)}" + (f" in categories {sorted(wanted)}" if wanted else ""))
    return [PromptItem(p.external_id, list(p.turns)) for p in chosen]


def load_protocol_file(path):
    """A protocol file: ProtocolSpec.to_dict() plus ``"prompts": {task: {"path": FILE,
    "format": "spec-bench" | "mt-bench" | "humaneval"}}`` (paths relative to the protocol
    file). A task's prompt_set_sha256, when set, must match the file.
    Returns (spec, {task: [PromptItem]})."""
    from worker.prompts import parse_prompt_file

    path = Path(path)
    data = json.loads(path.read_text())
    sources = data.pop("prompts", None)
    if not isinstance(sources, dict):
        raise ValueError(f"{path}: needs a 'prompts' mapping task -> {{path, format}}")
    spec = ProtocolSpec.from_dict(data)
    prompts = {}
    for task in spec.tasks:
        src = sources.get(task.task)
        if not isinstance(src, dict) or "path" not in src or "format" not in src:
            raise ValueError(f"{path}: prompts for task {task.task!r} need 'path' and 'format'")
        file = Path(src["path"])
        file = file if file.is_absolute() else path.parent / file
        parsed = parse_prompt_file(file, src["format"])
        if task.prompt_set_sha256 and task.prompt_set_sha256 != parsed.sha256:
            raise ValueError(f"{file}: sha256 {parsed.sha256} differs from the protocol's "
                             f"{task.prompt_set_sha256} for task {task.task!r}")
        prompts[task.task] = select_prompts(parsed, task)
    return spec, prompts


# --------------------------------------------------------------------------- CLI

def add_cli_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("--target", required=True, help="target checkpoint folder")
    parser.add_argument("--drafter", required=True, metavar="METHOD[:DIR]",
                        help="baseline, ngram, or METHOD:DIR for a method with weights")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="drafter parameter (VALUE read as JSON if it parses)")
    parser.add_argument("--protocol", required=True, help="protocol JSON file")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--resume", action="store_true",
                        help="keep the cells already in OUT/cells.json and measure the rest")


def parse_drafter(text: str, params: list[str]) -> DrafterSpec:
    method, _, path = text.partition(":")
    parsed = {}
    for p in params:
        key, sep, value = p.partition("=")
        if not sep or not key:
            raise ValueError(f"--param must be KEY=VALUE, got {p!r}")
        try:
            parsed[key] = json.loads(value)
        except ValueError:
            parsed[key] = value
    return DrafterSpec(method, path or None, parsed)


def _cell_row(result: CellResult) -> dict:
    c = result.cell
    return {"task": c.task, "batch_size": c.batch_size, "temperature": c.temperature,
            "k": c.k, **result.figures}


def _write_json(path: Path, data):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _eta(seconds):
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s"


def cli(args) -> int:
    try:
        spec, prompts = load_protocol_file(args.protocol)
        drafter = parse_drafter(args.drafter, args.param)
    except (OSError, ValueError, TypeError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cells_path, requests_path = out / "cells.json", out / "requests.jsonl.gz"
    rows = []
    if args.resume and cells_path.is_file():
        rows = json.loads(cells_path.read_text())
    elif requests_path.exists():
        requests_path.unlink()
    skip = frozenset((r["task"], r["batch_size"], float(r["temperature"]), r["k"]) for r in rows)
    job = MeasureJob(spec, str(args.target), drafter, prompts, skip)
    try:
        total = len(measurement_order(job))
        done, t0 = 0, time.monotonic()
        for event in iter_cells(job, log=lambda m: print(f"  {m}", flush=True)):
            if isinstance(event, dict):
                _write_json(out / "run.json", {
                    "protocol": spec.to_dict(), "protocol_sha256": spec.sha256(),
                    "target": str(args.target), "drafter": drafter.__dict__, **event})
                print(f"measuring {total} cells with {event['engine']} "
                      f"{event['engine_version']} on {event['hardware_description']}",
                      flush=True)
                continue
            rows.append(_cell_row(event))
            _write_json(cells_path, rows)
            with gzip.open(requests_path, "at") as f:
                for r in event.records:
                    f.write(json.dumps(r) + "\n")
            done += 1
            elapsed = time.monotonic() - t0
            eta = elapsed / done * (total - done)
            c = event.cell
            print(f"[{done}/{total}] {c.task} b={c.batch_size} T={c.temperature:g} k={c.k} "
                  f"done; elapsed {_eta(elapsed)}, ETA {_eta(eta)}", flush=True)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"wrote {cells_path} ({len(rows)} cells) and {requests_path}", flush=True)
    return 0
