"""One cell of the grid: its passes on a running engine, and its figures from them.

A *pass* sends every prompt of the cell's task once, with at most b requests in flight
(b = the cell's batch size), on the engine of the cell's k. A cell with ``repetitions`` r is
measured in r passes (``worker.measure`` decides how passes of different cells interleave).
Its figures sum over its passes; latency percentiles are taken over all its requests;
``pass_throughputs`` keeps one throughput per pass.

Speculation counts
- Each engine keeps its own speculation counters (``VllmEngine.spec_counts``); a pass's
  counts are the difference of snapshots taken before its first request and after its last.
  Summed over passes they are the cell's *engine* counts: what vLLM counted, which includes
  drafts accepted past the end of an output (EOS or max_tokens). ``engine_acceptance_length``
  comes from them, as ``vllm bench serve`` prints it.
- Every other acceptance figure comes from vLLM's per-request step records (accepted and
  drafted per verification step) and the tokens each engine step delivered, cut by the one
  end-of-output rule, ``worker.metrics.end_corrected_steps``. The sum of the uncorrected
  per-request counts must equal the engine counts (``checks.engine_matches_requests``).
"""
from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field, replace

from worker import metrics
from worker.metrics import SpecCounts
from worker.protocol import Cell, ProtocolSpec

FIGURE_KEYS = (
    "requests", "generated_tokens", "wall_seconds", "drafts", "draft_tokens",
    "accepted_tokens", "accepted_at", "acceptance_length", "acceptance_rate",
    "per_position_acceptance", "conditional_acceptance", "output_throughput",
    "ttft_mean", "ttft_p50", "ttft_p90", "ttft_p99",
    "tpot_mean", "tpot_p50", "tpot_p90", "tpot_p99",
    # protocol v2
    "repetitions", "decode_tokens", "decode_steps", "tokens_per_step",
    "engine_acceptance_length", "output_throughput_low", "output_throughput_high",
    "acceptance_length_low", "acceptance_length_high", "pass_throughputs",
    "host_load", "loaded",
    # protocol v3: why the group stopped measuring passes (worker.measure.stop_reason:
    # "fixed", "target", "budget", "max") and how many of its passes were measured again
    # because the host was loaded (worker.measure.measure_group)
    "passes_stop", "remeasured_passes",
    # protocol v4: how many engine starts the cell's kept passes came from
    # (ProtocolSpec.engine_starts; a cell stored after an earlier start's round has fewer)
    "engine_starts",
)


@dataclass
class PromptItem:
    id: str            # prompt external id
    turns: list[str]   # user turns; multi_turn "first_turn" => only turns[0] is sent


@dataclass
class CellResult:
    cell: Cell
    figures: dict                   # exactly FIGURE_KEYS
    outputs: dict[str, list[int]]   # prompt id -> output token ids of pass 0 (cut after EOS)
    records: list[dict]             # raw per-request lines, every pass
    # Self-checks: vLLM's own counter difference, the end correction, the most requests in
    # flight, prefix caching, and ``ok`` / ``failed`` (short reasons).
    checks: dict = field(default_factory=dict)


@dataclass
class PassResult:
    """One pass of one cell: the engine's results in request order."""
    repetition: int
    meta: list            # (PromptItem, seed) per request
    results: list         # RequestResult per request
    wall: float
    max_in_flight: int
    engine_counts: SpecCounts
    host_load: float | None = None          # others' cores over the whole machine
    engine_core_load: float | None = None   # others' cores on the engine's cores (or None)
    engine_cores: tuple[int, ...] | None = None
    engine_start: int = 0   # which of the run's engine starts (ProtocolSpec.engine_starts)

    @property
    def loaded(self) -> bool:
        """Measured under load (worker.hostload.is_loaded: either rule)."""
        from worker.hostload import is_loaded

        return is_loaded(self.host_load, self.engine_core_load)


def request_seed(seed: int, prompt_id: str, repetition: int) -> int:
    """Per-request seed: a hash of the protocol seed, the prompt id and the repetition."""
    digest = hashlib.sha256(f"{seed}:{prompt_id}:{repetition}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


# --------------------------------------------------------------------------- counts

@dataclass
class RequestCounts:
    raw: SpecCounts            # as vLLM counted the request's verification steps
    kept: SpecCounts           # after the end-of-output rule
    cut: int | None            # tokens vLLM counted past the end; None: records do not add up
    decode_steps: int          # engine steps after the prefill's (steps without drafts included)
    decode_tokens: int         # output tokens after the prefill's first token


def request_spec_counts(spec_metrics: dict | None, step_tokens: list[int], output_len: int,
                        k: int) -> RequestCounts:
    """A request's speculation counts as vLLM counted them (``raw``) and under the one
    end-of-output rule (``kept``, ``worker.metrics.end_corrected_steps``).

    ``step_tokens`` are the tokens each engine step delivered (the first is the prefill's
    token); ``output_len`` is the length of vLLM's output (already cut at EOS / max_tokens).
    vLLM's per-request records list the verification steps that drafted; the other decode
    steps (n-gram found no match) are placed among them by ``metrics.engine_decode_steps``.
    ``cut`` is None when the records do not line up (then kept == raw)."""
    empty = SpecCounts(0, 0, 0, [0] * k)
    decode_tokens = max(output_len - 1, 0)
    matched = bool(step_tokens) and sum(step_tokens) == output_len
    decode_steps = len(step_tokens) - 1 if matched else decode_tokens
    if not spec_metrics:
        return RequestCounts(empty, empty, 0, decode_steps, decode_tokens)
    accepted = spec_metrics.get("per_step_accepted")
    drafted = spec_metrics.get("per_step_drafted")
    if accepted is None or drafted is None:
        if spec_metrics.get("num_spec_steps", 0) == 0:
            return RequestCounts(empty, empty, 0, decode_steps, decode_tokens)
        hist = spec_metrics["acceptance_histogram"]
        raw = SpecCounts(sum(hist), spec_metrics["num_draft_tokens"],
                         sum(j * c for j, c in enumerate(hist)),
                         [sum(hist[i + 1:]) for i in range(k)])
        return RequestCounts(raw, raw, None, decode_steps, decode_tokens)
    raw = metrics.counts_from_steps(accepted, drafted, k)
    steps = metrics.engine_decode_steps(accepted, drafted, step_tokens) if matched else None
    if steps is None:
        return RequestCounts(raw, raw, None, decode_steps, decode_tokens)
    steps_a, steps_d = steps
    cut = sum(a + 1 for a in steps_a) - decode_tokens
    try:
        kept_a, kept_d = metrics.end_corrected_steps(steps_a, steps_d, decode_tokens)
    except ValueError:
        return RequestCounts(raw, raw, None, decode_steps, decode_tokens)
    if len(kept_a) != decode_steps:    # a cut that drops whole steps: not what vLLM does
        return RequestCounts(raw, raw, None, decode_steps, decode_tokens)
    return RequestCounts(raw, metrics.counts_from_steps(kept_a, kept_d, k), cut,
                         decode_steps, decode_tokens)


def counts_dict(c: SpecCounts) -> dict:
    return {"drafts": c.drafts, "draft_tokens": c.draft_tokens,
            "accepted_tokens": c.accepted_tokens, "accepted_at": list(c.accepted_at)}


# --------------------------------------------------------------------------- one pass

async def run_concurrent(engine, requests, concurrency):
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


async def _settled_counts(engine, speculative: bool) -> SpecCounts:
    """The engine's counters once its output handler has recorded the last step's stats."""
    if not speculative:
        return SpecCounts()
    after = engine.spec_counts()
    for _ in range(20):
        await asyncio.sleep(0.01)
        latest = engine.spec_counts()
        if latest == after:
            break
        after = latest
    return after


async def measure_pass(engine, cell: Cell, spec: ProtocolSpec, prompts: list[PromptItem],
                       prompt_ids: dict[str, list[int]], repetition: int, speculative: bool,
                       sampler=None) -> PassResult:
    """Pass ``repetition`` of ``cell``: every prompt once, at most b in flight. ``sampler``
    (a worker.hostload.HostLoadSampler) measures the host's other load over the pass."""
    requests, meta = [], []
    for item in prompts:
        sampling = {"temperature": cell.temperature, "max_tokens": spec.max_new_tokens,
                    "n": 1}
        seed = None
        if cell.temperature > 0:
            seed = request_seed(spec.seed, item.id, repetition)
            sampling["seed"] = seed
        rid = (f"{cell.task}|b{cell.batch_size}|t{cell.temperature:g}|k{cell.k}|{item.id}"
               f"|r{repetition}")
        requests.append((prompt_ids[item.id], sampling, rid))
        meta.append((item, seed))
    before = await _settled_counts(engine, speculative)
    if sampler is not None:
        sampler.start()
    try:
        results, wall, max_in_flight = await run_concurrent(engine, requests, cell.batch_size)
    finally:
        load = sampler.stop() if sampler is not None else None
    after = await _settled_counts(engine, speculative)
    counts = after - before
    counts.accepted_at = (list(counts.accepted_at) + [0] * cell.k)[:cell.k]
    cores = getattr(sampler, "engine_cores", None)
    return PassResult(repetition, meta, results, wall, max_in_flight, counts, load,
                      getattr(sampler, "engine_core_load", None),
                      tuple(sorted(cores)) if cores else None)


# --------------------------------------------------------------------------- time slices

def overlap(start: float, end: float, turns) -> float:
    """Seconds of [start, end] inside the turns [(t0, t1), ...] (disjoint)."""
    return sum(max(0.0, min(end, t1) - max(start, t0)) for t0, t1 in turns)


def in_turns(p: PassResult, turns) -> PassResult:
    """A pass measured in time slices with its clock kept to its engine's turns: the wall
    time is the part of the pass (first request sent to last one ended) in the turns, each
    request's latency and TTFT the part of them in the turns (between turns a request
    waits, paused, while the other engines compute)."""
    results = [replace(
        r, latency=overlap(r.submitted, r.submitted + r.latency, turns),
        ttft=None if r.ttft is None else overlap(r.submitted, r.submitted + r.ttft, turns))
        for r in p.results]
    wall = (overlap(min(r.submitted for r in p.results),
                    max(r.submitted + r.latency for r in p.results), turns)
            if p.results else 0.0)
    return replace(p, results=results, wall=wall)


async def sliced_group_pass(cells: list[Cell], engines: dict, measure, turn_s: float,
                            fair: bool = False) -> dict:
    """One pass of every cell of a group in time slices (ProtocolSpec.interleave_s). Every
    engine is paused (requests kept: VllmEngine.pause), each cell's pass is sent at once
    (``measure(cell)``, a measure_pass coroutine), then the engines compute in turns of
    ``turn_s`` seconds, one at a time, until every pass has ended; a cell whose pass ended
    leaves the rotation. Turns go round in the group's order, or, ``fair``
    (ProtocolSpec.fair_turns), to the engine whose pass has made the fewest tokens so far
    (``generated_tokens``), so the passes end together, with the engines out of their turn
    frozen. Returns {cell: in_turns(its pass)}; every engine is running again afterwards."""
    for cell in cells:
        await engines[cell].pause(freeze=fair)
    made = {cell: engines[cell].generated_tokens for cell in cells} if fair else {}
    tasks = {cell: asyncio.ensure_future(measure(cell)) for cell in cells}
    turns = {cell: [] for cell in cells}
    done = False
    try:
        turn = 0
        while not all(t.done() for t in tasks.values()):
            if fair:
                cell = min((c for c in cells if not tasks[c].done()),
                           key=lambda c: engines[c].generated_tokens - made[c])
            else:
                cell = cells[turn % len(cells)]
                turn += 1
                if tasks[cell].done():
                    continue
            await engines[cell].resume()
            t0 = time.perf_counter()
            await asyncio.wait([tasks[cell]], timeout=turn_s)
            await engines[cell].pause(freeze=fair)
            turns[cell].append((t0, time.perf_counter()))
        done = True
    finally:
        if not done:
            for t in tasks.values():
                t.cancel()
        for cell in cells:
            try:
                await engines[cell].resume()
            except Exception:
                if done:
                    raise
    return {cell: in_turns(tasks[cell].result(), turns[cell]) for cell in cells}


# --------------------------------------------------------------------------- the cell

def pass_records(cell: Cell, p: PassResult, eos_ids, speculative: bool) -> list[dict]:
    """The per-request records of one pass (as the cell's ``records`` hold them)."""
    return _records_of_pass(cell, p, eos_ids, speculative)[0]


def _records_of_pass(cell: Cell, p: PassResult, eos_ids, speculative: bool):
    """The per-request records of one pass, and the pass's summed raw counts, kept counts,
    tokens cut and unmatched requests."""
    k = cell.k
    raw_sum, kept_sum = SpecCounts(0, 0, 0, [0] * k), SpecCounts(0, 0, 0, [0] * k)
    cut_tokens, unmatched, records = 0, 0, []
    latency_sum = sum(r.latency for r in p.results)
    for (item, seed), res in zip(p.meta, p.results):
        out = metrics.truncate_at_eos(res.output_token_ids, eos_ids)
        rc = request_spec_counts(res.spec_metrics if speculative else None, res.step_tokens,
                                 len(res.output_token_ids), k)
        record = {
            "prompt_id": item.id, "task": cell.task, "batch_size": cell.batch_size,
            "temperature": cell.temperature, "k": k, "repetition": p.repetition,
            "engine_start": p.engine_start, "seed": seed, "output_token_ids": out, "prompt_tokens": res.prompt_tokens,
            "ttft": res.ttft, "latency": res.latency, "finish_reason": res.finish_reason,
            "tpot": metrics.tpot(res.latency, res.ttft, len(out)) if res.ttft else None,
            "time_share": p.wall * res.latency / latency_sum if latency_sum > 0 else 0.0,
            "decode_steps": rc.decode_steps, "decode_tokens": rc.decode_tokens,
        }
        if speculative:
            raw_sum, kept_sum = raw_sum + rc.raw, kept_sum + rc.kept
            if rc.cut is None:
                unmatched += 1
            else:
                cut_tokens += rc.cut
            record.update(counts_dict(rc.kept))
            record["cut_after_end"] = rc.cut
            record["vllm_spec_decode"] = res.spec_metrics
            record["step_tokens"] = res.step_tokens
        records.append(record)
    return records, raw_sum, kept_sum, cut_tokens, unmatched


def _weighted_load(passes, attr):
    loads = [(getattr(p, attr), p.wall) for p in passes if getattr(p, attr) is not None]
    total = sum(w for _, w in loads)
    return sum(x * w for x, w in loads) / total if loads and total > 0 else None


def cell_result(cell: Cell, passes: list[PassResult], eos_ids, speculative: bool,
                prefix_caching: bool, n_prompts: int, passes_stop: str = "fixed",
                remeasured: list[PassResult] = ()) -> CellResult:
    """A cell's figures, records and self-checks from its passes. `remeasured` are the
    passes dropped because the host was loaded (measured again: worker.measure); they count
    in ``remeasured_passes`` and the checks, not in the figures. ``loaded``: a kept pass was
    still loaded (the group ran out of remeasures)."""
    from worker import intervals

    k = cell.k
    records, outputs = [], {}
    raw = SpecCounts(0, 0, 0, [0] * k)
    kept = SpecCounts(0, 0, 0, [0] * k)
    engine = SpecCounts(0, 0, 0, [0] * k)
    cut_tokens, unmatched, pass_throughputs = 0, 0, []
    for p in passes:
        recs, r_sum, k_sum, cut, unm = _records_of_pass(cell, p, eos_ids, speculative)
        records += recs
        raw, kept, engine = raw + r_sum, kept + k_sum, engine + p.engine_counts
        cut_tokens, unmatched = cut_tokens + cut, unmatched + unm
        if p.repetition == passes[0].repetition:
            outputs = {r["prompt_id"]: r["output_token_ids"] for r in recs}
        pass_throughputs.append(metrics.output_throughput(
            sum(len(r["output_token_ids"]) for r in recs), p.wall))
    kept.accepted_at = list(kept.accepted_at)[:k]
    engine.accepted_at = (list(engine.accepted_at) + [0] * k)[:k]

    lengths = [len(r["output_token_ids"]) for r in records]
    ttfts = [r["ttft"] for r in records]
    tpots = [r["tpot"] for r in records]
    wall = sum(p.wall for p in passes)
    generated = sum(lengths)
    decode_tokens = sum(r["decode_tokens"] for r in records)
    decode_steps = sum(r["decode_steps"] for r in records)
    ttft_s, tpot_s = metrics.summary(ttfts), metrics.summary(tpots)
    tp_lo, tp_hi = intervals.throughput_interval(records)
    al_lo, al_hi = (intervals.acceptance_length_interval(records) if speculative
                    else (None, None))
    host_load = _weighted_load(passes, "host_load")
    figures = {
        "requests": len(records),
        "generated_tokens": generated,
        "wall_seconds": wall,
        **metrics.acceptance_figures(kept),
        "output_throughput": metrics.output_throughput(generated, wall),
        **{f"ttft_{q}": ttft_s[q] for q in ("mean", "p50", "p90", "p99")},
        **{f"tpot_{q}": tpot_s[q] for q in ("mean", "p50", "p90", "p99")},
        "repetitions": len(passes),
        "decode_tokens": decode_tokens,
        "decode_steps": decode_steps,
        "tokens_per_step": metrics.tokens_per_step(decode_tokens, decode_steps),
        "engine_acceptance_length": (metrics.engine_acceptance_length(engine)
                                     if speculative else None),
        "output_throughput_low": tp_lo,
        "output_throughput_high": tp_hi,
        "acceptance_length_low": al_lo,
        "acceptance_length_high": al_hi,
        "pass_throughputs": pass_throughputs,
        "host_load": host_load,
        "loaded": any(p.loaded for p in passes),
        "passes_stop": passes_stop,
        "remeasured_passes": len(remeasured),
        "engine_starts": len({p.engine_start for p in passes}),
    }
    assert tuple(figures) == FIGURE_KEYS

    in_flight = min(p.max_in_flight for p in passes)
    expected_in_flight = min(cell.batch_size, n_prompts)
    checks = {"max_in_flight": in_flight, "concurrency": cell.batch_size,
              "in_flight_reached": in_flight == expected_in_flight,
              "prefix_caching": bool(prefix_caching),
              "drift": intervals.drift(pass_throughputs),
              # the others' cores on the engine's cores (worker.hostload), kept passes
              "engine_cores": next((list(p.engine_cores) for p in passes if p.engine_cores),
                                   None),
              "engine_core_load": _weighted_load(passes, "engine_core_load"),
              "remeasured": [{"repetition": p.repetition, "host_load": p.host_load,
                              "engine_core_load": p.engine_core_load} for p in remeasured]}
    failed = []
    if not checks["in_flight_reached"]:
        failed.append(f"in flight reached {in_flight} of batch size {cell.batch_size}")
    if prefix_caching:
        failed.append("prefix caching is on")
    if speculative:
        correction = raw - kept
        correction.accepted_at = list(correction.accepted_at)[:k]
        checks.update({
            "engine_counters": counts_dict(engine),
            "per_request_sum": counts_dict(raw),
            "engine_matches_requests": counts_dict(engine) == counts_dict(raw),
            "tokens_cut_after_end": cut_tokens,
            "requests_without_step_match": unmatched,
            "correction": counts_dict(correction),
        })
        if not checks["engine_matches_requests"]:
            failed.append("engine counters differ from the per-request records")
        if unmatched:
            failed.append(f"{unmatched} request(s) whose step records do not add up to "
                          f"their output")
    checks["ok"] = not failed
    checks["failed"] = failed
    return CellResult(cell, figures, outputs, records, checks)
