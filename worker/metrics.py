"""Metric definitions. This module owns them: pages, the API, the protocol page (which
shows these docstrings) and the tests all use these functions.

Counts are summed over all requests of a cell. A *draft* is one speculative step of one
request that proposed at least one token. Tokens after an end-of-sequence token are never
counted.

One end-of-output rule (``end_corrected_steps``) is applied to each request's steps before
they are counted: the steps are cut so that they emit exactly the decode tokens the output
kept, and a step cut by EOS or max_tokens counts as the tokens it emitted. Acceptance length,
rate, alpha_i and beta_i are all computed from the same corrected steps, so AL = 1 +
sum(alpha_i) and rate = accepted / drafted hold after the correction. vLLM's own counters
(what ``vllm bench serve`` prints) are kept beside them as ``engine_acceptance_length``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SpecCounts:
    """Speculation counters of a cell: drafts, drafted tokens, accepted tokens (the bonus
    token not counted) and ``accepted_at[i-1]``, the drafts whose position i was accepted."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_at: list[int] = field(default_factory=list)

    def __add__(self, other):
        n = max(len(self.accepted_at), len(other.accepted_at))
        pad = lambda xs: list(xs) + [0] * (n - len(xs))  # noqa: E731
        return SpecCounts(
            self.drafts + other.drafts,
            self.draft_tokens + other.draft_tokens,
            self.accepted_tokens + other.accepted_tokens,
            [a + b for a, b in zip(pad(self.accepted_at), pad(other.accepted_at))],
        )

    def __sub__(self, other):
        """Engine counters are cumulative: a cell's counts are the difference at its bounds."""
        n = max(len(self.accepted_at), len(other.accepted_at))
        pad = lambda xs: list(xs) + [0] * (n - len(xs))  # noqa: E731
        return SpecCounts(
            self.drafts - other.drafts,
            self.draft_tokens - other.draft_tokens,
            self.accepted_tokens - other.accepted_tokens,
            [a - b for a, b in zip(pad(self.accepted_at), pad(other.accepted_at))],
        )


def counts_from_steps(accepted, drafted, k: int | None = None) -> SpecCounts:
    """SpecCounts of one or more requests' speculative steps, given the tokens each step
    accepted and drafted (parallel lists). A step that drafted nothing is not a draft.
    ``accepted_at`` has k places (k not given: the longest draft's length)."""
    steps = [(a, d) for a, d in zip(accepted, drafted) if d > 0]
    k = k or max((d for _, d in steps), default=0)
    at = [0] * k
    for a, _ in steps:
        for i in range(min(a, k)):
            at[i] += 1
    return SpecCounts(len(steps), sum(d for _, d in steps), sum(a for a, _ in steps), at)


def end_corrected_steps(accepted, drafted, output_tokens: int):
    """The end-of-output rule, the one applied to every acceptance figure: a request's
    decode steps cut so that they emit exactly the decode tokens its output kept.

    ``accepted`` and ``drafted`` are parallel lists over the request's decode steps in engine
    order (the prefill's token is not a decode step); a step that proposed nothing has
    drafted 0 and accepted 0. A step emits accepted + 1 tokens (the accepted drafts and the
    target's bonus or corrected token). ``output_tokens`` is the number of decode tokens
    the output kept (output length less the prefill's token, after EOS / max_tokens).

    Walking the steps in order, the step where the output ended emitted t tokens of its
    accepted + 1. If it was cut (t < accepted + 1) it counts as the tokens it emitted:
    accepted' = t - 1, drafted' = min(drafted, t - 1) -- the last emitted token plays the
    bonus token, so the step is a draft of t - 1 tokens all accepted (t = 1: a step that
    drafted nothing). Steps after it are dropped; earlier steps are unchanged. Invariant:
    sum(accepted' + 1) == output_tokens. Returns (accepted', drafted') as new lists;
    ValueError when the steps emit fewer tokens than the output kept (the records do not
    add up)."""
    if len(accepted) != len(drafted):
        raise ValueError(f"{len(accepted)} accepted against {len(drafted)} drafted steps")
    if output_tokens < 0:
        raise ValueError(f"negative decode tokens: {output_tokens}")
    out_a, out_d, emitted = [], [], 0
    for a, d in zip(accepted, drafted):
        if emitted >= output_tokens:
            break
        if a < 0 or d < 0 or a > d:
            raise ValueError(f"a step accepted {a} of {d} drafted tokens")
        t = min(a + 1, output_tokens - emitted)
        if t < a + 1:
            a, d = t - 1, min(d, t - 1)
        out_a.append(a)
        out_d.append(d)
        emitted += a + 1
    if emitted != output_tokens:
        raise ValueError(f"the steps emit {emitted} decode tokens, the output kept "
                         f"{output_tokens}")
    return out_a, out_d


def engine_decode_steps(accepted, drafted, step_tokens):
    """A vLLM request's decode steps as ``end_corrected_steps`` takes them, or None when
    the records do not line up.

    vLLM's per-request ``per_step_accepted`` / ``per_step_drafted`` list only the steps that
    drafted; ``step_tokens`` (the tokens each engine step delivered, the first the prefill's,
    already cut at the end) has every step. A delivered count of accepted + 1 is the next
    verification step, 1 a step that proposed nothing (drafted 0), and the last step may
    deliver fewer than accepted + 1 (cut at the end). The returned steps carry vLLM's
    uncut counts; pass them with the output's decode tokens (sum(step_tokens[1:])) to
    ``end_corrected_steps``. Without per-step tokens, the verification steps alone are
    returned (right for drafters that draft every step; for others
    ``end_corrected_steps`` then finds the tokens do not add up)."""
    accepted, drafted = list(accepted), list(drafted)
    if len(accepted) != len(drafted):
        return None
    if not step_tokens:
        return accepted, drafted
    out_a, out_d, j = [], [], 0
    decode = list(step_tokens[1:])
    for i, v in enumerate(decode):
        last = i == len(decode) - 1
        if j < len(accepted) and (v == accepted[j] + 1 or (last and 1 <= v <= accepted[j])):
            out_a.append(accepted[j])
            out_d.append(drafted[j])
            j += 1
        elif v == 1:
            out_a.append(0)
            out_d.append(0)
        else:
            return None
    if j != len(accepted):
        return None
    return out_a, out_d


def tokens_per_step(decode_tokens: int, decode_steps: int):
    """Tokens per step = decode tokens / decode steps, over every decode step of the cell
    (the prefill's first token not counted), steps that drafted nothing included; 1.0 for
    the baseline. It equals the acceptance length when every step drafted, and is lower
    when some steps proposed nothing (n-gram drafts only where its lookup matches: AL counts
    only the steps that drafted). Compare tokens per step across methods; compare AL within
    a method that drafts every step (or to see how good its drafts are when it drafts).
    None without decode steps."""
    return decode_tokens / decode_steps if decode_steps else None


def acceptance_length(c: SpecCounts):
    """Acceptance length AL = 1 + accepted_tokens / drafts: the tokens one speculative step
    yields, counting the target's bonus or corrected token (as vLLM does), from the
    end-corrected steps (``end_corrected_steps``): drafts accepted past the end of the
    output are not counted, and a cut step counts as the tokens it emitted. Counts only the
    steps that drafted (see tokens per step). None without drafts."""
    return 1.0 + c.accepted_tokens / c.drafts if c.drafts else None


def engine_acceptance_length(c: SpecCounts):
    """Engine acceptance length = 1 + accepted / drafts from vLLM's own counters, uncorrected:
    what ``vllm bench serve`` prints. It includes drafts accepted past the end of an output
    (EOS or max_tokens), so it is a little above the end-corrected AL (by about 0.1-2% on
    the demo cells). None without drafts."""
    return 1.0 + c.accepted_tokens / c.drafts if c.drafts else None


def acceptance_rate(c: SpecCounts):
    """Acceptance rate = accepted_tokens / draft_tokens: the share of drafted tokens accepted,
    from the end-corrected steps (a cut step counts as t - 1 drafted, all accepted)."""
    return c.accepted_tokens / c.draft_tokens if c.draft_tokens else None


def per_position_acceptance(c: SpecCounts):
    """Per-position acceptance alpha_i = accepted_at[i] / drafts, i = 1..k: the share of
    drafts whose position i was accepted, from the end-corrected steps. Non-increasing in i,
    and AL = 1 + sum(alpha_i)."""
    if not c.drafts:
        return []
    return [a / c.drafts for a in c.accepted_at]


def conditional_acceptance(c: SpecCounts):
    """Conditional acceptance beta_i = accepted_at[i] / accepted_at[i-1], with
    accepted_at[0] = drafts: the chance that position i is accepted given that i-1 was,
    from the end-corrected steps."""
    out, previous = [], c.drafts
    for a in c.accepted_at:
        out.append(a / previous if previous else None)
        previous = a
    return out


def acceptance_figures(c: SpecCounts) -> dict:
    """The counts and every acceptance figure of them, as a result row holds them."""
    return {
        "drafts": c.drafts,
        "draft_tokens": c.draft_tokens,
        "accepted_tokens": c.accepted_tokens,
        "accepted_at": list(c.accepted_at),
        "acceptance_length": acceptance_length(c),
        "acceptance_rate": acceptance_rate(c),
        "per_position_acceptance": per_position_acceptance(c),
        "conditional_acceptance": conditional_acceptance(c),
    }


def output_throughput(generated_tokens: int, wall_seconds: float):
    """Output throughput = generated tokens / wall time of the cell (tokens per second),
    with b requests in flight at batch size b."""
    return generated_tokens / wall_seconds if wall_seconds > 0 else None


def percentile(values, q):
    """The q-th percentile (0..100) with linear interpolation between closest ranks."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(values):
    """Mean, p50, p90 and p99 of per-request latencies (TTFT: time to first token, from the
    request's submission; TPOT: time per output token after the first,
    (latency - TTFT) / (output tokens - 1))."""
    xs = [v for v in values if v is not None]
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {"mean": sum(xs) / len(xs), "p50": percentile(xs, 50),
            "p90": percentile(xs, 90), "p99": percentile(xs, 99)}


def tpot(latency: float, ttft: float, output_tokens: int):
    """Time per output token of one request, after its first token."""
    return (latency - ttft) / (output_tokens - 1) if output_tokens > 1 else None


def per_user_speed(tpot_mean):
    """Per-user speed: the output tokens per second one request sees after its first token,
    1 / the cell's mean TPOT (None without one)."""
    return 1.0 / tpot_mean if tpot_mean else None


def speedup(throughput, baseline_throughput):
    """Speedup = output throughput with the drafter / output throughput of the baseline run
    (no speculation) under the same protocol, task, batch size, temperature, engine version
    and hardware class. Never divided by a figure from another condition."""
    if throughput is None or not baseline_throughput:
        return None
    return throughput / baseline_throughput


def lossless_share(outputs: dict, baseline_outputs: dict):
    """Lossless share (temperature 0): the share of requests whose output token ids equal
    the baseline's, token for token. Requests missing from either side are not counted."""
    common = [rid for rid in outputs if rid in baseline_outputs]
    if not common:
        return None
    same = sum(1 for rid in common if list(outputs[rid]) == list(baseline_outputs[rid]))
    return same / len(common)


# The repetition whose outputs the lossless check compares, everywhere (the measurement's
# CellResult.outputs, the records' outputs, the oracle combination's reference).
LOSSLESS_REPETITION = 0


def lossless_outputs(records) -> dict:
    """{prompt id: output token ids} of a cell's per-request records, repetition
    LOSSLESS_REPETITION only (a record without a repetition is the first): what
    lossless_share compares, on both sides."""
    return {r["prompt_id"]: r["output_token_ids"] for r in records
            if r.get("repetition", 0) == LOSSLESS_REPETITION}


def truncate_at_eos(token_ids, eos_ids):
    """Tokens after an end-of-sequence token are never counted (the EOS itself is kept)."""
    out = []
    for t in token_ids:
        out.append(t)
        if t in eos_ids:
            break
    return out


# The figures that a Result row holds, with their definitions, in display order.
DEFINITIONS = {
    "tokens_per_step": tokens_per_step,
    "acceptance_length": acceptance_length,
    "engine_acceptance_length": engine_acceptance_length,
    "acceptance_rate": acceptance_rate,
    "per_position_acceptance": per_position_acceptance,
    "conditional_acceptance": conditional_acceptance,
    "output_throughput": output_throughput,
    "latency_summary": summary,
    "tpot": tpot,
    "speedup": speedup,
    "lossless_share": lossless_share,
    "truncate_at_eos": truncate_at_eos,
    "end_corrected_steps": end_corrected_steps,
}


def definitions():
    """(name, first paragraph of the docstring) for each metric, for the protocol page."""
    return [(name, " ".join((fn.__doc__ or "").split())) for name, fn in DEFINITIONS.items()]
