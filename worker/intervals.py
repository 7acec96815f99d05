"""95% confidence intervals of a cell's figures: bias-corrected and accelerated (BCa)
bootstrap over requests.

Method. A cell's throughput is a ratio of sums, tokens / seconds, over its requests, and
its acceptance length is a ratio of sums too, 1 + accepted / drafts. Neither has a simple
variance formula (numerator and denominator are correlated: a long output takes long), so
the interval comes from resampling: the cell's requests -- one per prompt and repetition
(pass) -- are drawn with replacement ``N_RESAMPLES`` times, the figure is recomputed on each
draw, and ``scipy.stats.bootstrap(method="BCa")`` turns that distribution into a 95% interval
corrected for the bias and skew a ratio of sums has. The random state is fixed, so the same
records always give the same interval.

Why requests. The request is the unit the protocol samples: which prompt, and the noise of
one pass. Resampling requests captures both what the prompt set contributes (a figure
measured on other prompts of the same tasks would differ) and the timing noise between
passes, because each repetition's requests are separate records.

Why paired by prompt. A speedup divides a drafter cell's throughput by its baseline cell's.
Both were measured on the same prompts, and, under the ``paired`` baseline, in interleaved
passes, so a prompt that is slow (long output) or a pass that ran slow (drift, load) is slow
on both sides. ``speedup_interval`` therefore resamples (prompt id, repetition) pairs: the
same draw takes a request from both cells, and what the two sides share cancels in the
ratio. Resampling the two cells independently would count that shared variation twice and
give a wider interval than the measurement supports. When the two cells cannot be paired
(different prompts or repetitions), they are resampled independently (wider, honest).

Time share. Throughput is tokens per wall second, but at batch size b > 1 requests overlap,
so a request has no wall time of its own. Each record carries ``time_share``: its pass's wall
time x its latency / the sum of latencies in the pass, so the shares of a pass add up to its
wall time and the point estimate is exactly generated tokens / wall time. This assumes that
a request's cost to the pass is proportional to its latency -- true when requests run side
by side for their whole life (every in-flight request shares the same steps); it charges a
request that waited in the queue for the time it waited, and it ignores that a step with
more sequences costs more. The interval describes the variation between requests and passes
under that charge, not the error of the charge itself.

Degenerate cells (one request, or every request giving the same ratio) have no spread to
resample: both bounds are then the point estimate. Repetitions of a prompt at temperature 0
produce the same tokens, so they are not independent draws of the prompt set; treating them
as requests narrows the interval somewhat where prompt-to-prompt variation dominates.
"""
from __future__ import annotations

import math
import warnings

import numpy as np

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


def _bootstrap(data, statistic, point, paired=False):
    """BCa bounds of ``statistic`` over index samples ``data``, or (point, point) where the
    data have no spread to resample (BCa is undefined there)."""
    if point is None:
        return None, None
    if any(len(d) < 2 for d in data):
        return point, point
    from scipy.stats import bootstrap

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        try:
            res = bootstrap(data, statistic, vectorized=True, paired=paired,
                            confidence_level=CONFIDENCE, n_resamples=N_RESAMPLES,
                            method="BCa", random_state=np.random.default_rng(RANDOM_STATE))
        except (ValueError, FloatingPointError, ZeroDivisionError):
            return point, point
    lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return point, point
    # BCa of a statistic that never changes returns the point (or NaN, handled above);
    # a spread below float noise is no spread.
    if hi - lo <= 1e-12 * max(abs(point), 1.0):
        return point, point
    return lo, hi


def _index(n):
    return (np.arange(n, dtype=float),)


def _take(values, idx):
    return values[idx.astype(np.intp)]


def throughput_interval(records):
    """95% BCa bootstrap interval of output throughput = sum(tokens) / sum(time_share) over
    the cell's requests (all repetitions), resampling requests. (None, None) without
    records or time."""
    if not records:
        return None, None
    tok, time = _arrays(records)
    point = _ratio(tok, time)

    def stat(idx, axis=-1):
        return _take(tok, idx).sum(axis=axis) / _take(time, idx).sum(axis=axis)

    return _bootstrap(_index(len(tok)), stat, point)


def acceptance_length_interval(records):
    """95% BCa bootstrap interval of acceptance length = 1 + sum(accepted_tokens) /
    sum(drafts) over the cell's requests (end-corrected counts, as the records hold them),
    resampling requests. (None, None) without drafts."""
    acc = np.array([float(r.get("accepted_tokens") or 0) for r in records], dtype=float)
    drafts = np.array([float(r.get("drafts") or 0) for r in records], dtype=float)
    if not records or drafts.sum() <= 0:
        return None, None
    point = 1.0 + float(acc.sum()) / float(drafts.sum())

    def stat(idx, axis=-1):
        d = _take(drafts, idx).sum(axis=axis)
        with np.errstate(all="ignore"):
            return 1.0 + _take(acc, idx).sum(axis=axis) / d

    return _bootstrap(_index(len(acc)), stat, point)


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


def speedup_interval(drafter_records, baseline_records):
    """Speedup with its 95% BCa bootstrap interval: (point, low, high).

    Speedup = (sum of drafter tokens / sum of drafter time shares) / (sum of baseline
    tokens / sum of baseline time shares). The point is that ratio on all requests. The
    interval resamples requests paired by (prompt id, repetition): one draw takes the same
    prompt and pass from both cells (same resample indices). If the two cells cannot be
    paired (different prompt sets or repetitions, or a key twice), the two cells' requests
    are resampled independently instead -- a wider interval that ignores what they share.
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

        def paired_stat(idx, axis=-1):
            with np.errstate(all="ignore"):
                return ((_take(d_tok, idx).sum(axis=axis) / _take(d_time, idx).sum(axis=axis))
                        / (_take(b_tok, idx).sum(axis=axis)
                           / _take(b_time, idx).sum(axis=axis)))

        lo, hi = _bootstrap(_index(len(matched)), paired_stat, point)
        return point, lo, hi

    def independent_stat(d_idx, b_idx, axis=-1):
        with np.errstate(all="ignore"):
            return ((_take(d_tok, d_idx).sum(axis=axis) / _take(d_time, d_idx).sum(axis=axis))
                    / (_take(b_tok, b_idx).sum(axis=axis)
                       / _take(b_time, b_idx).sum(axis=axis)))

    data = (np.arange(len(d_tok), dtype=float), np.arange(len(b_tok), dtype=float))
    lo, hi = _bootstrap(data, independent_stat, point)
    return point, lo, hi


def drift(pass_throughputs) -> float:
    """Drift between passes = (max - min) / mean of the passes' throughputs: how far the
    same cell's repetitions moved apart. 0.0 for fewer than two passes."""
    xs = [float(x) for x in pass_throughputs if x is not None]
    if len(xs) < 2:
        return 0.0
    mean = sum(xs) / len(xs)
    return (max(xs) - min(xs)) / mean if mean else 0.0
