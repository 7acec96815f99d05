"""The cost model: the target's forward time fitted on a baseline run, break-even
acceptance and the break-even map (the definitions are in worker/analysis/__init__.py)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from worker import metrics


# ----------------------------------------------------------------------------- cost model

@dataclass(frozen=True)
class CostModel:
    """t_fwd(b, q) = c0 + c1 * b + c_tok * b * (q - 1) seconds for a forward of b sequences
    with q tokens each (c_tok None: c1, the model of a line in b * q)."""

    c0: float
    c1: float
    points: tuple = ()          # (batch size, measured decode step time)
    kind: str = "least squares"
    c_tok: float | None = None
    prefill_points: int = 0     # baseline requests the c_tok slope was fitted on

    @property
    def per_token(self) -> float:
        return self.c1 if self.c_tok is None else self.c_tok

    def token_cost(self, b) -> float:
        """c_tok at batch size b, at most t_fwd(b, 1) / b: q tokens of one sequence never
        cost more than q sequences of one token, so a step's fixed part is never negative."""
        if b <= 0:
            return self.per_token
        return max(min(self.per_token, (self.c0 + self.c1 * b) / b), 0.0)

    def __call__(self, b, q=1) -> float:
        return self.c0 + self.c1 * b + self.token_cost(b) * b * (q - 1)

    def to_dict(self):
        return {"c0": self.c0, "c1": self.c1, "c_tok": self.per_token, "kind": self.kind,
                "c_tok_from": (f"prefill slope over {self.prefill_points} requests"
                               if self.c_tok is not None else "c1 (no prefill slope)"),
                "points": [list(p) for p in self.points]}


def _least_squares(pts):
    """(intercept, slope) of t = a + s n over (n, t) points with two distinct n or more."""
    mean_n = sum(n for n, _ in pts) / len(pts)
    mean_t = sum(t for _, t in pts) / len(pts)
    sxx = sum((n - mean_n) ** 2 for n, _ in pts)
    slope = sum((n - mean_n) * (t - mean_t) for n, t in pts) / sxx
    return mean_t - slope * mean_n, slope


def fit_line(points) -> CostModel | None:
    """Least squares t = c0 + c1 n over (n, t) points, with c0, c1 >= 0 (a negative slope
    gives the constant mean; a negative intercept the line through the origin)."""
    pts = sorted((float(n), float(t)) for n, t in points if t is not None and t > 0)
    if not pts:
        return None
    mean_t = sum(t for _, t in pts) / len(pts)
    if len({n for n, _ in pts}) == 1:
        return CostModel(mean_t, 0.0, tuple(pts), "constant (one batch size)")
    c0, c1 = _least_squares(pts)
    if c1 < 0:
        return CostModel(mean_t, 0.0, tuple(pts), "constant (negative slope)")
    if c0 < 0:
        c1 = sum(n * t for n, t in pts) / sum(n * n for n, _ in pts)
        return CostModel(0.0, c1, tuple(pts), "through the origin (negative intercept)")
    return CostModel(c0, c1, tuple(pts))


def prefill_slope(records) -> tuple[float | None, int]:
    """(seconds per prompt token, requests used): the least-squares slope of TTFT against
    prompt tokens over batch-size-1 requests; None without two prompt lengths or when
    the slope is not positive."""
    pts = [(float(r["prompt_tokens"]), float(r["ttft"])) for r in records
           if r.get("prompt_tokens") and r.get("ttft") is not None and r["ttft"] > 0]
    if len({n for n, _ in pts}) < 2:
        return None, 0
    _, slope = _least_squares(pts)
    return (slope, len(pts)) if slope > 0 else (None, 0)


def step_time(cell) -> float | None:
    """A baseline cell's decode step time: its mean TPOT (from the records if need be)."""
    if cell.get("tpot_mean"):
        return cell["tpot_mean"]
    tpots = [metrics.tpot(r["latency"], r["ttft"], len(r["output_token_ids"]))
             for r in cell.get("records") or [] if r.get("ttft") is not None]
    tpots = [t for t in tpots if t is not None]
    return sum(tpots) / len(tpots) if tpots else None


def fit_cost_models(baseline_cells) -> dict[tuple, CostModel]:
    """{(task, temperature): CostModel} from the baseline run's cells (the prefill slope
    from the records of its batch-size-1 cells, where they carry records)."""
    groups: dict[tuple, list] = {}
    prefills: dict[tuple, list] = {}
    for c in baseline_cells:
        key = (c["task"], float(c["temperature"]))
        groups.setdefault(key, []).append((c["batch_size"], step_time(c)))
        if c["batch_size"] == 1:
            prefills.setdefault(key, []).extend(c.get("records") or [])
    models = {}
    for key, pts in groups.items():
        model = fit_line(pts)
        if model is None:
            continue
        c_tok, n = prefill_slope(prefills.get(key, []))
        models[key] = dataclasses.replace(model, c_tok=c_tok, prefill_points=n)
    return models


# ----------------------------------------------------------------------------- break-even

def break_even(model: CostModel, batch_size: int, k: int, draft_cost: float,
               drafting_share: float = 1.0, drafted_tokens: float | None = None) -> dict:
    """What a drafter needs to pay at batch size b (see "Break-even map" in the module
    docstring): {"tokens_per_step": tau*, "acceptance_length": AL* (None when no step
    drafts), "reachable": whether a step can emit that many, "verify_ratio": t_fwd(b, 1 + d)
    / t_fwd(b)}. draft_cost is relative to t_fwd(b); drafting_share the share s of decode
    steps that draft; drafted_tokens what a drafting step drafts on average (default k).
    ValueError for inputs no drafter can have."""
    if model is None:
        raise ValueError("the break-even needs a cost model (a baseline run's cells)")
    if not (isinstance(batch_size, int) and batch_size >= 1):
        raise ValueError(f"the batch size must be a whole number >= 1, got {batch_size!r}")
    if not (isinstance(k, int) and k >= 1):
        raise ValueError(f"the speculation budget k must be a whole number >= 1, got {k!r}")
    if not (draft_cost is not None and math.isfinite(draft_cost) and draft_cost >= 0):
        raise ValueError(f"the draft cost must be a finite number >= 0, got {draft_cost!r}")
    if not (drafting_share is not None and 0.0 <= drafting_share <= 1.0):
        raise ValueError(f"the share of drafting steps must be within [0, 1], "
                         f"got {drafting_share!r}")
    drafted_tokens = k if drafted_tokens is None else drafted_tokens
    if not 0.0 < drafted_tokens <= k:
        raise ValueError(f"a drafting step drafts within (0, k = {k}] tokens, "
                         f"got {drafted_tokens!r}")
    t1 = model(batch_size)
    if not t1 > 0:
        raise ValueError(f"the cost model gives no positive forward time at b={batch_size}")
    verify_ratio = model(batch_size, 1 + drafting_share * drafted_tokens) / t1
    tau = draft_cost + verify_ratio
    al = 1 + (tau - 1) / drafting_share if drafting_share > 0 else None
    return {"tokens_per_step": tau, "acceptance_length": al,
            "reachable": al is not None and al <= 1 + drafted_tokens,
            "verify_ratio": verify_ratio}


def break_even_acceptance(model: CostModel, batch_size: int, k: int,
                          draft_cost: float) -> float:
    """The acceptance length (= tokens per step) a drafter that drafts k tokens every step,
    at draft_cost x t_fwd(b) per step, needs to beat the target alone at batch size b."""
    return break_even(model, batch_size, k, draft_cost)["tokens_per_step"]


def break_even_curve(model: CostModel, batch_size: int, k: int, draft_costs) -> list[dict]:
    """[{"draft_cost", "tokens_per_step"}] of break_even_acceptance over draft_costs (sorted),
    up to where it reaches k + 1 tokens per step (no drafter at k pays beyond): the last
    point is that draft cost when the range goes past it."""
    out = []
    for cost in sorted(draft_costs):
        tau = break_even_acceptance(model, batch_size, k, cost)
        if tau > k + 1:
            ceiling = k + 1 - break_even_acceptance(model, batch_size, k, 0.0)
            if ceiling >= 0 and (not out or out[-1]["draft_cost"] < ceiling):
                out.append({"draft_cost": ceiling, "tokens_per_step": float(k + 1)})
            break
        out.append({"draft_cost": cost, "tokens_per_step": tau})
    return out


def place_on_map(a: dict, model: CostModel | None) -> dict:
    """An analysed cell (analyse_cell) on the break-even map: its own tau* and AL* (its share
    of drafting steps and drafted tokens), and map_speedup = tau / tau*. Nones where the
    cell has no draft cost, tokens per step or cost model."""
    out = {"break_even_tokens_per_step": None, "break_even_acceptance_length": None,
           "map_speedup": None, "drafting_share": None, "drafted_per_drafting_step": None}
    tau, cost, steps = a.get("tokens_per_step"), a.get("draft_cost_relative"), a.get("steps")
    if model is None or tau is None or cost is None or not steps:
        return out
    verify = a.get("verify_steps") or 0
    drafted = min(a["drafted_tokens"] / verify, a["k"]) if verify and a.get("drafted_tokens") \
        else None
    try:
        be = break_even(model, a["batch_size"], a["k"], max(cost, 0.0),
                        drafting_share=verify / steps, drafted_tokens=drafted)
    except ValueError:
        return out
    return {"break_even_tokens_per_step": be["tokens_per_step"],
            "break_even_acceptance_length": be["acceptance_length"],
            "map_speedup": tau / be["tokens_per_step"], "drafting_share": verify / steps,
            "drafted_per_drafting_step": drafted if drafted is not None else a["k"]}


def relative_draft_cost(analysed: list[dict | None]) -> float | None:
    """Draft cost per step relative to a target forward, over analysed cells (analyse_cell):
    sum t_draft x steps / sum t_fwd(b) x steps (vLLM: the measured remainder for every
    method, n-gram included, since the acceptance/cost axis compares measured costs); None
    without an analysed cell."""
    cells = [a for a in analysed if a and a.get("t_overhead") is not None and a.get("t_fwd_b")]
    if not cells:
        return None
    cost_time = sum((a["t_draft"] if a["source"] == "reference traces" else a["t_overhead"])
                    * a["steps"] for a in cells)
    fwd_time = sum(a["t_fwd_b"] * a["steps"] for a in cells)
    return cost_time / fwd_time if fwd_time else None
