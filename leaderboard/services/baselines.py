"""The one rule for which baseline cell a drafter cell's speedup divides by.

Same protocol version (so the same prompts, sampling and hardware class), same engine
version, same task, batch size and temperature, k = 0, and:

- ``paired`` protocols (``ProtocolSpec.baseline``): the k = 0 cell of the SAME run, measured
  on the same worker, interleaved with the drafter's passes;
- ``shared`` protocols: the cell of the newest *succeeded* baseline run (no drafter) at the
  time the cell is divided. Once stored, the figure is pinned: ``Result.baseline_result`` is
  what every page, the API and the export follow, so re-measuring a shared baseline never
  changes a stored speedup. ``manage.py repin_speedups`` re-divides chosen runs by the rule
  as it stands now (an explicit act, written on the protocol page).

`baseline_cell_for` is the only function that picks; everything else reads the stored key
(selectors: `pinned_baseline_cells`). The rule in words, as pages and the API show it, is
leaderboard/baseline_rule.py."""
from __future__ import annotations

from ..models import Result, Run

PAIRED, SHARED = "paired", "shared"


def baseline_cell_for(result: Result, run: Run | None = None) -> Result | None:
    """The baseline cell `result` (a drafter cell, k > 0) divides by under the rule, or None
    when it is not measured (yet). `run` is result.run when the caller has it loaded."""
    run = run or result.run
    match = dict(task=result.task, batch_size=result.batch_size,
                 temperature=result.temperature, k=0)
    if run.protocol.spec.baseline == PAIRED:
        return Result.objects.filter(run_id=run.pk, **match).first()
    return (Result.objects.filter(
        run__protocol_id=run.protocol_id, run__drafter__isnull=True, run__hardware=run.hardware,
        run__engine_version=run.engine_version, run__state=Run.SUCCEEDED, **match)
        .select_related("run").order_by("-run__queued_at", "-run_id").first())


def shared_baseline_exists(protocol, engine_version: str | None = None) -> bool:
    """Whether a shared baseline run that is succeeded, or queued/running, exists for the
    protocol's hardware class (and this engine version when one is given; a queued run has
    no engine version yet, so it counts for any)."""
    qs = Run.objects.filter(protocol=protocol, drafter__isnull=True, hardware=protocol.hardware,
                            state__in=[Run.SUCCEEDED, Run.QUEUED, Run.RUNNING])
    if engine_version:
        from django.db.models import Q
        qs = qs.filter(Q(engine_version=engine_version) | Q(state=Run.QUEUED)
                       | Q(engine_version=""))
    return qs.exists()
