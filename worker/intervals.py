"""95% confidence intervals of a cell's figures: a two-stage cluster bootstrap over prompts,
then the passes of each drawn prompt, with bias-corrected and accelerated (BCa) bounds.

Method. A cell's throughput is a ratio of sums, tokens / seconds, over its requests, and
its acceptance length is a ratio of sums too, 1 + accepted / drafts. Neither has a simple
variance formula (numerator and denominator are correlated: a long output takes long), so
the interval comes from resampling, ``N_RESAMPLES`` times:
1. draw the cell's prompts with replacement (as many as it has): the prompt set;
2. for every drawn prompt, draw its passes with replacement (as many as it has): the timing
   noise between passes of one prompt;
then recompute the figure on the drawn requests. BCa bounds come from that distribution,
with the bias from the share of draws below the estimate and the acceleration from a
jackknife that leaves out one prompt at a time (Efron & Tibshirani 1993, 14.3 and 15.4).
The random state is fixed, so the same records always give the same interval.

Few prompts. A bootstrap over n clusters is too narrow for small n (it divides by n, not
n - 1, and uses normal quantiles): simulated paired speedups of 8, 16 and 24 prompts x 3
passes (per-prompt speedups and lengths drawn from a known population, 400 cells each)
covered the true speedup in 86.5%, 88% and 92% of cells. The bounds are therefore expanded
about the estimate, in log space, by sqrt(n / (n - 1)) x t(n - 1) / z (``expansion``; the
expanded bootstrap interval, Hesterberg 2015): 1.29 at 8 prompts, 1.08 at 24, 1.03 at 60.
The same simulation then covered 93%, 93.5% and 94%. (The request-level bootstrap this
module used before covered 69% at 24 prompts.)

Why prompts are the clusters. The protocol samples prompts; a pass repeats them. At
temperature 0 the passes of one prompt produce the same tokens, so three passes of 8 prompts
are 8 draws of the prompt set, not 24: resampling requests as if independent narrowed the
interval by up to sqrt(passes) where prompt-to-prompt variation dominates (it does, at batch
sizes >= 4). Resampling prompts first keeps what the prompt set contributes at its real
size; resampling passes inside a drawn prompt keeps the timing noise. (This two-stage scheme
counts the pass-to-pass noise slightly more than once -- it is already in the prompt totals
the first stage draws -- so it errs wide by that small term; identical passes add nothing.)

Why not scipy.stats.bootstrap. It resamples one level: the observations of each sample, or
with ``paired=True`` the same indices of several samples, and its BCa jackknife leaves out
one observation. It has no nested draw (passes inside a drawn prompt, a different number per
prompt), and its jackknife would leave out a request where the unit is a prompt. So the
draws, the percentiles and the BCa corrections are written here with numpy, as scipy's
``_bca_interval`` writes them.

Why paired by prompt. A speedup divides a drafter cell's throughput by its baseline cell's.
Both were measured on the same prompts, and, under the ``paired`` baseline, in interleaved
passes, so a prompt that is slow (long output) or a pass that ran slow (drift, load) is slow
on both sides. ``speedup_interval`` therefore draws the same prompts and, inside each, the
same passes (by repetition) on both sides: what the two sides share cancels in the ratio.
Resampling the two cells independently would count that shared variation twice and give a
wider interval than the measurement supports. When the two cells cannot be paired
(different prompts or repetitions), each is resampled on its own (wider, honest).

Within one run only. These intervals cover the prompts and passes of one run; what moves
between runs (the engine start, the machine's state) is not in them. A protocol's
between-run component (worker.calibration) is added to stored speedup intervals by the
site (leaderboard.services.runs.speedup_with_interval).

Time share. Throughput is tokens per wall second, but at batch size b > 1 requests overlap,
so a request has no wall time of its own. Each record carries ``time_share``: its pass's wall
time x its latency / the sum of latencies in the pass, so the shares of a pass add up to its
wall time and the point estimate is exactly generated tokens / wall time. This assumes that
a request's cost to the pass is proportional to its latency -- true when requests run side
by side for their whole life (every in-flight request shares the same steps); it charges a
request that waited in the queue for the time it waited, and it ignores that a step with
more sequences costs more. The interval describes the variation between requests and passes
under that charge, not the error of the charge itself.

Degenerate cells (one request, or every draw giving the same figure) have no spread to
resample: both bounds are then the point estimate. A record without a prompt id is a
cluster of its own.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from scipy.special import ndtr, ndtri

CONFIDENCE = 0.95
N_RESAMPLES = 2000
RANDOM_STATE = 20240613


def _tokens(r) -> int:
    """Generated tokens of a record: its output (after EOS), else decode_tokens."""
    if r.get("output_token_ids") is not None:
        return len(r["output_token_ids"])
    if r.get("output_tokens") is not None:
        return int(r["output_tokens"])
    return int(r["decode_tokens"])


def _arrays(records):
    tok = np.array([_tokens(r) for r in records], dtype=float)
    time = np.array([float(r["time_share"]) for r in records], dtype=float)
    return tok, time


def _ratio(num, den):
    num, den = float(np.sum(num)), float(np.sum(den))
    return num / den if den > 0 else None


# ---- prompts as clusters ----------------------------------------------------------------

class _Clusters:
    """Records arranged as prompts x pass slots. ``slots[p, j]`` is the record index of the
    j-th pass (by repetition) of prompt p, ``counts[p]`` its number of passes; slots past a
    prompt's count point at a sentinel that holds 0 (``size``), so sums over slots need no
    mask. A record without a prompt id is a prompt of its own."""

    def __init__(self, records):
        groups: dict = {}
        for i, r in enumerate(records):
            pid = r.get("prompt_id")
            groups.setdefault(("p", pid) if pid is not None else ("r", i), []).append(i)
        members = [sorted(g, key=lambda i: records[i].get("repetition", 0))
                   for g in groups.values()]
        self.size = len(records)
        self.n = len(members)
        self.width = max((len(g) for g in members), default=0)
        self.counts = np.array([len(g) for g in members], dtype=np.intp)
        self.slots = np.full((self.n, self.width), self.size, dtype=np.intp)
        for p, g in enumerate(members):
            self.slots[p, :len(g)] = g
        self.members = members

    def draws(self, rng, n_resamples, prompts_fixed=False):
        """Record indices of ``n_resamples`` two-stage draws, shape (draws, prompts x slots):
        prompts with replacement, then each drawn prompt's passes with replacement. With
        ``prompts_fixed`` every draw keeps every prompt once (the second stage alone)."""
        if prompts_fixed:
            prompts = np.broadcast_to(np.arange(self.n), (n_resamples, self.n))
        else:
            prompts = rng.integers(0, self.n, size=(n_resamples, self.n))
        passes = self.counts[prompts]                                  # (draws, n)
        if self.width == 1:
            return self.slots[prompts, 0]
        slot = (rng.random((n_resamples, self.n, self.width))
                * passes[..., None]).astype(np.intp)
        picked = self.slots[prompts[..., None], slot]
        unused = np.arange(self.width) >= passes[..., None]
        picked[unused] = self.size                                     # the zero sentinel
        return picked.reshape(n_resamples, -1)

    def sums(self, values):
        """Per-prompt sums of a per-record array (for the jackknife)."""
        return np.array([values[g].sum() for g in self.members], dtype=float)


def _drawn_totals(clusters: _Clusters, columns, rng, n_resamples, prompts_fixed=False):
    idx = clusters.draws(rng, n_resamples, prompts_fixed)
    out = []
    for values in columns:
        padded = np.append(values, 0.0)
        out.append(np.take(padded, idx).sum(axis=1))
    return out


def _bca_bounds(point, draws, jackknives):
    """BCa bounds from bootstrap draws and leave-one-prompt-out jackknife values (one array
    per independently drawn side), as scipy's ``_bca_interval`` computes them."""
    draws = draws[np.isfinite(draws)]
    if draws.size < N_RESAMPLES // 2:
        return point, point
    if draws.max() - draws.min() <= 1e-12 * max(abs(point), 1.0):
        return point, point   # a spread below float noise is no spread
    share_below = (np.count_nonzero(draws < point)
                   + 0.5 * np.count_nonzero(draws == point)) / draws.size
    share_below = min(max(share_below, 0.5 / draws.size), 1 - 0.5 / draws.size)
    z0 = float(ndtri(share_below))
    num = den = 0.0
    for jack in jackknives:
        jack = jack[np.isfinite(jack)]
        if jack.size < 2:
            continue
        u = (jack.size - 1) * (jack.mean() - jack)
        num += float(np.sum(u ** 3)) / jack.size ** 3
        den += float(np.sum(u ** 2)) / jack.size ** 2
    accel = num / (6.0 * den ** 1.5) if den > 0 else 0.0
    z_alpha = float(ndtri((1 - CONFIDENCE) / 2))
    levels = []
    for z in (z_alpha, -z_alpha):
        shifted = z0 + z
        levels.append(float(ndtr(z0 + shifted / (1 - accel * shifted))))
    lo, hi = (float(x) for x in np.quantile(draws, levels))
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return point, point
    return min(lo, point), max(hi, point)


def _cluster_interval(point, sides, statistic):
    """95% BCa two-stage cluster bootstrap bounds of ``statistic(*totals)``.

    ``sides``: [(clusters, [per-record columns])], one entry per independently drawn side
    (one for a cell or a paired speedup, whose columns share the clusters; two for an
    unpaired speedup). ``statistic`` takes every side's column totals, in order, and works
    on arrays. (point, point) where there is nothing to resample."""
    if point is None:
        return None, None
    if sum(c.size for c, _ in sides) < 2 or all(c.n < 2 and c.width < 2 for c, _ in sides):
        return point, point
    rng = np.random.default_rng(RANDOM_STATE)
    totals = []
    for clusters, columns in sides:
        totals += _drawn_totals(clusters, columns, rng, N_RESAMPLES)
    with np.errstate(all="ignore"):
        draws = np.asarray(statistic(*totals), dtype=float)
        full = [float(np.sum(col)) for _, columns in sides for col in columns]
        jackknives, start = [], 0
        for clusters, columns in sides:
            if clusters.n >= 2:
                left_out = list(full)
                for j, col in enumerate(columns):
                    left_out[start + j] = full[start + j] - clusters.sums(col)
                jackknives.append(np.asarray(statistic(*left_out), dtype=float))
            start += len(columns)
    lo, hi = _bca_bounds(point, draws, jackknives)
    return _expanded(point, lo, hi, min(c.n for c, _ in sides))


@functools.lru_cache(maxsize=256)
def expansion(n_prompts: int) -> float:
    """How much wider a bootstrap interval over ``n_prompts`` clusters is made, for the
    few prompts a cell has: sqrt(n / (n - 1)) x t(n - 1) / z at the interval's level (the
    expanded bootstrap interval, Hesterberg 2015). The bootstrap divides by n where the
    unbiased variance divides by n - 1, and uses normal quantiles where a variance from n
    prompts calls for Student's t. 1.0 below two prompts (nothing to expand by)."""
    if n_prompts < 2:
        return 1.0
    from scipy.stats import t

    q = 1 - (1 - CONFIDENCE) / 2
    return math.sqrt(n_prompts / (n_prompts - 1)) * float(t.ppf(q, n_prompts - 1)) / float(
        ndtri(q))


def _expanded(point, lo, hi, n_prompts):
    """The bounds moved away from the point by ``expansion(n_prompts)``: in log space for a
    positive figure (a ratio stays positive and keeps its skew), linearly otherwise."""
    f = expansion(n_prompts)
    if f == 1.0 or lo == hi == point:
        return lo, hi
    if point > 0 and lo > 0:
        return point * (lo / point) ** f, point * (hi / point) ** f
    return point - f * (point - lo), point + f * (hi - point)


# ---- the figures ---------------------------------------------------------------------------

def throughput(records) -> float | None:
    """Output throughput = sum(tokens) / sum(time_share) over the records (the point
    ``throughput_interval`` is centred on); None without records or time."""
    return _ratio(*_arrays(records)) if records else None


def throughput_interval(records):
    """95% interval of output throughput = sum(tokens) / sum(time_share) over the cell's
    requests (all passes): two-stage cluster bootstrap (prompts, then passes), BCa.
    (None, None) without records or time."""
    if not records:
        return None, None
    tok, time = _arrays(records)
    point = _ratio(tok, time)
    return _cluster_interval(point, [(_Clusters(records), [tok, time])],
                             lambda t, s: t / s)


def acceptance_length_interval(records):
    """95% interval of acceptance length = 1 + sum(accepted_tokens) / sum(drafts) over the
    cell's requests (end-corrected counts, as the records hold them): two-stage cluster
    bootstrap, BCa. (None, None) without drafts."""
    acc = np.array([float(r.get("accepted_tokens") or 0) for r in records], dtype=float)
    drafts = np.array([float(r.get("drafts") or 0) for r in records], dtype=float)
    if not records or drafts.sum() <= 0:
        return None, None
    point = 1.0 + float(acc.sum()) / float(drafts.sum())
    return _cluster_interval(point, [(_Clusters(records), [acc, drafts])],
                             lambda a, d: 1.0 + a / d)


def _key(r):
    return (r.get("prompt_id"), r.get("repetition", 0))


def pairs(drafter_records, baseline_records):
    """The (drafter, baseline) records matched by (prompt id, repetition), in the drafter's
    order, or None when the two cells do not hold the same keys once each."""
    d_keys = [_key(r) for r in drafter_records]
    b_map = {_key(r): r for r in baseline_records}
    if (len(set(d_keys)) != len(d_keys) or len(b_map) != len(baseline_records)
            or set(d_keys) != set(b_map)):
        return None
    return [(r, b_map[_key(r)]) for r in drafter_records]


def _speedup(d_tok, d_time, b_tok, b_time):
    return (d_tok / d_time) / (b_tok / b_time)


def speedup_interval(drafter_records, baseline_records):
    """Speedup with its 95% interval: (point, low, high).

    Speedup = (sum of drafter tokens / sum of drafter time shares) / (sum of baseline
    tokens / sum of baseline time shares). The point is that ratio on all requests. The
    interval is a two-stage cluster bootstrap paired by (prompt id, repetition): one draw
    takes the same prompts, and within each the same passes, from both cells. If the two
    cells cannot be paired (different prompt sets or repetitions, or a key twice), each
    cell is drawn on its own instead -- a wider interval that ignores what they share.
    (None, None, None) when either side has no records or no time."""
    if not drafter_records or not baseline_records:
        return None, None, None
    d_tok, d_time = _arrays(drafter_records)
    b_tok, b_time = _arrays(baseline_records)
    d_thr, b_thr = _ratio(d_tok, d_time), _ratio(b_tok, b_time)
    if d_thr is None or not b_thr:
        return None, None, None
    point = d_thr / b_thr
    matched = pairs(drafter_records, baseline_records)
    if matched is not None:
        d_tok, d_time = _arrays([d for d, _ in matched])
        b_tok, b_time = _arrays([b for _, b in matched])
        clusters = _Clusters([d for d, _ in matched])
        lo, hi = _cluster_interval(point, [(clusters, [d_tok, d_time, b_tok, b_time])],
                                   _speedup)
        return point, lo, hi
    lo, hi = _cluster_interval(point, [(_Clusters(drafter_records), [d_tok, d_time]),
                                       (_Clusters(baseline_records), [b_tok, b_time])],
                               _speedup)
    return point, lo, hi


def speedup_passes_standard_error(drafter_records, baseline_records) -> float | None:
    """Standard error of the log-speedup from the passes alone, the prompts held fixed:
    how far the speedup of the same prompts moves from pass to pass within a run (what a
    rerun on the same prompts shares with this run's interval; worker.calibration). Each
    prompt's passes are drawn with replacement (the second stage alone), the same passes on
    both sides when the cells pair, as in ``speedup_interval``; the draws' variance is
    scaled by m / (m - 1), m the mean passes per prompt (a bootstrap of m passes divides by
    m). None without an estimate: no records, or no prompt measured in two passes."""
    if not drafter_records or not baseline_records:
        return None
    matched = pairs(drafter_records, baseline_records)
    if matched is not None:
        sides = [(_Clusters([d for d, _ in matched]),
                  [*_arrays([d for d, _ in matched]), *_arrays([b for _, b in matched])])]
    else:
        sides = [(_Clusters(drafter_records), list(_arrays(drafter_records))),
                 (_Clusters(baseline_records), list(_arrays(baseline_records)))]
    if all(c.width < 2 for c, _ in sides):
        return None
    rng = np.random.default_rng(RANDOM_STATE)
    totals = []
    for clusters, columns in sides:
        totals += _drawn_totals(clusters, columns, rng, N_RESAMPLES, prompts_fixed=True)
    with np.errstate(all="ignore"):
        logs = np.log(np.asarray(_speedup(*totals), dtype=float))
    logs = logs[np.isfinite(logs)]
    if logs.size < N_RESAMPLES // 2:
        return None
    m = min(float(c.counts.mean()) for c, _ in sides if c.width >= 2)
    return float(np.std(logs, ddof=1)) * math.sqrt(m / (m - 1)) if m > 1 else None


def drift(pass_throughputs) -> float:
    """Drift between passes = (max - min) / mean of the passes' throughputs: how far the
    same cell's repetitions moved apart. 0.0 for fewer than two passes."""
    xs = [float(x) for x in pass_throughputs if x is not None]
    if len(xs) < 2:
        return 0.0
    mean = sum(xs) / len(xs)
    return (max(xs) - min(xs)) / mean if mean else 0.0
