"""One cell's analysis: decode steps of its requests, time breakdown, predicted,
no-waste and oracle bounds, engine efficiency, and the oracle combination of drafters (the
definitions are in worker/analysis/__init__.py)."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from worker import metrics
from worker.methods import NO_DRAFT_COST_METHODS
from .cost_model import CostModel, fit_cost_models, place_on_map
from .speedups import cell_key

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- requests

@dataclass
class RequestSteps:
    """The decode structure of one request: decode tokens, verification and
    non-speculative steps, the accepted spans (start position, accepted tokens) of its
    verification steps, in output positions (the prefill's token is position 0), and every
    decode step as (tokens drafted, tokens emitted): (0, 1) for a step that drafted nothing;
    a step cut at EOS / max_tokens keeps what it drafted (it was verified in full) and
    emits what the output kept."""

    key: tuple
    output: list
    first: int                  # tokens before the first decode step (the prefill's)
    spans: list                 # [(start, accepted)]
    non_spec: int
    decode_time: float | None
    ttft: float | None
    aligned: bool = True
    step_list: list = dataclasses.field(default_factory=list)   # [(drafted, emitted)]

    @property
    def tokens(self) -> int:
        return max(len(self.output) - self.first, 0)

    @property
    def steps(self) -> int:
        return len(self.spans) + self.non_spec

    @property
    def drafted(self) -> int:
        return sum(d for d, _ in self.step_list)


def _vllm_steps(r, k: int | None = None) -> RequestSteps:
    out = list(r.get("output_token_ids") or [])
    spec = r.get("vllm_spec_decode") or {}
    accepted = list(spec.get("per_step_accepted") or [])
    drafted_list = list(spec.get("per_step_drafted") or [])
    k = k if k is not None else r.get("k")

    def drafted(j):   # what verification step j drafted (k when the record lacks it)
        if j < len(drafted_list):
            return drafted_list[j]
        return max(k or 0, accepted[j])

    step_tokens = list(r.get("step_tokens") or [])
    key = (r.get("prompt_id"), r.get("repetition", 0))
    decode_time = (r["latency"] - r["ttft"]) if r.get("ttft") is not None else None
    spans, non_spec, aligned, step_list = [], 0, True, []
    if step_tokens and sum(step_tokens) == len(out):
        pos, j = step_tokens[0], 0
        last = len(step_tokens) - 1
        for i, v in enumerate(step_tokens[1:], start=1):
            if j < len(accepted) and v == accepted[j] + 1:
                spans.append((pos, accepted[j]))
                step_list.append((drafted(j), v))
                j += 1
            elif j < len(accepted) and i == last and v <= accepted[j]:
                spans.append((pos, v))   # cut at the end: every kept token was accepted
                step_list.append((drafted(j), v))   # verified in full all the same
                j += 1
            elif v == 1:
                non_spec += 1
                step_list.append((0, 1))
            else:
                aligned = False
                spans.append((pos, v - 1))
                step_list.append((v - 1, v))
            pos += v
        aligned = aligned and j == len(accepted)
        return RequestSteps(key, out, step_tokens[0], spans, non_spec, decode_time,
                            r.get("ttft"), aligned, step_list)
    # no usable step record: verification steps in order, then one token per step
    pos = 1 if out else 0
    for j, a in enumerate(accepted):
        if pos >= len(out):
            break
        kept = min(a, len(out) - pos)
        emitted = min(a + 1, len(out) - pos)
        spans.append((pos, kept))
        step_list.append((drafted(j), emitted))
        pos += emitted
    non_spec = max(len(out) - pos, 0)
    step_list += [(0, 1)] * non_spec
    return RequestSteps(key, out, 1 if out else 0, spans, non_spec, decode_time,
                        r.get("ttft"), not accepted or not step_tokens, step_list)


def _trace_steps(r) -> RequestSteps:
    steps = sorted(r["steps"], key=lambda s: s["step"])
    out = list(r.get("output_token_ids") or r.get("output_ids") or
               [t for s in steps for t in s["emitted"]])
    first = len(steps[0]["emitted"]) if steps and steps[0]["step"] == 0 else 0
    pos, spans, non_spec, step_list = first, [], 0, []
    for s in steps:
        if s["step"] == 0:
            continue
        n = len(s["emitted"])
        if s["drafted"]:
            spans.append((pos, min(s["accepted"], n)))
            step_list.append((len(s["drafted"]), n))
        else:
            non_spec += 1
            step_list.append((0, n))
        pos += n
    decode_time = (r["latency"] - r["ttft"]) if r.get("latency") is not None \
        and r.get("ttft") is not None else None
    return RequestSteps((r.get("prompt_id"), r.get("repetition", 0)), out, first, spans,
                        non_spec, decode_time, r.get("ttft"), True, step_list)


def request_steps(record, k: int | None = None) -> RequestSteps:
    """The decode structure of one per-request record (vLLM or reference traces); k is what
    a verification step drafted when the record does not say (default: the record's k)."""
    return _trace_steps(record) if record.get("steps") else _vllm_steps(record, k)


def accepted_from(rs: RequestSteps) -> list[int]:
    """For each output position, the tokens this request's drafter accepted from there: the
    rest of the accepted span that covers it, 0 outside spans."""
    acc = [0] * len(rs.output)
    for start, a in rs.spans:
        for p in range(start, min(start + a, len(acc))):
            acc[p] = a - (p - start)
    return acc


def oracle_step_sizes(tokens: int, k: int) -> list[int]:
    """The tokens each oracle step emits for a request of `tokens` decode tokens: k + 1 a
    step (k proposed, all accepted, plus the target's token), the rest in the last step."""
    full, rest = divmod(tokens, k + 1)
    return [k + 1] * full + ([rest] if rest else [])


# ----------------------------------------------------------------------------- one cell

def _phase_breakdown_from_traces(records) -> dict:
    """Phase seconds of reference-engine records, each batch step counted once."""
    from_steps: dict[tuple, dict] = {}
    for r in records:
        gen = r.get("generation", 0)
        for s in r["steps"]:
            from_steps.setdefault((gen, s["step"]), s.get("times") or {})
    phases = ("drafting", "verification", "sampling", "other")
    totals = {p: sum(t.get(p, 0.0) for t in from_steps.values()) for p in phases}
    decode_steps = sum(1 for (g, step) in from_steps if step > 0)
    prefill = {p: sum(t.get(p, 0.0) for (g, step), t in from_steps.items() if step == 0)
               for p in phases}
    return {"totals": totals, "decode_steps": decode_steps, "prefill": prefill}


def _ratio(a, b):
    return a / b if a is not None and b else None


# Engine efficiency outside this range gets a note that says what the model misses.
EFFICIENCY_RANGE = (0.8, 1.25)


def _cell_tokens_per_step(cell):
    """Tokens per step from the cell's stored figures (runs measured before the records
    carried it have none)."""
    if cell.get("tokens_per_step") is not None:
        return cell["tokens_per_step"]
    return _ratio(cell.get("decode_tokens"), cell.get("decode_steps"))


def analyse_cell(cell: dict, model: CostModel | None, method: str | None = None,
                 baseline_throughput: float | None = None) -> dict:
    """The time breakdown and the bounds of one drafter cell with records.

    Returns {"source": "vllm cost model" | "reference traces", "breakdown": {phase: seconds},
    "shares": {phase: share}, "wall_seconds", "tokens", "steps", "verify_steps",
    "drafted_tokens", "tokens_per_step", "t_fwd_b", "t_verify", "t_forward", "t_draft",
    "t_overhead", "draft_cost_relative", "prefill_seconds", "baseline_time",
    "predicted_time", "no_waste_time", "oracle_time", "measured_speedup",
    "predicted_speedup", "engine_efficiency", "efficiency_note", "oracle_speedup",
    "oracle_tokens_per_step", "no_waste_speedup", "measured_above_oracle",
    "verification_capped", "wall_vs_requests", "aligned", "break_even_tokens_per_step",
    "break_even_acceptance_length", "map_speedup", "drafting_share",
    "drafted_per_drafting_step"} (see the module docstring)."""
    records = cell.get("records") or []
    b, k = cell["batch_size"], cell["k"]
    reqs = [request_steps(r, k) for r in records]
    tokens = sum(r.tokens for r in reqs)
    steps = sum(r.steps for r in reqs)
    verify_steps = sum(len(r.spans) for r in reqs)
    traces = bool(records) and all(r.get("steps") for r in records)
    out = {"task": cell["task"], "batch_size": b, "temperature": float(cell["temperature"]),
           "k": k, "requests": len(reqs), "tokens": tokens, "steps": steps,
           "verify_steps": verify_steps, "drafted_tokens": sum(r.drafted for r in reqs),
           "tokens_per_step": _ratio(tokens, steps) if reqs else _cell_tokens_per_step(cell),
           "acceptance_length": cell.get("acceptance_length"),
           "aligned": all(r.aligned for r in reqs), "verification_capped": False,
           "measured_above_oracle": False, "efficiency_note": None,
           "cost_model": model.to_dict() if model else None}
    wall = cell.get("wall_seconds")
    t1 = model(b) if model else None
    measured = cell.get("speedup")
    if measured is None and baseline_throughput:
        measured = metrics.speedup(cell.get("output_throughput"), baseline_throughput)
    out["measured_speedup"] = measured
    request_time = sum((r.ttft or 0.0) + (r.decode_time or 0.0) for r in reqs)
    out["wall_vs_requests"] = _ratio(wall * b, request_time) if wall else None
    if traces:
        ph = _phase_breakdown_from_traces(records)
        breakdown = dict(ph["totals"])
        total = sum(breakdown.values())
        n_steps = max(ph["decode_steps"], 1)
        decode = {p: breakdown[p] - ph["prefill"][p] for p in breakdown}
        t_verify = decode["verification"] / n_steps
        t_draft = decode["drafting"] / n_steps
        out.update(source="reference traces", wall_seconds=total, breakdown=breakdown,
                   shares={p: _ratio(v, total) for p, v in breakdown.items()},
                   t_verify=t_verify, t_forward=t_verify, t_draft=t_draft,
                   t_overhead=(decode["sampling"] + decode["other"]) / n_steps)
        # a step's forward as measured; a step of q tokens scaled by the cost model's shape
        # (or in proportion to q without one), so that q = k + 1 costs the measured step

        def shape(q):
            return model(b, q) if model else float(q)

        def fwd_own(d, e):
            return t_verify

        def fwd(q):
            return t_verify * shape(q) / shape(k + 1) if shape(k + 1) else 0.0
        prefill_seconds = sum(r.ttft or 0.0 for r in reqs)
    else:
        if not reqs or model is None:
            out.update(source="vllm cost model", breakdown=None, shares=None,
                       wall_seconds=wall, t_verify=None, t_forward=None, t_draft=None,
                       t_overhead=None, t_fwd_b=t1, predicted_speedup=None,
                       engine_efficiency=None, oracle_speedup=None,
                       oracle_tokens_per_step=None, no_waste_speedup=None,
                       draft_cost_relative=None, prefill_seconds=None, baseline_time=None,
                       predicted_time=None, no_waste_time=None, oracle_time=None,
                       break_even_tokens_per_step=None, break_even_acceptance_length=None,
                       map_speedup=None, drafting_share=None, drafted_per_drafting_step=None)
            return out

        def fwd(q):
            return model(b, q)

        def fwd_own(d, e):   # what the step verified: d + 1 tokens, 1 when it drafted nothing
            return model(b, d + 1)
        decode_time = sum(r.decode_time or 0.0 for r in reqs)
        prefill_seconds = sum(r.ttft or 0.0 for r in reqs)
        forward = sum(fwd_own(d, e) for r in reqs for d, e in r.step_list)
        verification = min(forward, decode_time)     # rounding aside, flagged when capped
        out["verification_capped"] = forward > decode_time * (1 + 1e-9)
        rest = decode_time - verification
        total_time = prefill_seconds + decode_time
        shares = {"prefill": _ratio(prefill_seconds, total_time),
                  "verification": _ratio(verification, total_time),
                  "drafting_other": _ratio(rest, total_time)}
        breakdown = {p: (s * wall if s is not None and wall else None) for p, s in shares.items()}
        overhead = rest / steps if steps else None
        t_draft = 0.0 if method in NO_DRAFT_COST_METHODS else overhead
        out.update(source="vllm cost model", wall_seconds=wall, breakdown=breakdown,
                   shares=shares, t_verify=model(b, k + 1), t_forward=_ratio(forward, steps),
                   t_draft=t_draft, t_overhead=overhead,
                   modelled_forward_seconds=forward, decode_seconds=decode_time)
    t_draft = out["t_draft"] or 0.0
    out["t_fwd_b"] = t1
    out["prefill_seconds"] = prefill_seconds
    # draft cost relative to a target forward (measured cost, n-gram included)
    cost = out["t_draft"] if traces else out["t_overhead"]
    out["draft_cost_relative"] = _ratio(cost, t1)
    predicted = oracle = no_waste = oracle_tps = None
    base_time = pred_time = nw_time = or_time = None
    if t1 and tokens and steps:
        base_time = prefill_seconds + tokens * t1
        pred_time = prefill_seconds + sum(t_draft + fwd_own(d, e)
                                          for r in reqs for d, e in r.step_list)
        nw_time = prefill_seconds + sum(t_draft + fwd(e) for r in reqs for d, e in r.step_list)
        sizes = [q for r in reqs for q in oracle_step_sizes(r.tokens, k)]
        or_time = prefill_seconds + sum(fwd(q) for q in sizes)
        # the order holds by construction (a step emits at most what it verified, at most
        # k + 1; a forward's fixed part is >= 0); min() only absorbs rounding
        nw_time = min(nw_time, pred_time)
        or_time = min(or_time, nw_time)
        oracle_tps = _ratio(tokens, len(sizes))
        predicted = _ratio(base_time, pred_time)
        no_waste = _ratio(base_time, nw_time)
        oracle = _ratio(base_time, or_time)
    out.update(predicted_speedup=predicted, oracle_speedup=oracle,
               oracle_tokens_per_step=oracle_tps, no_waste_speedup=no_waste,
               engine_efficiency=_ratio(measured, predicted), baseline_time=base_time,
               predicted_time=pred_time, no_waste_time=nw_time, oracle_time=or_time)
    out["measured_above_oracle"] = bool(measured is not None and oracle is not None
                                        and measured > oracle)
    out["efficiency_note"] = efficiency_note(out, method)
    out.update(place_on_map(out, model))
    return out


def efficiency_note(a: dict, method: str | None = None) -> str | None:
    """What the cost model misses in one analysed cell, in a sentence or two; None when the
    engine efficiency is within EFFICIENCY_RANGE and no bound is beaten."""
    eff, measured = a.get("engine_efficiency"), a.get("measured_speedup")
    if eff is None:
        return None
    notes = []
    if a.get("measured_above_oracle"):
        notes.append(
            f"The measured speedup ({measured:.2f}x) is above the oracle bound "
            f"({a['oracle_speedup']:.2f}x), which no drafter can beat if the cost model is "
            f"right: the model charges this cell's target forwards more than they took (its "
            f"one-token step, {a['t_fwd_b'] * 1e3:.2f} ms at b={a['batch_size']}, is fitted "
            f"on the baseline run's TPOT; a baseline measured apart, under other load or "
            f"with drift, or a noisy cell, puts it off).")
    if a.get("verification_capped"):
        notes.append(
            f"The modelled target forwards ({a['modelled_forward_seconds']:.3f} s) exceed the "
            f"cell's measured decode time ({a['decode_seconds']:.3f} s): the baseline's step "
            f"cost overstates this cell's, so the verification share is capped at the decode "
            f"time.")
    lo, hi = EFFICIENCY_RANGE
    if eff > hi and not notes:
        notes.append(
            f"Measured {eff:.2f}x of the prediction: the cell ran faster than the cost model "
            f"charges its forwards (fitted on the baseline run at this batch size); the "
            f"model overstates a forward here.")
    if eff < lo:
        rest = (a.get("shares") or {}).get("drafting_other")
        if a.get("source") == "vllm cost model" and not a.get("t_draft") \
                and a.get("t_overhead"):
            notes.append(
                f"Measured {eff:.2f}x of the prediction: the prediction charges "
                f"{method or 'this method'} no drafting cost (no draft forward), but "
                f"{a['t_overhead'] * 1e3:.2f} ms per decode step "
                f"({a['t_overhead'] / a['t_fwd_b']:.0%} of a one-token forward"
                + (f", {rest:.0%} of the request time" if rest is not None else "")
                + ") went outside the modelled target forwards: the proposer's lookup, "
                "rejection sampling and the engine's scheduling of speculative steps.")
        else:
            wvr = a.get("wall_vs_requests")
            extra = (f" The cell's wall time was {wvr:.2f}x its requests' time at "
                     f"{a['batch_size']} in flight (fewer in flight than the batch size, or "
                     f"gaps between requests)." if wvr and wvr > 1.05 else "")
            notes.append(
                f"Measured {eff:.2f}x of the prediction, which charges every decode step "
                f"its target forward plus the measured drafting and other time; the "
                f"rest of the gap is outside the decode steps (prefill, queueing, the "
                f"client).{extra}")
    return " ".join(notes) or None


def analyse_run(cells: list[dict], baseline_cells: list[dict], method: str | None) -> list[dict]:
    """analyse_cell for each drafter cell, with the cost model of its (task, temperature)
    fitted on the baseline cells (baseline throughput from the same cells)."""
    models = fit_cost_models(baseline_cells)
    base_thr = {cell_key(c): c.get("output_throughput")
                for c in baseline_cells}
    return [analyse_cell(c, models.get((c["task"], float(c["temperature"]))), method,
                         base_thr.get(cell_key(c)))
            for c in cells]


def analyse_run_or_stored_only(cells: list[dict], baseline_cells: list[dict],
                               method: str | None, what: str = "run") -> list[dict]:
    """analyse_run; where the raw records do not have the expected shape they are logged and
    left out (the cells' stored figures still count), never a failed page or run."""
    try:
        return analyse_run(cells, baseline_cells, method)
    except (KeyError, TypeError, ValueError, ArithmeticError) as e:
        log.warning("%s: raw records not analysable: %r", what, e)
        return analyse_run([{**c, "records": []} for c in cells], baseline_cells, method)


# The analysis figures stored on each result row (and exported), from one analysed cell.
EXPORT_COLUMNS = ("tokens_per_step", "predicted_speedup", "engine_efficiency",
                  "oracle_speedup", "no_waste_speedup", "prefill_share",
                  "verification_share", "drafting_other_share")


def export_values(a: dict | None) -> list:
    """The EXPORT_COLUMNS of one analysed cell (Nones without one)."""
    if not a:
        return [None] * len(EXPORT_COLUMNS)
    shares = a.get("shares") or {}
    drafting_other = shares.get("drafting_other")
    if drafting_other is None and shares:
        parts = [shares.get(p) for p in ("drafting", "sampling", "other")]
        drafting_other = sum(parts) if all(p is not None for p in parts) else None
    return [a.get("tokens_per_step"), a.get("predicted_speedup"), a.get("engine_efficiency"),
            a.get("oracle_speedup"), a.get("no_waste_speedup"), shares.get("prefill"),
            shares.get("verification"), drafting_other]


# ----------------------------------------------------------------------------- combine

def oracle_combine(drafter_records: dict[str, list[dict]], k: int, model: CostModel | None,
                   batch_size: int, reference_outputs: dict | None = None,
                   draft_costs: dict[str, float] | None = None) -> dict | None:
    """The oracle combination of several drafters on one (task, batch size, temperature 0,
    k): ``drafter_records`` maps a drafter to its cell's records. Requests are matched by
    (prompt id, repetition); a request counts where every drafter that has it produced the
    reference output (``reference_outputs``: the baseline's by prompt id; without it the
    first drafter's). Returns tokens, combined steps, AL_combine, each drafter's tokens
    per step on the same requests, and the speedup bound and hybrid speedup."""
    per = {d: {rs.key: rs for rs in map(request_steps, recs)} for d, recs in drafter_records.items()}
    if len(per) < 2:
        return None
    keys = sorted(set().union(*[set(v) for v in per.values()]), key=str)
    tokens = steps_c = used = 0
    own_steps = {d: 0 for d in per}
    own_tokens = {d: 0 for d in per}
    for key in keys:
        have = {d: v[key] for d, v in per.items() if key in v}
        if len(have) < 2:
            continue
        ref = (reference_outputs or {}).get(key[0])
        if ref is None:
            ref = next(iter(have.values())).output
        have = {d: rs for d, rs in have.items() if rs.output == list(ref)}
        if len(have) < 2:
            continue
        accs = {d: accepted_from(rs) for d, rs in have.items()}
        first = min(rs.first for rs in have.values())
        n = len(ref)
        pos, s = first, 0
        while pos < n:
            m = min(max(a[pos] for a in accs.values()), k)
            pos += m + 1
            s += 1
        used += 1
        tokens += n - first
        steps_c += s
        for d, rs in have.items():
            own_steps[d] += rs.steps
            own_tokens[d] += rs.tokens
    if not steps_c:
        return None
    al = tokens / steps_c
    out = {"requests": used, "tokens": tokens, "steps": steps_c, "al_combine": al,
           "drafter_tokens_per_step": {d: _ratio(own_tokens[d], own_steps[d])
                                       for d in per if own_steps[d]},
           "speedup_bound": None, "speedup_hybrid": None}
    if model is not None:
        t1, tv = model(batch_size), model(batch_size, k + 1)
        out["speedup_bound"] = al * t1 / tv
        if draft_costs is not None:
            out["speedup_hybrid"] = al * t1 / (tv + sum(v or 0.0 for v in draft_costs.values()))
    return out
