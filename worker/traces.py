"""Analyses of the reference engine's step traces (``SequenceResult.steps``).

- ``accepted_span_lengths``: per request, how many drafts accepted 0, 1, ... k tokens;
- ``spec_counts`` / ``per_position_acceptance``: the metrics module's counters and
  per-position acceptance, rebuilt from traces (only drafts, i.e. steps that proposed at
  least one token, count; tokens after an EOS were never emitted, so never counted);
- ``step_times`` / ``time_breakdown``: per batch step and in total, the time spent drafting,
  verifying, in rejection sampling and elsewhere, with shares.
"""
from __future__ import annotations

from collections import Counter

from worker import metrics
from worker.engines.reference import PHASES


def drafts(result):
    """The steps of one request that proposed at least one token."""
    return [s for s in result.steps if s.drafted]


def accepted_span_lengths(result) -> dict[int, int]:
    """Distribution of accepted span lengths of one request: {accepted tokens: drafts}."""
    counts = Counter(s.accepted for s in drafts(result))
    return dict(sorted(counts.items()))


def span_length_distributions(results) -> list[dict[int, int]]:
    """``accepted_span_lengths`` for each request of a generation."""
    return [accepted_span_lengths(r) for r in results]


def spec_counts(results, k: int | None = None) -> metrics.SpecCounts:
    """SpecCounts over requests: drafts, drafted tokens, accepted tokens (bonus not
    counted) and accepted_at[i-1], the drafts whose position i was accepted (i = 1..k)."""
    steps = [s for r in results for s in drafts(r)]
    return metrics.counts_from_steps([s.accepted for s in steps],
                                     [len(s.drafted) for s in steps], k)


def per_position_acceptance(results, k: int | None = None) -> list[float]:
    """alpha_i = accepted_at[i] / drafts from the traces (see worker.metrics)."""
    return metrics.per_position_acceptance(spec_counts(results, k))


def acceptance_length(results):
    """AL = 1 + accepted tokens / drafts from the traces (see worker.metrics)."""
    return metrics.acceptance_length(spec_counts(results))


def step_times(results) -> list[dict]:
    """One row per batch step of a generation: its phase times (seconds), how many
    sequences took part and how many tokens it emitted. Results must come from one
    ``generate`` call: a batch step's time is shared by its sequences, counted once here."""
    rows: dict[int, dict] = {}
    for r in results:
        for s in r.steps:
            row = rows.setdefault(s.step, {"step": s.step, **{p: s.times.get(p, 0.0) for p in PHASES},
                                           "sequences": 0, "drafted": 0, "emitted": 0})
            row["sequences"] += 1
            row["drafted"] += len(s.drafted)
            row["emitted"] += len(s.emitted)
    return [rows[step] for step in sorted(rows)]


def time_breakdown(results) -> dict:
    """Total seconds per phase (drafting, verification, sampling, other) of one generation,
    its wall time (the sum: phases are contiguous), and each phase's share of it."""
    table = step_times(results)
    totals = {p: sum(row[p] for row in table) for p in PHASES}
    wall = sum(totals.values())
    return {**totals, "wall": wall,
            "shares": {p: (totals[p] / wall if wall else None) for p in PHASES}}


def summary(results) -> dict:
    """The figures a trace yields for one generation, for the CLI and the demo."""
    counts = spec_counts(results)
    breakdown = time_breakdown(results)
    generated = sum(len(r.output_ids) for r in results)
    return {
        "generated_tokens": generated,
        "wall_s": breakdown["wall"],
        "output_throughput": metrics.output_throughput(generated, breakdown["wall"]),
        **metrics.acceptance_figures(counts),
        "time_breakdown": breakdown,
    }
