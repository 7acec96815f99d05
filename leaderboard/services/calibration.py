"""Writes a protocol's between-run calibration (worker.calibration has the arithmetic).

`estimate` reads the drafters measured in two or more succeeded runs under the protocol
(the reference drafters: n-gram, a shipped head, or any drafter measured again), recomputes
each drafter cell's WITHIN-run speedup interval and its passes' standard error from its raw
records (the stored bounds may already carry an older calibration), and pools the
method-of-moments estimate of the between-run variance of the log-speedup over the cells.
`calibrate` stores it as a new ProtocolCalibration and re-divides the protocol's drafter
cells, so that every stored `speedup_low` / `speedup_high` carries it
(services.runs.speedup_with_interval applies the newest row; cells recorded later get it
as they land)."""
from __future__ import annotations

from dataclasses import dataclass

from django.db import transaction

from worker import calibration, intervals
from worker.protocol import Cell

from .. import records
from ..models import Protocol, ProtocolCalibration, Result, Run
from . import runs


@dataclass
class Change:
    """A stored speedup interval before and after the calibration was applied."""
    result: Result
    before: tuple
    after: tuple


class RecordsByRun:
    """RunRecords of several runs, each read once."""

    def __init__(self):
        self.by_run: dict[int, records.RunRecords] = {}

    def __call__(self, run_id: int) -> records.RunRecords:
        if run_id not in self.by_run:
            self.by_run[run_id] = records.RunRecords(run_id)
        return self.by_run[run_id]


def reference_runs(protocol: Protocol, drafters=None) -> dict[str, list[Run]]:
    """{drafter slug: its succeeded runs under the protocol, oldest first} for the drafters
    with at least two (only those named in `drafters`, when given)."""
    qs = (Run.objects.filter(protocol=protocol, state=Run.SUCCEEDED, drafter__isnull=False)
          .select_related("drafter").order_by("pk"))
    if drafters:
        qs = qs.filter(drafter__slug__in=list(drafters))
    by_drafter: dict[str, list[Run]] = {}
    for run in qs:
        by_drafter.setdefault(run.drafter.slug, []).append(run)
    return {slug: rs for slug, rs in by_drafter.items() if len(rs) >= 2}


def measured_within_run(run_list, read=None) -> list[calibration.Measured]:
    """The drafter cells of these runs with their within-run speedup intervals and their
    passes' standard error (prompts held fixed), recomputed from the raw records (cells
    without records or without a baseline cell are left out).
    The key is (drafter id, task, batch size, temperature, k)."""
    read = read or RecordsByRun()
    out = []
    for run in run_list:
        cells = (Result.objects.filter(run=run, k__gt=0, baseline_result__isnull=False)
                 .select_related("run", "baseline_result").order_by("pk"))
        for result in cells:
            base = result.baseline_result
            drafter_records = read(run.pk).cell(Cell.of(result))
            baseline_records = read(base.run_id).cell(Cell.of(base, k=0))
            point, low, high = runs.within_run_speedup(result, base, drafter_records,
                                                       baseline_records)
            if point is None or low is None or high is None:
                continue
            key = (run.drafter_id, result.task, result.batch_size, float(result.temperature),
                   result.k)
            out.append(calibration.Measured(
                key, run.pk, point, low, high,
                intervals.speedup_passes_standard_error(drafter_records, baseline_records)))
    return out


@dataclass
class Outcome:
    """What `calibrate` found and did: the estimate, {drafter slug: runs} it came from, the
    stored row (None on a dry run or without an estimate), the intervals it changed, and
    the held-out check (worker.calibration.held_out_rows: each task's cells against the
    other tasks' estimate)."""
    estimate: calibration.Estimate
    by_drafter: dict
    row: ProtocolCalibration | None
    changes: list
    held_out: list

    def held_out_within(self, bound: float = 1.96) -> tuple[int, int]:
        """(cell pairs with a held-out |z| <= bound, cell pairs with a held-out z)."""
        return calibration.count_within((r.z for r in self.held_out), bound)


def estimate(protocol: Protocol, drafters=None):
    """(worker.calibration.Estimate, {drafter slug: runs}, the Measured cells it came from)
    from the protocol's reference runs."""
    by_drafter = reference_runs(protocol, drafters)
    run_list = [r for rs in by_drafter.values() for r in rs]
    measured = measured_within_run(run_list)
    return calibration.between_run_variance(measured), by_drafter, measured


def apply(protocol: Protocol) -> list[Change]:
    """Re-divide every drafter cell of the protocol by its pinned baseline cell, so its
    stored interval carries the protocol's current calibration; the cells whose speedup
    or bounds changed."""
    read = RecordsByRun()
    changes = []
    cells = (Result.objects.filter(run__protocol=protocol, k__gt=0,
                                   baseline_result__isnull=False)
             .select_related("run", "run__protocol", "baseline_result").order_by("run", "pk"))
    for result in cells:
        before = (result.speedup, result.speedup_low, result.speedup_high)
        base = result.baseline_result
        runs.divide_by_baseline(result, run_records=read(result.run_id),
                                baseline_records=read(base.run_id), base=base)
        after = (result.speedup, result.speedup_low, result.speedup_high)
        if after != before:
            changes.append(Change(result, before, after))
    return changes


def inherit(protocol: Protocol, family) -> ProtocolCalibration | None:
    """Give a protocol version derived for another engine version (services.engine_versions)
    a copy of the newest calibration among `family` (its other versions): the same
    prompts, sampling and machine class, so the best prior for how far its reruns move
    until it is calibrated from its own (the engine version may change that; its own
    calibration then replaces the copy as the newest row). None when no member is
    calibrated: its intervals are then the intervals across prompts."""
    source = (ProtocolCalibration.objects.filter(protocol__in=family)
              .exclude(protocol=protocol).order_by("-created_at", "-pk").first())
    if source is None:
        return None
    row = ProtocolCalibration.objects.create(
        protocol=protocol, between_run_variance=source.between_run_variance,
        raw_variance=source.raw_variance, cells=source.cells,
        degrees_of_freedom=source.degrees_of_freedom, drafters=source.drafters,
        held_out_pairs=source.held_out_pairs, held_out_within=source.held_out_within,
        inherited_from=source.inherited_from or source)
    row.runs.set(source.runs.all())
    return row


def calibrate(protocol: Protocol, drafters=None, dry_run: bool = False) -> Outcome:
    """Estimate, store a new ProtocolCalibration and apply it (an Outcome). Nothing is
    stored when no cell was measured in two runs, or with `dry_run`."""
    est, by_drafter, measured = estimate(protocol, drafters)
    outcome = Outcome(est, by_drafter, None, [], calibration.held_out_rows(measured))
    if dry_run or not est.degrees_of_freedom:
        return outcome
    within, judged = outcome.held_out_within()
    with transaction.atomic():
        row = ProtocolCalibration.objects.create(
            protocol=protocol, between_run_variance=est.variance, raw_variance=est.raw_variance,
            cells=est.cells, degrees_of_freedom=est.degrees_of_freedom,
            drafters=sorted(by_drafter), held_out_pairs=judged, held_out_within=within)
        row.runs.set(est.run_ids)
        outcome.row, outcome.changes = row, apply(protocol)
    return outcome
