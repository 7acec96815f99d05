"""The baseline: no speculation; the target decodes one token per step. Every measurement
protocol measures it; speedups divide by it. Not a drafter anyone submits."""
from __future__ import annotations

from worker.methods.base import Method, check_params


def speculative_config(drafter, k: int) -> None:
    check_params(drafter, "baseline", ())
    return None


METHOD = Method(
    name="baseline",
    label="baseline (no speculation)",
    submittable=False,
    needs_weights=False,
    params=(),
    speculative_config=speculative_config,
    draft_cost=False,
)
