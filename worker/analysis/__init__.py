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

The package, by concern: speedups.py (the one speedup rule and its intervals),
cost_model.py (the fitted forward time, break-even and the map), bounds.py (one cell's
steps, time breakdown, bounds, efficiency; the oracle combination), recommend.py
(crossover, best drafter per task and batch size, recommender, Pareto frontier);
engine_history.py (a drafter's cells under two engine versions: changes and regression flags).
"""
from __future__ import annotations

import re

from .bounds import *  # noqa: F401,F403
from .cost_model import *  # noqa: F401,F403
from .engine_history import *  # noqa: F401,F403
from .recommend import *  # noqa: F401,F403
from .speedups import *  # noqa: F401,F403


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
