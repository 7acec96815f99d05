"""The baseline cells pinned to drafter cells (``Result.baseline_result``, chosen once by
leaderboard/services/baselines.py), read for worker.analysis.speedups, the one speedup rule:
no read picks a baseline run of its own.
"""
from __future__ import annotations

from collections import defaultdict

from worker.analysis.speedups import cell_key

from ..models import Result


def pinned_for(cells: list[dict]) -> dict[int, dict[tuple, dict]]:
    """{drafter run id: {(task, batch size, temperature): the baseline cell dict its cells
    divide by}} for the cell dicts at hand (their baseline_result_id). One query."""
    return _pinned({(c["run_id"], c["baseline_result_id"]) for c in cells
                    if c["k"] > 0 and c.get("baseline_result_id")})


def _pinned(links) -> dict[int, dict[tuple, dict]]:
    by_run = defaultdict(set)
    for run_id, base_id in links:
        by_run[run_id].add(base_id)
    ids = {i for s in by_run.values() for i in s}
    cells = {r.pk: {**r.as_cell_dict(), "id": r.pk}
             for r in Result.objects.filter(pk__in=ids)} if ids else {}
    return {run_id: {cell_key(cells[i]): cells[i] for i in sorted(s) if i in cells}
            for run_id, s in by_run.items()}


def baseline_runs_of(pinned: dict[tuple, dict]) -> list[int]:
    """The baseline run ids a drafter run's pinned cells belong to."""
    return sorted({c["run_id"] for c in pinned.values()})
