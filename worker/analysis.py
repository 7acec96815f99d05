"""When does acceptance pay? Time breakdown, predicted and oracle bounds, the oracle
combination of drafters, the best drafter per task and batch size, crossover batch sizes,
a recommender and the acceptance/cost Pareto frontier.

Pure computations on plain dicts (no Django): a *cell* is a result row's figures (task,
batch_size, temperature, k, requests, generated_tokens, wall_seconds, drafts,
accepted_tokens, accepted_at, output_throughput, tpot_mean, speedup...) plus, where the
raw data is at hand, ``records``: its per-request records as ``worker.measure`` writes them
(output_token_ids, ttft, latency; for speculative vLLM runs ``vllm_spec_decode`` with
per_step_accepted / per_step_drafted and ``step_tokens``), or records of the reference
engine that carry ``steps`` (``StepTrace.to_dict()``). The site's selectors read these from
the storage and cache what comes out; the definitions below are shown on each protocol's
"When does it pay?" page (``definitions()``).

Definitions
-----------
Decode steps of a request. The first output token comes from the prefill (its TTFT). The
*decode tokens* are the rest; the *decode steps* are the engine steps that delivered them:
verification steps (one per entry of ``per_step_accepted``) plus non-speculative steps (the
request proposed nothing: one token), counted from ``step_tokens`` (its length less the
prefill's entry). A verification step that accepted a drafted tokens yields a + 1 tokens;
the last one may be cut at EOS or max_tokens. *Tokens per step* = decode tokens / decode
steps: the acceptance length counted over every decode step, equal to AL when every step
drafted.

Cost model (vLLM runs). vLLM's counters give no phase times, so the target's forward time
is fitted on the baseline run of the same protocol, hardware class and engine version, as a
function of the batch size b and the tokens q each sequence brings to the step:
t_fwd(b, q) = c0 + c1 * b + c_tok * b * (q - 1). Per (task, temperature), not pooled:
- c0 and c1 from decode steps (q = 1): the decode step time of the baseline cell at batch
  size b is its mean TPOT (one token per step per request), and c0 + c1 * b is fitted by
  least squares over the baseline's batch sizes (c0, c1 >= 0; with a single batch size the
  constant TPOT);
- c_tok, the cost of each further token of a sequence in one step, from prefills: the
  slope of TTFT against prompt tokens over the baseline's batch-size-1 requests (one
  prefill of the prompt per step, nothing queued before it), by least squares. Without two
  distinct prompt lengths, or with a slope <= 0, c_tok = c1 (the model is then
  t_fwd(b * q)).
A decode step of a drafter cell (b, k) costs what it ran: t_fwd(b, d + 1) for a step that
drafted d tokens (vLLM's per_step_drafted; a step cut at EOS or max_tokens was verified in
full, so it is charged its d + 1 tokens although it emitted fewer), and t_fwd(b) = t_fwd(b, 1),
a one-token forward, the baseline's decode step, for a step that drafted nothing (n-gram
without a match). c_tok is used at most t_fwd(b) / b: q tokens of one sequence never cost more
than q sequences of one token, so a step's fixed part is never negative. (Charging every
decode step a (k+1)-token verification overstated n-gram's verification wherever it did not
find a match.)

Time breakdown. vLLM cells: over the cell's requests, *prefill and waiting* = sum of TTFT,
*verification* = the target's forwards of every decode step as above, and *drafting,
rejection sampling and other* = the rest of the measured decode time (sum of latency - TTFT);
vLLM cannot separate drafting from rejection sampling and scheduling overhead, so they are
one share (for n-gram, whose proposer is a CPU lookup, it is engine overhead rather than
drafting). If the modelled forwards exceed the measured decode time they are capped there
(flag ``verification_capped``). Shares are of the summed request time, and the seconds shown
are those shares of the cell's wall time, so they add up to it. Reference-engine cells: the
measured phases of the traces (drafting, verification, sampling = rejection sampling, other),
each batch step counted once; they add up to the generation's wall time.

Draft cost per step. t_draft is, on the reference engine, the measured drafting time per batch decode
step; vLLM, the measured remainder (drafting, rejection sampling, other) per decode step for
weighted drafters (an upper bound of the drafting cost), and 0 for n-gram (no forward pass).

Predicted speedup. Every bound is a ratio of summed request times: the baseline's,
P + m x t_fwd(b) for m decode tokens, over the drafter's, P + the cost of its decode steps,
where P is the cell's measured prefill and waiting (sum of TTFT), the same on both sides.
Predicted: the drafter's own steps, each at what it verified plus t_draft. Without prefill
it is tokens per step x t_fwd(b) / (t_draft + mean forward per step): tokens per step (decode
tokens / decode steps, steps that drafted nothing included) drives it, not AL. Reference
engine: each step at the measured verification per batch step plus t_draft.

No-waste speedup. The drafter's own steps, each verifying only the tokens it emitted
(t_fwd(b, emitted)), with its draft cost. At least the predicted speedup: a step emits at
most what it verified.

Oracle speedup. Every decode step proposes exactly the tokens the target goes on to emit, up
to k, all accepted, at no draft cost: a request with m decode tokens takes ceil(m / (k+1))
steps of k + 1 tokens, the last one with the rest, each verifying what it emits. At least the
no-waste speedup: the same tokens in no more steps, a step's fixed part >= 0 and no draft
cost. So oracle >= no-waste >= predicted, by construction (reference engine: a step of q
tokens costs the measured verification scaled by t_fwd(b, q) / t_fwd(b, k + 1)).

Engine efficiency. Measured speedup / predicted speedup. Within 0.8-1.25 the model accounts
for the cell; outside it, or when the measured speedup is above the oracle
(``measured_above_oracle``: the model charges more than the forwards took, e.g. a baseline
measured apart or with drift), ``efficiency_note`` says what the model misses (for n-gram,
the engine overhead per step that the prediction does not charge; for others, time outside
the decode steps).

Oracle combine. At temperature 0, for drafters of one protocol and k on the same requests
(outputs equal to the baseline's or, without it, to each other): walking an output from the first
decode position, at each position take the largest number of tokens any drafter accepted from
there (from a step that started there, or the rest of an accepted span that covered it),
emit those plus the target's token, and step on. AL_combine = decode tokens / combined steps
is at least each drafter's tokens per step on the same requests (the furthest reach at every
step). Speedup bound = tokens x t_fwd(b) / (steps x t_fwd(b, k+1)): no draft cost, so an
upper bound of what a hybrid of these drafters could give (``oracle_combine`` also gives the
speedup with the drafters' summed draft cost per step when it is passed those costs).

Best drafter per task and batch size. The (drafter, k) with the highest measured speedup of
its cell; "baseline" when none exceeds 1.

Crossover batch size. Of a drafter at k: the smallest measured b whose speedup (all tasks: summed throughput over the baseline's) is
below 1, and the same point interpolated linearly in log2 b between the last measured b at or
above 1 and that one; none if it never falls below 1.

Recommender. A task mix w_t (normalised to sum 1) and a batch size b (the nearest measured
batch size; the lower on a tie). For each (drafter, k), time per token adds up, so the mix's
throughput is 1 / sum_t (w_t / throughput_t) (a weighted harmonic mean of its cells' measured
throughput); the baseline's the same way, and speedup = their ratio. Spread = the smallest
and largest per-task speedup over tasks with w_t > 0. The highest throughput wins, the
baseline ("no drafter") included; a (drafter, k) missing a task of the mix is left out.

Acceptance against cost (Pareto). One point per (drafter, k): x = draft cost per step relative to a target forward,
sum t_draft over steps / sum steps x t_fwd(b) over its cells (vLLM: the measured remainder
for every method, n-gram included, since this axis compares measured costs), y = AL from
summed counts. A point is on the frontier if no other has lower-or-equal cost and
higher-or-equal AL, one of them strictly.

Break-even map. With every decode step charged its draft cost t_draft plus the target's
forward of what it verified (the cost model above), a drafter at batch size b pays exactly
when its tokens per step reach tau* = delta + t_fwd(b, 1 + d) / t_fwd(b), where delta =
t_draft / t_fwd(b) is its draft cost relative to a one-token forward and d the tokens it
drafts per step on average (k when every step drafts k; s x k when a share s of the steps
drafts). Speedup = tau x t_fwd(b) / (t_draft + t_fwd(b, 1 + d)) = tau / tau*, so tau = tau* is
1.0x; the prefill and waiting time P adds to both sides of the ratio, so it does not move
the break-even (it only pulls a speedup towards 1). The acceptance length needed is AL* = 1
+ (tau* - 1) / s (= tau* when every step drafts). tau* grows by 1 per unit of delta and with
b and k (t_fwd(b, 1 + k) / t_fwd(b) = 1 + k x c_tok(b) x b / t_fwd(b), at most 1 + k); where
it exceeds 1 + k no drafter at that k can pay, since a step emits at most k + 1 tokens. Each
measured cell is placed at its draft cost as fitted (the measured remainder per step, n-gram
included, as on the acceptance-against-cost axis) and its tokens per step; its own tau*
uses its own share of drafting steps and drafted tokens, and its map speedup tau / tau* is
the decode-only prediction with that draft cost, shown beside the measured speedup.

Throughput against per-user speed. Per task, each (drafter, k) cell at batch size b is
the point (per-user speed = 1 / mean TPOT: the tokens per second one request sees after
its first token, at the cell's mean time per output token; output throughput of the cell),
and the baseline's cells the same; a drafter's line above the baseline's at the same
per-user speed pays at that operating point.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import re
from dataclasses import dataclass

from worker import metrics
from worker.methods import NO_DRAFT_COST_METHODS

log = logging.getLogger(__name__)


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
    base_thr = {(c["task"], c["batch_size"], float(c["temperature"])): c.get("output_throughput")
                for c in baseline_cells}
    return [analyse_cell(c, models.get((c["task"], float(c["temperature"]))), method,
                         base_thr.get((c["task"], c["batch_size"], float(c["temperature"]))))
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


# ----------------------------------------------------------------------------- protocol

def speedup_by_batch(cells: list[dict], baseline_cells: list[dict]) -> dict[int, float | None]:
    """{b: summed throughput over tasks / the baseline's summed throughput over the same
    (task, b, temperature) cells}, each from cells of one drafter and k. The one rule for a
    speedup over several cells (charts, "When does it pay?", the recommender): a batch size
    where any of the drafter's cells lacks its baseline cell has no speedup (None), rather
    than one over a different set of tasks."""
    out = {}
    base = {(c["task"], c["batch_size"], float(c["temperature"])): c for c in baseline_cells}
    for b in sorted({c["batch_size"] for c in cells}):
        mine = [c for c in cells if c["batch_size"] == b]
        bs = [base.get((c["task"], b, float(c["temperature"]))) for c in mine]
        if any(x is None for x in bs):
            out[b] = None
            continue
        thr = metrics.output_throughput(sum(c["generated_tokens"] for c in mine),
                                        sum(c["wall_seconds"] for c in mine))
        bthr = metrics.output_throughput(sum(x["generated_tokens"] for x in bs),
                                         sum(x["wall_seconds"] for x in bs))
        out[b] = metrics.speedup(thr, bthr)
    return out


def crossover(speedups: dict[int, float]) -> dict:
    """{"measured": the smallest measured b with speedup < 1, "interpolated": where the
    speedup crosses 1 between the last b at or above 1 and that one (linear in log2 b)}."""
    pts = sorted((b, s) for b, s in speedups.items() if s is not None)
    for i, (b, s) in enumerate(pts):
        if s < 1:
            interp = None
            if i > 0:
                b0, s0 = pts[i - 1]
                x0, x1 = math.log2(b0), math.log2(b)
                interp = 2 ** (x0 + (s0 - 1) / (s0 - s) * (x1 - x0))
            return {"measured": b, "interpolated": interp}
    return {"measured": None, "interpolated": None}


def best_matrix(entries: list[dict], tasks, batch_sizes) -> dict[tuple, dict]:
    """entries: {"drafter", "k", "task", "batch_size", "speedup"}; the best (drafter, k)
    per (task, batch size), or the baseline when no speedup exceeds 1."""
    out = {}
    for t in tasks:
        for b in batch_sizes:
            cands = [e for e in entries if e["task"] == t and e["batch_size"] == b
                     and e.get("speedup") is not None]
            best = max(cands, key=lambda e: e["speedup"], default=None)
            if best is None:
                out[(t, b)] = None
            elif best["speedup"] <= 1:
                out[(t, b)] = {"drafter": None, "k": None, "speedup": 1.0,
                               "best_drafter_speedup": best["speedup"],
                               "runner_up": best["drafter"]}
            else:
                out[(t, b)] = {"drafter": best["drafter"], "k": best["k"],
                               "speedup": best["speedup"]}
    return out


def normalise_mix(mix: dict[str, float]) -> dict[str, float]:
    total = sum(w for w in mix.values() if w > 0)
    if total <= 0:
        raise ValueError("the task mix needs a positive weight")
    return {t: w / total for t, w in mix.items() if w > 0}


def nearest(value: int, choices) -> int:
    return min(sorted(choices), key=lambda c: abs(c - value))


def recommend(cells: list[dict], baseline_cells: list[dict], mix: dict[str, float],
              batch_size: int) -> dict:
    """cells: {"drafter", "k", "task", "batch_size", "output_throughput"} of one
    temperature; baseline_cells the same without drafter/k. See the module docstring."""
    w = normalise_mix(mix)
    sizes = {c["batch_size"] for c in baseline_cells} | {c["batch_size"] for c in cells}
    if not sizes:
        return {"batch_size": None, "requested_batch_size": batch_size, "mix": w,
                "options": [], "best": None}
    b = nearest(batch_size, sizes)
    base = {c["task"]: c["output_throughput"] for c in baseline_cells if c["batch_size"] == b}

    def harmonic(thr: dict):
        if any(not thr.get(t) for t in w):
            return None
        return 1.0 / sum(wt / thr[t] for t, wt in w.items())

    base_mix = harmonic(base)
    options = []
    if base_mix:
        options.append({"drafter": None, "k": 0, "throughput": base_mix, "speedup": 1.0,
                        "speedup_min": 1.0, "speedup_max": 1.0, "per_task": {
                            t: {"throughput": base[t], "speedup": 1.0} for t in w}})
    groups: dict[tuple, dict] = {}
    for c in cells:
        if c["batch_size"] == b and c["task"] in w:
            groups.setdefault((c["drafter"], c["k"]), {})[c["task"]] = c["output_throughput"]
    for (d, k), thr in groups.items():
        mix_thr = harmonic(thr)
        if mix_thr is None:
            continue
        per_task = {t: {"throughput": thr[t],
                        "speedup": metrics.speedup(thr[t], base.get(t))} for t in w}
        sps = [v["speedup"] for v in per_task.values() if v["speedup"] is not None]
        options.append({"drafter": d, "k": k, "throughput": mix_thr,
                        "speedup": metrics.speedup(mix_thr, base_mix),
                        "speedup_min": min(sps) if sps else None,
                        "speedup_max": max(sps) if sps else None, "per_task": per_task})
    options.sort(key=lambda o: -o["throughput"])
    return {"batch_size": b, "requested_batch_size": batch_size, "mix": w,
            "options": options, "best": options[0] if options else None}


def pareto(points: list[dict]) -> list[dict]:
    """points: {"cost", "al", ...}; returns them with "frontier": True/False (points with a
    missing coordinate are never on it)."""
    out = []
    for p in points:
        if p.get("cost") is None or p.get("al") is None:
            out.append({**p, "frontier": False})
            continue
        dominated = any(q is not p and q.get("cost") is not None and q.get("al") is not None
                        and q["cost"] <= p["cost"] and q["al"] >= p["al"]
                        and (q["cost"] < p["cost"] or q["al"] > p["al"]) for q in points)
        out.append({**p, "frontier": not dominated})
    return out


def definitions() -> list[tuple[str, str]]:
    """(heading, paragraph) pairs of the module docstring's definitions, for the page."""
    text = __doc__.split("Definitions\n-----------\n", 1)[1]
    out = []
    for para in text.strip().split("\n\n"):
        para = " ".join(para.split()).replace("``", "")
        para = re.sub(r"\*(\w[^*]*?\w)\*", r"\1", para)     # *emphasis*
        head, sep, rest = para.partition(". ")
        if sep and len(head) < 60:
            out.append((head, rest))
        else:
            out.append(("", para))
    return out
