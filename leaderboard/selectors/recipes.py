"""The recipe page: every training recipe and its learning curve under one protocol. For
each drafter trained by a recipe (here, or shipped with the repository): its data size and
time, its training time, and what its shown run measured (board.shown_runs: the newest
succeeded run, else the run still measuring) at the protocol's largest k: acceptance
length (corrected) and tokens per step per task, pooled over batch sizes, and the speedup
at the smallest and largest batch size; and beside the measured position-1 acceptance, the
drafter's top-1 agreement with the target on its own training data at the end of training
(what a greedy verifier would accept at position 1 on prompts it has seen): the gap is what
did not carry to unseen prompts. Every figure comes from the shared definitions
(shapes.aggregate_cells, speedups.pooled)."""
from __future__ import annotations

import math
from collections import defaultdict

from django.db.models import Exists, OuterRef

from worker.training.recipes import RECIPES

from ..models import Drafter, Protocol, Result
from worker.analysis import speedups
from .pinned import pinned_for
from .board import shown_runs
from .protocols import get_protocol
from .shapes import (ALL, HIDDEN_REVIEW_STATES, METHOD_LABELS, aggregate_cells, drafter_summary,
                     protocol_summary, training_summary)


def recipe_catalogue() -> list[dict]:
    """Every recipe: name, method, what it trains (its class's summary), default steps."""
    return [{"name": name, "method": cls.method, "method_label": METHOD_LABELS.get(cls.method, cls.method),
             "summary": cls.summary, "default_steps": cls.default_steps}
            for name, cls in RECIPES.items()]


def recipe_protocol(ref: str | None = None) -> Protocol | None:
    """The protocol named (slug or slug@version); without one, the newest protocol where a
    recipe-trained drafter has results, else the site's default protocol."""
    if ref:
        return get_protocol(ref)
    trained = Result.objects.filter(run__protocol=OuterRef("pk"), run__drafter__trained_by_recipe__gt="")
    newest = (Protocol.objects.select_related("target").filter(Exists(trained))
              .order_by("-created_at", "-version", "-pk").first())
    return newest or get_protocol(None)


def recipe_protocols() -> list[dict]:
    """Protocols where recipe-trained drafters have results, newest first (the page's menu)."""
    trained = Result.objects.filter(run__protocol=OuterRef("pk"), run__drafter__trained_by_recipe__gt="")
    return [protocol_summary(p) for p in Protocol.objects.select_related("target")
            .filter(Exists(trained)).order_by("-created_at", "-version", "-pk")]


def _figures(cells: list[dict], pinned: dict) -> dict:
    """Acceptance length (corrected) with its interval, tokens per step and the position-1
    acceptance alpha_1 (the share of drafts whose first token was accepted) over `cells`."""
    if not cells:
        return {"acceptance_length": None, "acceptance_length_low": None,
                "acceptance_length_high": None, "tokens_per_step": None,
                "first_position_acceptance": None}
    agg = aggregate_cells(cells, ())[()]
    p = speedups.pooled(cells, pinned)
    alphas = agg.get("per_position_acceptance") or []
    return {"acceptance_length": agg["acceptance_length"],
            "acceptance_length_low": p["acceptance_length_low"],
            "acceptance_length_high": p["acceptance_length_high"],
            "tokens_per_step": p["tokens_per_step"],
            "first_position_acceptance": alphas[0] if alphas else None}


def _speedup(cells: list[dict], pinned: dict) -> dict | None:
    if not cells:
        return None
    p = speedups.pooled(cells, pinned)
    if p["speedup"] is None:
        return None
    return {"speedup": p["speedup"], "speedup_low": p["speedup_low"],
            "speedup_high": p["speedup_high"], "half_width": speedups.half_width(p)}


def recipe_page(protocol: Protocol | None, temperature: float | None = None) -> dict:
    """Returns {"protocol", "k", "temperature", "batch_sizes" (smallest, largest), "tasks",
    "recipes": [catalogue entry + "entries" (its drafters, by data size) + "gain_per_doubling"],
    "entries": [every drafter's entry], "unmeasured": [trained drafters without a shown run
    under the protocol]}. An entry: {"drafter", "recipe", "training" (training_summary),
    "run" ({"id", "url", "measuring", "cells_done", "cells_total"}), "tasks": {task:
    figures + "speedup_small" / "speedup_large"}, "all": figures over every task}.
    Four queries."""
    catalogue = recipe_catalogue()
    if protocol is None:
        return {"protocol": None, "recipes": [dict(r, entries=[], gain_per_doubling=None)
                                               for r in catalogue],
                "entries": [], "unmeasured": [], "tasks": [], "k": None, "temperature": None,
                "batch_sizes": ()}
    spec = protocol.spec
    k = max(spec.ks)
    temps = list(spec.temperatures)
    temperature = temperature if temperature in temps else temps[0]
    small, large = min(spec.batch_sizes), max(spec.batch_sizes)
    tasks = list(spec.task_names)

    trained = list(Drafter.objects.select_related("owner", "target", "training_data")
                   .filter(target=protocol.target, trained_by_recipe__gt="")
                   .exclude(review_state__in=HIDDEN_REVIEW_STATES))
    by_slug = {d.slug: d for d in trained}
    drafter_runs, _ = shown_runs(protocol, slugs=list(by_slug)) if trained else ([], {})
    runs = {r["drafter"]["slug"]: r for r in drafter_runs}
    cells_by_run = defaultdict(list)
    for r in Result.objects.filter(run_id__in=[r["id"] for r in drafter_runs], k=k,
                                   temperature=temperature):
        cells_by_run[r.run_id].append(r.as_cell_dict())
    pinned_all = pinned_for([c for cs in cells_by_run.values() for c in cs])

    entries, unmeasured = [], []
    for d in trained:
        summary = {**drafter_summary(d), "training": training_summary(d)}
        run = runs.get(d.slug)
        if run is None:
            unmeasured.append(summary)
            continue
        cells, pinned = cells_by_run[run["id"]], pinned_all.get(run["id"], {})
        per_task = {}
        for task in tasks:
            mine = [c for c in cells if c["task"] == task]
            per_task[task] = {
                **_figures(mine, pinned),
                "speedup_small": _speedup([c for c in mine if c["batch_size"] == small], pinned),
                "speedup_large": _speedup([c for c in mine if c["batch_size"] == large], pinned)}
        entries.append({
            "drafter": summary, "recipe": d.trained_by_recipe, "training": summary["training"],
            "run": {f: run[f] for f in ("id", "url", "measuring", "cells_done", "cells_total")},
            "tasks": per_task, "all": _figures(cells, pinned),
            "task_rows": [{"task": t, **per_task[t]} for t in tasks]})
    entries.sort(key=lambda e: (e["recipe"], e["training"]["data_conversations"] or 0,
                                e["training"]["seconds"] or 0, e["drafter"]["name"]))

    by_recipe = defaultdict(list)
    for e in entries:
        by_recipe[e["recipe"]].append(e)
    known = {r["name"] for r in catalogue}
    # A recipe no longer in the code keeps its drafters on the page.
    catalogue += [{"name": name, "method": es[0]["drafter"]["method"],
                   "method_label": es[0]["drafter"]["method_label"], "summary": "",
                   "default_steps": None} for name, es in sorted(by_recipe.items()) if name not in known]
    recipes = [dict(r, entries=by_recipe.get(r["name"], []),
                    gain_per_doubling=gain_per_doubling(by_recipe.get(r["name"], [])))
               for r in catalogue]
    return {"protocol": protocol_summary(protocol), "k": k, "temperature": temperature,
            "temperatures": temps, "batch_sizes": (small, large), "tasks": tasks, "all": ALL,
            "recipes": recipes, "entries": entries, "unmeasured": unmeasured}


def gain_per_doubling(entries: list[dict]) -> float | None:
    """How much acceptance length (over all tasks) a recipe gains per doubling of its data:
    the slope of AL against log2(conversations), least squares over its drafters; None below
    two data sizes."""
    pts = [(math.log2(e["training"]["data_conversations"]), e["all"]["acceptance_length"])
           for e in entries if (e["training"]["data_conversations"] or 0) > 0
           and e["all"]["acceptance_length"] is not None]
    if len({x for x, _ in pts}) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    return (sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts))
