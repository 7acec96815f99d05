"""Across cells of a protocol: crossover batch size, the best drafter per task and
batch size, the recommender and the acceptance/cost Pareto frontier (the definitions are in
worker/analysis/__init__.py)."""
from __future__ import annotations

import math

from worker import metrics


# ----------------------------------------------------------------------------- protocol

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
              batch_size: int, pinned: dict[str, dict[tuple, dict]] | None = None) -> dict:
    """cells: {"drafter", "k", "task", "batch_size", "temperature", "output_throughput"} of
    one temperature; baseline_cells the same without drafter/k (the "no drafter" option).
    Each drafter's speedups divide by its own pinned baseline cells (the one rule,
    speedups.py): pinned {drafter: {cell_key: baseline cell}}; a drafter missing from it
    divides by baseline_cells. See the package docstring."""
    w = normalise_mix(mix)
    sizes = {c["batch_size"] for c in baseline_cells} | {c["batch_size"] for c in cells}
    if not sizes:
        return {"batch_size": None, "requested_batch_size": batch_size, "mix": w,
                "options": [], "best": None}
    b = nearest(batch_size, sizes)

    def at_b(cells_of_one):   # {task: throughput} at the chosen batch size
        return {c["task"]: c["output_throughput"] for c in cells_of_one if c["batch_size"] == b}

    def harmonic(thr: dict):
        if any(not thr.get(t) for t in w):
            return None
        return 1.0 / sum(wt / thr[t] for t, wt in w.items())

    options = []
    base = at_b(baseline_cells)
    if harmonic(base):
        options.append({"drafter": None, "k": 0, "throughput": harmonic(base), "speedup": 1.0,
                        "speedup_min": 1.0, "speedup_max": 1.0, "per_task": {
                            t: {"throughput": base[t], "speedup": 1.0} for t in w}})
    groups: dict[tuple, dict] = {}
    for c in cells:
        if c["batch_size"] == b and c["task"] in w:
            groups.setdefault((c["drafter"], c["k"]), {})[c["task"]] = c
    for (d, k), mine in groups.items():
        thr = {t: c["output_throughput"] for t, c in mine.items()}
        mix_thr = harmonic(thr)
        if mix_thr is None:
            continue
        own = (pinned or {}).get(d)
        base_d = at_b(own.values()) if own is not None else base
        # one cell's speedup is its stored figure (speedups.py) where the cell has one
        per_task = {t: {"throughput": thr[t], "speedup": mine[t].get("speedup") or
                        metrics.speedup(thr[t], base_d.get(t))} for t in w}
        sps = [v["speedup"] for v in per_task.values() if v["speedup"] is not None]
        options.append({"drafter": d, "k": k, "throughput": mix_thr,
                        "speedup": metrics.speedup(mix_thr, harmonic(base_d)),
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
