""""When does it pay?": the analyses of worker.analysis on the runs' raw per-request records
(leaderboard/records.py) for the drafter page's section, the protocol's page and its API,
and the recommender. A succeeded run never changes, so what comes out is kept in Django's
cache under the ids (and queue times) of the runs it was computed from."""
from __future__ import annotations

import hashlib
import logging
from collections import defaultdict

from django.conf import settings
from django.core.cache import cache

from worker import analysis, methods, metrics

from . import records
from .models import Protocol, Result, Run
from worker.analysis import speedups
from .selectors.pinned import baseline_runs_of, pinned_for
from .selectors.board import latest_succeeded_runs, shown_runs
from .selectors.shapes import aggregate_cells, protocol_summary


log = logging.getLogger(__name__)
ANALYSIS_VERSION = 4   # 3: steps that drafted nothing cost a one-token forward; 4: the map
ANALYSIS_CACHE_SECONDS = 7 * 24 * 3600


def _cached(key_parts, build):
    """build() once per key (Django's cache; off when SPECBOARD_PAGE_CACHE_SECONDS is 0)."""
    if settings.SPECBOARD_PAGE_CACHE_SECONDS <= 0:
        return build()
    key = "analysis:" + hashlib.sha256(repr((ANALYSIS_VERSION, key_parts)).encode()).hexdigest()
    value = cache.get(key)
    if value is None:
        value = build()
        cache.set(key, value, ANALYSIS_CACHE_SECONDS)
    return value


def baseline_for_cost_model(run_id: int | None, cells: list[dict]) -> list[dict]:
    """A baseline run's cells as the cost model reads them: the batch-size-1 cells with
    their records (the prefill slope), the others' TPOT alone."""
    if run_id is None:
        return cells
    return records.RunRecords(run_id).with_records(cells, batch_size=1)


def run_analysis(run_id: int, cells: list[dict], baseline_run_id: int | None,
                 baseline_cells: list[dict], method: str | None, cache_key=None) -> list[dict]:
    """worker.analysis.analyse_run on a run's cells and its baseline's, with the records read
    from the storage. Cached under cache_key (the runs' ids and queue times) when given:
    only for succeeded runs, whose records never change."""
    def build():
        return analysis.analyse_run_or_stored_only(
            records.RunRecords(run_id).with_records(cells),
            baseline_for_cost_model(baseline_run_id, baseline_cells), method, f"run {run_id}")
    if cache_key is None:
        return build()
    return _cached(("run", cache_key), build)


def drafter_analysis(page: dict) -> dict:
    """The drafter page's "When does it pay?" section: per cell the time breakdown, the
    measured, predicted and oracle speedups, and the crossover batch size per (k,
    temperature). No query: the page's cells and baseline cells, the records from storage."""
    run, base = page.get("run"), page.get("baseline_run")
    cells = page.get("cells") or []
    if not run or not cells:
        return {"cells": [], "curves": [], "has_records": False}
    key = None
    if run["state"] == Run.SUCCEEDED and base and base["state"] == Run.SUCCEEDED:
        key = (run["id"], str(run["queued_at"]), base["id"], str(base["queued_at"]))
    method = (page.get("drafter") or {}).get("method")
    rows = run_analysis(run["id"], cells, base["id"] if base else None,
                        page.get("baseline_cells") or [], method, key)
    curves = []
    for t in sorted({c["temperature"] for c in cells}):
        base_t = [c for c in page.get("baseline_cells") or [] if c["temperature"] == t]
        for k in sorted({c["k"] for c in cells}):
            sp = speedups.speedup_by_batch([c for c in cells if c["k"] == k
                                            and c["temperature"] == t], speedups.by_key(base_t))
            by_batch = [{"batch_size": b, "measured_speedup": sp.get(b), **_pooled(
                [a for a in rows if a["k"] == k and a["temperature"] == t
                 and a["batch_size"] == b])}
                for b in sorted({c["batch_size"] for c in cells})]
            curves.append({"k": k, "temperature": t, "by_batch": by_batch,
                           "crossover": analysis.crossover(sp)})
    return {"cells": rows, "curves": curves,
            "has_records": any(r.get("steps") for r in rows)}


def _mean(values):
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _pooled(rows: list[dict]) -> dict:
    """Measured-cost pooling of analysed cells (one drafter, k, temperature and batch size,
    several tasks): predicted and oracle speedups as ratios of summed predicted times (the
    sums keep the order oracle >= predicted of every cell)."""
    ok = [r for r in rows if r.get("predicted_time") and r.get("oracle_time")]
    if not ok:
        return {"predicted_speedup": None, "oracle_speedup": None, "shares": None}
    base_time = sum(r["baseline_time"] for r in ok)
    pred_time = sum(r["predicted_time"] for r in ok)
    oracle_time = sum(r["oracle_time"] for r in ok)
    walls = [r for r in rows if r.get("breakdown") and r.get("wall_seconds")]
    shares = None
    if walls:
        total = sum(r["wall_seconds"] for r in walls)
        phases = sorted({p for r in walls for p in r["breakdown"]})
        shares = {p: sum((r["breakdown"].get(p) or 0.0) for r in walls) / total for p in phases}
    return {"predicted_speedup": base_time / pred_time if pred_time else None,
            "oracle_speedup": base_time / oracle_time if oracle_time else None,
            "shares": shares}


def chosen_temperature(spec, temperature) -> float:
    """The temperature asked for when the protocol measures it, else its first."""
    temps = list(spec.temperatures)
    return temps[0] if temperature is None or float(temperature) not in temps \
        else float(temperature)


def protocol_pays(protocol: Protocol, temperature: float | None = None,
                  include_running: bool = False) -> dict:
    """The "When does it pay?" page and GET /api/protocols/{slug}/{version}/analysis: for
    one temperature (default the protocol's first), over each drafter's newest succeeded
    run (with include_running, for a drafter without one, its run still measuring: the
    cells it has, marked "measuring") and the baseline of its engine version: the best
    (drafter, k) per task and batch size, each (drafter, k)'s speedups by batch size
    (measured, predicted, oracle) and crossover, time shares, the oracle combination across
    drafters and the acceptance/cost points with their Pareto frontier. Two queries; the
    records from storage; cached under the runs' ids and, for a run still measuring, its
    cells done and attempts (then one query)."""
    spec = protocol.spec
    temperature = chosen_temperature(spec, temperature)
    tasks = list(spec.task_names)
    batch_sizes, ks = list(spec.batch_sizes), list(spec.ks)
    drafter_runs, baselines = shown_runs(protocol, include_running=include_running)
    key = (protocol.pk, protocol.sha256, temperature,
           sorted((r["id"], str(r["queued_at"]), r["state"], r["cells_done"], r["attempts"])
                  for r in drafter_runs),
           sorted((r["id"], str(r["queued_at"])) for r in baselines.values()))
    ids = [r["id"] for r in drafter_runs] + [r["id"] for r in baselines.values()]

    def build():
        by_run = defaultdict(list)
        for res in (Result.objects.filter(run_id__in=ids, temperature=temperature)
                    .order_by("run_id", "task", "batch_size", "k")):
            by_run[res.run_id].append(res.as_cell_dict())
        # every drafter divides by the baseline cells stored with its cells
        # (selectors.pinned; paired: its own k = 0 cells)
        pinned = pinned_for([c for cs in by_run.values() for c in cs])
        return _protocol_pays(protocol, temperature, tasks, batch_sizes, ks, drafter_runs,
                              baselines, by_run, pinned)
    out = _cached(("protocol", key), build)
    return {**out, "protocol": protocol_summary(protocol)}


def _protocol_pays(protocol, temperature, tasks, batch_sizes, ks, drafter_runs, baselines,
                   by_run, pinned) -> dict:
    entries, drafters, curves, points, combine_inputs = [], [], [], [], defaultdict(dict)
    map_points, operating = [], []
    base_outputs, base_records = {}, {}
    for r in sorted(drafter_runs, key=lambda r: r["drafter"]["name"].lower()):
        d = r["drafter"]
        mine = pinned.get(r["id"], {})
        base_ids = baseline_runs_of(mine)
        base_run = {"id": base_ids[-1]} if base_ids else None
        cells = [c for c in by_run.get(r["id"], []) if c["k"] > 0]
        base_cells = sorted(mine.values(), key=speedups.cell_key)
        # a run still measuring has no artifact yet, but each measured cell's records
        has_records = bool(r["artifact"]) or r["measuring"]
        if has_records:
            cells_r = records.RunRecords(r["id"]).with_records(cells)
            has_records = any(c["records"] for c in cells_r)
            if base_run and base_run["id"] not in base_records:  # read once, not per drafter
                base_records[base_run["id"]] = records.RunRecords(base_run["id"]).with_records(
                    base_cells)
            base_r = base_records[base_run["id"]] if base_run else []
            rows = analysis.analyse_run_or_stored_only(cells_r, base_r, d["method"],
                                                       f"run {r['id']}")
            if temperature == 0:
                for c in cells_r:
                    combine_inputs[(c["task"], c["batch_size"], c["k"])][d["slug"]] = c["records"]
                for c in base_r:
                    base_outputs.setdefault((c["task"], c["batch_size"]),
                                            metrics.lossless_outputs(c["records"]))
        else:
            rows = [None] * len(cells)
        drafters.append({"drafter": d, "run_id": r["id"], "has_records": has_records,
                         "measuring": r["measuring"], "run_url": r["url"],
                         "cells_done": r["cells_done"], "cells_total": r["cells_total"],
                         "baseline_run_id": base_run["id"] if base_run else None})
        operating += _operating_lines(d, cells)
        by_k = defaultdict(list)
        for c, a in zip(cells, rows):
            if a and a.get("map_speedup") is not None:
                map_points.append(_map_point(d, c, a))
            entries.append({"drafter": d["slug"], "k": c["k"], "task": c["task"],
                            "batch_size": c["batch_size"], "speedup": c["speedup"],
                            "measuring": r["measuring"]})
            by_k[c["k"]].append((c, a))
        for k, pairs in sorted(by_k.items()):
            kcells = [c for c, _ in pairs]
            measured = speedups.speedup_by_batch(kcells, mine)
            per_b = []
            for b in batch_sizes:
                pooled = _pooled([a for c, a in pairs if a and c["batch_size"] == b])
                per_b.append({"batch_size": b, "measured_speedup": measured.get(b), **pooled})
            al = aggregate_cells(kcells, ()).get((), {}).get("acceptance_length")
            cost = analysis.relative_draft_cost([a for _, a in pairs])
            curves.append({"drafter": d, "k": k, "by_batch": per_b, "measuring": r["measuring"],
                           "crossover": analysis.crossover(measured),
                           "mean_speedup": _mean(measured.values())})
            points.append({"drafter": d, "k": k, "cost": cost, "al": al,
                           "draft_forward": methods.get(d["method"]).draft_cost})
    matrix = analysis.best_matrix(entries, tasks, batch_sizes)
    names = {x["drafter"]["slug"]: x["drafter"] for x in drafters}
    measuring = {x["drafter"]["slug"] for x in drafters if x["measuring"]}
    matrix_rows = []
    for t in tasks:
        row = {"task": t, "cells": []}
        for b in batch_sizes:
            m = matrix.get((t, b))
            row["cells"].append(None if m is None else {
                "batch_size": b, "drafter": names.get(m["drafter"]), "k": m["k"],
                "measuring": m["drafter"] in measuring,
                "speedup": m["speedup"],
                "best_drafter_speedup": m.get("best_drafter_speedup", m["speedup"])})
        matrix_rows.append(row)
    combine, combine_models = [], {}
    # the cost model of the combination and of the map's curves: the pinned baseline cells
    # of the first drafter that has any (paired protocols have no separate baseline run)
    base_cells = next((sorted(pinned[r["id"]].values(), key=speedups.cell_key)
                       for r in drafter_runs if pinned.get(r["id"])), [])
    base_id = base_cells[0]["run_id"] if base_cells else None
    if base_cells and (combine_inputs or map_points):
        combine_models = analysis.fit_cost_models(
            base_records.get(base_id) or baseline_for_cost_model(base_id, base_cells))
    for (t, b, k), recs in sorted(combine_inputs.items()):
        model = combine_models.get((t, float(temperature)))
        try:
            res = analysis.oracle_combine(recs, k, model, b, base_outputs.get((t, b)))
        except (KeyError, TypeError, ValueError, ArithmeticError) as e:
            log.warning("oracle combination of %s b=%s k=%s failed: %r", t, b, k, e)
            res = None
        if res:
            combine.append({"task": t, "batch_size": b, "k": k, **{
                x: res[x] for x in ("requests", "tokens", "steps", "al_combine",
                                    "speedup_bound")},
                "drafters": [{"drafter": names[s], "tokens_per_step": v}
                             for s, v in sorted(res["drafter_tokens_per_step"].items())]})
    baseline_lines = []
    for run_id in sorted({c["run_id"] for cs in pinned.values() for c in cs.values()}):
        mine = [c for cs in pinned.values() for c in cs.values() if c["run_id"] == run_id]
        unique = list({speedups.cell_key(c): c for c in mine}.values())
        baseline_lines += _operating_lines(None, unique, run_id)
    return {"temperature": temperature, "tasks": tasks, "batch_sizes": batch_sizes, "ks": ks,
            "drafters": drafters, "matrix": matrix_rows, "curves": curves,
            "pareto": analysis.pareto(points), "combine": combine,
            "map": _break_even_map(tasks, batch_sizes, ks, temperature, combine_models,
                                   base_id, map_points),
            "operating": {"drafters": operating, "baselines": baseline_lines},
            "definitions": analysis.definitions(),
            "has_records": any(x["has_records"] for x in drafters)}


def _map_point(drafter: dict, cell: dict, a: dict) -> dict:
    """One measured cell on the break-even map (worker.analysis.place_on_map), with its
    measured speedup and interval from the result row."""
    return {"drafter": drafter, "task": cell["task"], "batch_size": cell["batch_size"],
            "k": cell["k"], "draft_cost": a["draft_cost_relative"],
            "tokens_per_step": a["tokens_per_step"],
            "acceptance_length": cell.get("acceptance_length"),
            "break_even_tokens_per_step": a["break_even_tokens_per_step"],
            "break_even_acceptance_length": a["break_even_acceptance_length"],
            "map_speedup": a["map_speedup"], "drafting_share": a["drafting_share"],
            "drafts_every_step": (a["drafting_share"] > 0.995
                                  and a["drafted_per_drafting_step"] > a["k"] - 0.005),
            "speedup": cell.get("speedup"),
            "speedup_low": cell.get("speedup_low"), "speedup_high": cell.get("speedup_high")}


def _break_even_map(tasks, batch_sizes, ks, temperature, models, base_run_id,
                    map_points) -> dict:
    """The break-even curves per task, batch size and k (worker.analysis.break_even_curve on
    the cost model of the reference baseline run) over the draft costs the measured cells
    span, and the measured cells placed on them."""
    out = {"baseline_run_id": base_run_id, "tasks": []}
    for task in tasks:
        model = models.get((task, float(temperature)))
        pts = [p for p in map_points if p["task"] == task]
        if model is None or not pts:
            continue
        # the drafters' range and half as much again (at least 0.25 of a forward)
        top = max(0.25, 1.5 * max(p["draft_cost"] for p in pts))
        lines = [{"batch_size": b, "k": k,
                  "points": analysis.break_even_curve(model, b, k, (0.0, top))}
                 for k in ks for b in batch_sizes]
        out["tasks"].append({"task": task, "curves": lines, "cost_model": model.to_dict(),
                             "points": sorted(pts, key=lambda p: (
                                 p["drafter"]["name"].lower(), p["k"], p["batch_size"]))})
    return out


def _operating_lines(drafter: dict | None, cells: list[dict], run_id=None) -> list[dict]:
    """Per (k, task) of one drafter's cells (or a baseline run's): the operating points by
    batch size, (per-user speed = 1 / mean TPOT, output throughput with its interval)."""
    groups = defaultdict(list)
    for c in cells:
        groups[(c["k"], c["task"])].append(c)
    out = []
    for (k, task), cs in sorted(groups.items()):
        out.append({"drafter": drafter, "k": k, "task": task, "run_id": run_id, "points": [
            {"batch_size": c["batch_size"], "per_user_speed": metrics.per_user_speed(
                c.get("tpot_mean")), "output_throughput": c.get("output_throughput"),
             "output_throughput_low": c.get("output_throughput_low"),
             "output_throughput_high": c.get("output_throughput_high"),
             "speedup": c.get("speedup")}
            for c in sorted(cs, key=lambda c: c["batch_size"])]})
    return out


def parse_mix(text: str, tasks) -> dict[str, float]:
    """"chat:0.5,code:0.5" -> {"chat": 0.5, "code": 0.5}; ValueError naming the problem."""
    mix = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        task, sep, weight = part.partition(":")
        task = task.strip()
        if task not in tasks:
            raise ValueError(f"unknown task {task!r}: the protocol's tasks are "
                             + ", ".join(tasks))
        try:
            w = float(weight) if sep else 1.0
        except ValueError:
            raise ValueError(f"the weight of {task!r} is not a number: {weight!r}") from None
        if not (w >= 0 and w < float("inf")):
            raise ValueError(f"the weight of {task!r} must be a finite number >= 0")
        mix[task] = mix.get(task, 0.0) + w
    if not mix:
        return {t: 1.0 for t in tasks}
    analysis.normalise_mix(mix)   # raises when no weight is positive
    return mix


def recommendation(protocol: Protocol, mix: dict[str, float], batch_size: int,
                   temperature: float | None = None) -> dict:
    """The (drafter, k) with the highest measured throughput for a task mix and batch size
    (worker.analysis.recommend), the baseline included. Two queries."""
    temperature = chosen_temperature(protocol.spec, temperature)
    drafter_runs, baselines = latest_succeeded_runs(protocol)
    ids = [r["id"] for r in drafter_runs] + [r["id"] for r in baselines.values()]
    rows = list(Result.objects.filter(run_id__in=ids, temperature=temperature).values(
        "run_id", "task", "batch_size", "temperature", "k", "output_throughput", "speedup",
        "baseline_result_id"))
    runs = {r["id"]: r for r in drafter_runs}
    # every drafter divides by the baseline cells stored with its cells (pinned; paired:
    # its own k = 0 cells): one query for those cells
    drafter_rows = [x for x in rows if x["run_id"] in runs and x["k"] > 0]
    pinned = pinned_for(drafter_rows)
    cells = [{**x, "drafter": runs[x["run_id"]]["drafter"]["slug"]} for x in drafter_rows
             if x["baseline_result_id"]]
    # the "baseline" option: the pinned cells of the newest drafter run with any
    newest = max((r for r in drafter_runs if pinned.get(r["id"])),
                 key=lambda r: (r["queued_at"], r["id"]), default=None)
    base_cells = list(pinned[newest["id"]].values()) if newest else []
    out = {"temperature": temperature, "protocol": protocol_summary(protocol)}
    pinned_of_drafter = {r["drafter"]["slug"]: pinned[r["id"]] for r in drafter_runs
                         if r["id"] in pinned}
    result = analysis.recommend(cells, base_cells, mix, batch_size, pinned_of_drafter)
    names = {r["drafter"]["slug"]: r["drafter"] for r in drafter_runs}
    for o in result["options"]:
        o["drafter"] = names.get(o["drafter"]) if o["drafter"] else None
        o["per_task"] = [{"task": t, **v} for t, v in o["per_task"].items()]
    out.update(result)
    out["mix"] = [{"task": t, "weight": w} for t, w in result["mix"].items()]
    return out

