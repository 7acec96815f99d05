"""A drafter's cells under two engine versions: each cell's change and its regression flags.

Pure computations on plain dicts (no Django). A *cell* is a result row's figures (task,
batch_size, temperature, k, acceptance_length with acceptance_length_low/high,
engine_acceptance_length, decode_tokens, decode_steps or tokens_per_step,
per_position_acceptance, speedup with speedup_low/high, drafts, draft_tokens,
accepted_tokens, accepted_at, repetitions) plus, where the raw data is at hand, ``records``:
its per-request records as ``worker.cell`` writes them (prompt_id, repetition,
output_token_ids, step_tokens).

Two rules, one per kind of figure (docs/measurement.md, "Across engine versions"):
- Timing and sampled figures (speedup, acceptance length) carry 95% intervals. A change is
  flagged when it lies outside both intervals: the new value outside the old interval AND
  the old value outside the new one. It is not flagged when either interval covers the
  other's value, and not judged when an interval is missing. A speedup is judged only where
  both cells' intervals carry their protocol's between-run variance
  (``speedup_between_run_variance``, set once the protocol is calibrated, or inherited when
  it was derived): the two versions are two runs, and an interval of one run's prompts and
  passes does not cover how far a rerun moves (docs/measurement.md, "Two engine versions,
  measured").
- At temperature 0 drafting and acceptance are greedy, hence deterministic on one engine
  version: the same prompts give the same drafts, accepted the same way, in every pass. So
  the counts (drafts, draft_tokens, accepted_tokens, accepted_at) are compared exactly, and
  from the records, per prompt, the output tokens and the tokens each engine step delivered
  (``step_tokens``). Any difference is flagged: the engine itself changed what is drafted or
  accepted, however small the change in the figures. Cells at temperature > 0 are sampled and
  never compared exactly.
"""
from __future__ import annotations

import re

from worker import metrics
from worker.protocol import cell_key

__all__ = ["cell_key", "version_key", "interval_verdict", "compare_cells", "compare_versions",
           "FLAGGED", "WITHIN", "NOT_JUDGED", "NOT_CALIBRATED"]

FLAGGED, WITHIN, NOT_JUDGED = "flagged", "within", "not judged"
COUNT_FIELDS = ("drafts", "draft_tokens", "accepted_tokens", "accepted_at")
# Figures compared with their intervals: name -> (low field, high field), None: no interval
# (shown with its change, never judged).
FIGURES = {
    "engine_acceptance_length": None,
    "acceptance_length": ("acceptance_length_low", "acceptance_length_high"),
    "tokens_per_step": None,
    "speedup": ("speedup_low", "speedup_high"),
}
# The figures judged only where both cells' intervals carry the between-run variance.
RERUN_JUDGED = {"speedup": "speedup_between_run_variance"}
NOT_CALIBRATED = ("not calibrated between runs: one run's interval does not cover how far a "
                  "rerun moves (calibrate the protocol: bench/rerun.py, then "
                  "manage.py calibrate_protocol)")
FIGURE_LABELS = {
    "engine_acceptance_length": "acceptance length (engine)",
    "acceptance_length": "acceptance length",
    "tokens_per_step": "tokens per step",
    "speedup": "speedup",
}


def version_key(version: str):
    """A key that orders engine versions as versions (0.9.0 < 0.10.0): packaging's Version
    where packaging is installed and the string parses, else a tuple of the numbers in it."""
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:  # pragma: no cover - packaging ships with pip's environments
        Version = None
    if Version is not None:
        try:
            return (0, Version(version), ())
        except InvalidVersion:
            pass
    return (1, None, tuple(int(n) for n in re.findall(r"\d+", version or "")))




def tokens_per_step_of(c: dict):
    """Tokens per step of a cell: its stored figure, else decode tokens / decode steps
    (worker.metrics.tokens_per_step), else None."""
    if c.get("tokens_per_step") is not None:
        return c["tokens_per_step"]
    if c.get("decode_tokens") is None or c.get("decode_steps") is None:
        return None
    return metrics.tokens_per_step(c["decode_tokens"], c["decode_steps"])


def interval_verdict(old, old_low, old_high, new, new_low, new_high) -> str:
    """FLAGGED when the change lies outside both intervals (the new value outside the old
    interval and the old value outside the new one), WITHIN when either interval covers the
    other's value, NOT_JUDGED when a value or an interval is missing."""
    if None in (old, old_low, old_high, new, new_low, new_high):
        return NOT_JUDGED
    new_outside_old = not old_low <= new <= old_high
    old_outside_new = not new_low <= old <= new_high
    return FLAGGED if new_outside_old and old_outside_new else WITHIN


def _figure(name: str, old: dict, new: dict) -> dict:
    bounds = FIGURES[name]
    get = tokens_per_step_of if name == "tokens_per_step" else (lambda c: c.get(name))
    a, b = get(old), get(new)
    out = {"figure": name, "label": FIGURE_LABELS[name], "old": a, "new": b,
           "change": b - a if a is not None and b is not None else None,
           "relative": b / a - 1 if a and b is not None else None,
           "old_low": None, "old_high": None, "new_low": None, "new_high": None,
           "verdict": NOT_JUDGED, "reason": "" if bounds is not None else "no interval",
           "uncalibrated": False}
    if bounds is not None:
        lo, hi = bounds
        out.update(old_low=old.get(lo), old_high=old.get(hi),
                   new_low=new.get(lo), new_high=new.get(hi))
        rerun = RERUN_JUDGED.get(name)
        if rerun and a is not None and b is not None and (
                old.get(rerun) is None or new.get(rerun) is None):
            out.update(reason=NOT_CALIBRATED, uncalibrated=True)
        else:
            out["verdict"] = interval_verdict(a, out["old_low"], out["old_high"],
                                              b, out["new_low"], out["new_high"])
            if out["verdict"] == NOT_JUDGED:
                out["reason"] = "a value or an interval is missing"
    return out


def _per_position(old: dict, new: dict) -> list[dict]:
    a = list(old.get("per_position_acceptance") or [])
    b = list(new.get("per_position_acceptance") or [])
    out = []
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else None
        y = b[i] if i < len(b) else None
        out.append({"position": i + 1, "old": x, "new": y,
                    "change": y - x if x is not None and y is not None else None})
    return out


def _counts_differ(old: dict, new: dict) -> list[str]:
    """The count fields that differ. Counts sum over a cell's passes, so cells measured in
    different numbers of passes (adaptive protocols) are compared per pass, exactly: old
    count x new passes against new count x old passes."""
    r_old, r_new = old.get("repetitions") or 1, new.get("repetitions") or 1
    differ = []
    for f in COUNT_FIELDS:
        a, b = old.get(f), new.get(f)
        if f == "accepted_at":
            a, b = list(a or []), list(b or [])
            n = max(len(a), len(b))
            a, b = a + [0] * (n - len(a)), b + [0] * (n - len(b))
            if [x * r_new for x in a] != [y * r_old for y in b]:
                differ.append(f)
        elif (a or 0) * r_new != (b or 0) * r_old:
            differ.append(f)
    return differ


def _first_step_difference(old: dict, new: dict):
    """The first engine step (0: the prefill's token) whose tokens differ between two
    records of one prompt, or None when they agree. A step differs when it delivered a
    different number of tokens or different tokens; without step_tokens on both sides, the
    output tokens are compared and the step is None."""
    out_a, out_b = list(old.get("output_token_ids") or []), list(new.get("output_token_ids")
                                                                  or [])
    steps_a, steps_b = old.get("step_tokens"), new.get("step_tokens")
    if steps_a is None or steps_b is None:
        return None if out_a == out_b else {"step": None}
    pos = 0
    for i in range(max(len(steps_a), len(steps_b))):
        n_a = steps_a[i] if i < len(steps_a) else None
        n_b = steps_b[i] if i < len(steps_b) else None
        if n_a != n_b or out_a[pos:pos + n_a] != out_b[pos:pos + n_b]:
            return {"step": i}
        pos += n_a
    return None if out_a == out_b else {"step": len(steps_a)}


def _compare_records(old_records: list[dict], new_records: list[dict]) -> dict:
    """Per prompt (the repetition the lossless check compares), the outputs and the tokens of
    each engine step: how many prompts differ of those on both sides, and the first."""
    rep = metrics.LOSSLESS_REPETITION
    a = {r["prompt_id"]: r for r in old_records if r.get("repetition", 0) == rep}
    b = {r["prompt_id"]: r for r in new_records if r.get("repetition", 0) == rep}
    both = [p for p in a if p in b]
    differing = []
    for p in both:
        where = _first_step_difference(a[p], b[p])
        if where is not None:
            differing.append({"prompt_id": p, **where})
    return {"prompts_compared": len(both), "prompts_differ": len(differing),
            "first": differing[0] if differing else None,
            "prompts_unmatched": len(set(a) ^ set(b))}


def _exact(old: dict, new: dict) -> dict:
    """The exact comparison of a greedy cell's counts and, where both sides have records,
    of its drafts per prompt."""
    out = {"compared": False, "reason": "", "counts_differ": [], "records_compared": False,
           "prompts_compared": 0, "prompts_differ": 0, "first": None, "prompts_unmatched": 0}
    if float(old["temperature"]) > 0 or float(new["temperature"]) > 0:
        out["reason"] = "temperature > 0: sampled, compared with intervals only"
        return out
    out["compared"] = True
    out["counts_differ"] = _counts_differ(old, new)
    if old.get("records") and new.get("records"):
        out.update(_compare_records(old["records"], new["records"]), records_compared=True)
    else:
        out["reason"] = "no per-request records on both sides: counts compared only"
    return out


def compare_cells(old: dict, new: dict) -> dict:
    """One cell's change from `old` to `new` (the same task, batch size, temperature and k
    under two engine versions): its figures with their verdicts, per-position acceptance,
    the exact comparison (temperature 0) and the flags in words."""
    figures = [_figure(name, old, new) for name in FIGURES]
    exact = _exact(old, new)
    flags = [f"{f['label']} changed outside both intervals ({f['old']:.3f} -> {f['new']:.3f})"
             for f in figures if f["verdict"] == FLAGGED]
    if exact["counts_differ"]:
        flags.append("acceptance counts differ (" + ", ".join(exact["counts_differ"]) + ")")
    if exact["prompts_differ"]:
        first = exact["first"]
        where = f", step {first['step']}" if first["step"] is not None else ""
        flags.append(f"drafts differ on {exact['prompts_differ']} of "
                     f"{exact['prompts_compared']} prompts (first: prompt "
                     f"{first['prompt_id']}{where})")
    task, b, t, k = cell_key(old)
    return {"task": task, "batch_size": b, "temperature": t, "k": k,
            "figures": figures, "by_figure": {f["figure"]: f for f in figures},
            "per_position": _per_position(old, new), "exact": exact,
            "flags": flags, "flagged": bool(flags)}


def compare_versions(old_cells: list[dict], new_cells: list[dict]) -> dict:
    """Every cell both versions measured, compared, and the drafter-level summary:
    {"cells": [...], "only_old": [keys], "only_new": [keys], "summary": {"cells",
    "flagged_cells", "flagged", "worst_speedup_change" (the most negative relative speedup
    change, or the smallest rise), "worst_speedup_cell", "speedup_drop" (max(0, -worst)),
    "acceptance_length_old", "acceptance_length_new" (means over the cells both measured),
    "acceptance_length_change"}}."""
    a = {cell_key(c): c for c in old_cells}
    b = {cell_key(c): c for c in new_cells}
    cells = [compare_cells(a[key], b[key]) for key in sorted(a) if key in b]
    speed = [(c["by_figure"]["speedup"]["relative"], c) for c in cells
             if c["by_figure"]["speedup"]["relative"] is not None]
    worst = min(speed, key=lambda x: x[0]) if speed else None
    al = [(c["by_figure"]["acceptance_length"]["old"], c["by_figure"]["acceptance_length"]["new"])
          for c in cells if c["by_figure"]["acceptance_length"]["change"] is not None]
    al_old = sum(x for x, _ in al) / len(al) if al else None
    al_new = sum(y for _, y in al) / len(al) if al else None
    flagged = sum(c["flagged"] for c in cells)
    return {
        "cells": cells,
        "only_old": sorted(key for key in a if key not in b),
        "only_new": sorted(key for key in b if key not in a),
        "summary": {
            "cells": len(cells), "flagged_cells": flagged, "flagged": flagged > 0,
            "worst_speedup_change": worst[0] if worst else None,
            "worst_speedup_cell": ({f: worst[1][f] for f in ("task", "batch_size",
                                                              "temperature", "k")}
                                   if worst else None),
            "speedup_drop": max(0.0, -worst[0]) if worst else 0.0,
            "acceptance_length_old": al_old, "acceptance_length_new": al_new,
            "acceptance_length_change": al_new - al_old if al else None,
        },
    }
