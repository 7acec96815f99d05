"""Metric definitions. This module owns them: pages, the API, the protocol page (which
shows these docstrings) and the tests all use these functions.

Counts are summed over all requests of a cell. A *draft* is one speculative step of one
request that proposed at least one token. Tokens after an end-of-sequence token are never
counted.
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


def acceptance_length(c: SpecCounts):
    """Acceptance length AL = 1 + accepted_tokens / drafts: the tokens one speculative step
    yields, counting the target's bonus or corrected token (as vLLM does). None without drafts."""
    return 1.0 + c.accepted_tokens / c.drafts if c.drafts else None


def acceptance_rate(c: SpecCounts):
    """Acceptance rate = accepted_tokens / draft_tokens: the share of drafted tokens accepted."""
    return c.accepted_tokens / c.draft_tokens if c.draft_tokens else None


def per_position_acceptance(c: SpecCounts):
    """Per-position acceptance alpha_i = accepted_at[i] / drafts, i = 1..k: the share of
    drafts whose position i was accepted. Non-increasing in i, and AL = 1 + sum(alpha_i)."""
    if not c.drafts:
        return []
    return [a / c.drafts for a in c.accepted_at]


def conditional_acceptance(c: SpecCounts):
    """Conditional acceptance beta_i = accepted_at[i] / accepted_at[i-1], with
    accepted_at[0] = drafts: the chance that position i is accepted given that i-1 was."""
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
    "acceptance_length": acceptance_length,
    "acceptance_rate": acceptance_rate,
    "per_position_acceptance": per_position_acceptance,
    "conditional_acceptance": conditional_acceptance,
    "output_throughput": output_throughput,
    "latency_summary": summary,
    "tpot": tpot,
    "speedup": speedup,
    "lossless_share": lossless_share,
    "truncate_at_eos": truncate_at_eos,
}


def definitions():
    """(name, first paragraph of the docstring) for each metric, for the protocol page."""
    return [(name, " ".join((fn.__doc__ or "").split())) for name, fn in DEFINITIONS.items()]
