"""Run service: queue, claim, measure, record cells, finish, cancel. The Celery task
(leaderboard/tasks.py) calls `execute_run`; so does `manage.py measure --sync`.

execute_run(run_id): claim the run (compare-and-set), build the job from the database,
measure in a child process (worker/runner.py), write each cell as soon as it is measured,
honour the cancel flag between cells, finish the run once. A redelivered message for a run
that another live worker holds, or that is finished, does nothing.

Guarantees: a run is claimed by a compare-and-set update (a duplicate delivery is a no-op);
each cell is an upsert on its unique key (a redelivery never doubles a row); a run whose
worker died is taken over and measures only its missing cells.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import IntegrityError, InterfaceError, OperationalError, connection, transaction
from django.db.models import F, Q
from django.db.models.functions import Coalesce
from django.utils import timezone

from worker import analysis, metrics
from worker.measure import DrafterSpec, MeasureJob, PromptItem
from worker.methods import check_supported
from worker.protocol import Cell, cell_key
from worker.runner import ChildFailed, log_tail, run_job_in_child

from .. import records
from ..celery import MEASURE_RUN, app
from ..queues import start_worker_command
from ..models import Drafter, Prompt, Protocol, ProtocolCalibration, Result, Run
from . import workers
from .baselines import PAIRED, baseline_cell_for, shared_baseline_exists

log = logging.getLogger(__name__)


class RunError(Exception):
    """A run cannot be measured; the message says why and what to fix."""


# ---- queueing ----------------------------------------------------------------------

def enqueue(run: Run, countdown: float | None = None):
    """Send the run to its queue (Run.queue: its protocol's hardware class, engine and engine
    version) once the transaction commits (by task name: leaderboard/tasks.py defines the
    task)."""
    transaction.on_commit(lambda: app.send_task(MEASURE_RUN, args=[run.pk], queue=run.queue,
                                                countdown=countdown))


def cells_for(protocol: Protocol, drafter: Drafter | None):
    """The cells a run measures (ProtocolSpec.run_cells): under a paired protocol a drafter
    run measures its k = 0 cells too."""
    return protocol.spec.run_cells(drafter.method if drafter is not None else "baseline")


def measurements_total(protocol: Protocol, drafter: Drafter | None) -> int:
    """A run's cell measurements (``Run.cells_total``): every cell once per engine start
    (ProtocolSpec.engine_starts: a cell is stored after each start's round)."""
    return len(cells_for(protocol, drafter)) * protocol.spec.starts


def measurements_done(run: Run) -> int:
    """The run's stored cell measurements (``Run.cells_done``): each stored cell counts the
    engine starts its passes came from, at most the protocol's (one each before v4)."""
    starts = run.protocol.spec.starts
    rows = Result.objects.filter(run=run)
    if starts == 1:
        return rows.count()
    return sum(min(n or 1, starts) for n in rows.values_list("engine_starts", flat=True))


def needs_shared_baseline(protocol: Protocol, drafter: Drafter | None,
                          engine_version: str | None = None) -> bool:
    """A drafter run under a shared protocol needs a baseline run (succeeded, queued or
    running) of its hardware class (and engine version, once it is known); a paired one
    measures its own."""
    return (drafter is not None and protocol.spec.baseline != PAIRED
            and not shared_baseline_exists(protocol, engine_version))


def queue_run(protocol: Protocol, drafter: Drafter | None, send=True) -> Run:
    """Queue a run. A drafter run under a shared protocol makes sure a baseline run exists
    (queued first, so a single worker measures it first; speedups of cells measured before
    it are filled in when it finishes); under a paired protocol it measures its own."""
    if drafter is not None and drafter.target_id != protocol.target_id:
        raise RunError(f"drafter {drafter.slug} is for target {drafter.target.slug}, but "
                       f"protocol {protocol} measures {protocol.target.slug}")
    with transaction.atomic():
        if needs_shared_baseline(protocol, drafter):
            queue_run(protocol, None, send=send)
        run = Run.objects.create(drafter=drafter, protocol=protocol, hardware=protocol.hardware,
                                 queue=protocol.spec.queue,
                                 cells_total=measurements_total(protocol, drafter))
        if send:
            enqueue(run)
    return run


def queue_if_no_run(protocol: Protocol, drafter: Drafter, send=True) -> Run | None:
    """Queue ``drafter`` under ``protocol`` unless it has a run there in any state (a failed
    one is for a person to look at, not to repeat unasked). Returns the new run or None."""
    if protocol.runs.filter(drafter=drafter).exists():
        return None
    return queue_run(protocol, drafter, send=send)


def request_cancel(run: Run) -> str:
    """A queued run is cancelled at once; a running one between two cells."""
    if Run.objects.filter(pk=run.pk, state=Run.QUEUED).update(
            state=Run.CANCELLED, cancel_requested=True, finished_at=timezone.now()):
        return Run.CANCELLED
    Run.objects.filter(pk=run.pk, state=Run.RUNNING).update(cancel_requested=True)
    run.refresh_from_db()
    return run.state


# ---- claiming ----------------------------------------------------------------------

def worker_host():
    return f"{socket.gethostname()}:{os.getpid()}"


def claim(run_id: int, host: str) -> Run | None:
    """Compare-and-set: a queued run, or a running one whose worker stopped sending
    heartbeats, becomes ours. Returns None if someone else has it or it is finished."""
    now = timezone.now()
    stale = now - timedelta(seconds=settings.RUN_STALE_AFTER_S)
    if Run.objects.filter(pk=run_id, state=Run.QUEUED, cancel_requested=True).update(
            state=Run.CANCELLED, finished_at=now):
        return None
    claimed = Run.objects.filter(pk=run_id, cancel_requested=False).filter(
        Q(state=Run.QUEUED) | Q(state=Run.RUNNING, heartbeat_at__lt=stale)
    ).update(state=Run.RUNNING, worker_host=host, heartbeat_at=now, attempts=F("attempts") + 1,
             started_at=Coalesce(F("started_at"), now), error="", eta_seconds=None)
    return Run.objects.select_related("protocol", "protocol__target", "drafter").get(
        pk=run_id) if claimed else None


def stale_runs(queues):
    """Running runs on these queues whose worker died (no heartbeat for a while)."""
    stale = timezone.now() - timedelta(seconds=settings.RUN_STALE_AFTER_S)
    return Run.objects.filter(state=Run.RUNNING, queue__in=queues, heartbeat_at__lt=stale)


# ---- building the job ----------------------------------------------------------------

def prompts_for(protocol: Protocol):
    out = {}
    for task in protocol.spec.tasks:
        qs = Prompt.objects.filter(prompt_set__slug=task.prompt_set)
        first = qs.select_related("prompt_set").first()
        if first is None:
            raise RunError(f"task {task.task}: prompt set {task.prompt_set!r} is not imported; "
                           "run `manage.py import_prompts` or `manage.py setup_demo`")
        if first.prompt_set.source_sha256 != task.prompt_set_sha256:
            raise RunError(f"task {task.task}: prompt set {task.prompt_set!r} was imported from "
                           "a different file than the protocol names (sha256 differs)")
        try:
            chosen = protocol.prompts_of_task(task, qs)
        except ValueError as e:
            raise RunError(f"task {task.task}: {e}") from None
        out[task.task] = [PromptItem(id=p.external_id, turns=p.turns) for p in chosen]
    return out


def drafter_folder(drafter: Drafter) -> str:
    """The drafter's files as a checkpoint folder on this worker (copied once from the
    storage, which may be a shared volume or an object store)."""
    folder = settings.DATA_DIR / "drafters" / (drafter.content_sha256 or f"id{drafter.pk}")
    done = folder / ".complete"
    if not done.exists():
        folder.mkdir(parents=True, exist_ok=True)
        for f in drafter.files.all():
            dest = folder / f.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            with f.file.open("rb") as src, open(dest, "wb") as out:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    out.write(chunk)
        done.touch()
    return str(folder)


def build_job(run: Run):
    protocol, drafter = run.protocol, run.drafter
    if drafter is None:
        spec = DrafterSpec(method="baseline")
    else:
        check_supported(drafter.method, run.hardware)
        path = drafter_folder(drafter) if drafter.files.exists() else None
        spec = DrafterSpec(method=drafter.method, path=path, params=dict(drafter.params))
    # Cells measured in full are skipped on resume; one stored after an earlier engine
    # start's round only (ProtocolSpec.engine_starts) is measured again over every start.
    starts = protocol.spec.starts
    done = frozenset(
        cell_key(r)
        for r in Result.objects.filter(run=run).values("task", "batch_size", "temperature", "k",
                                                       "engine_starts")
        if (r["engine_starts"] or 1) >= starts)
    target = protocol.target
    if not target.path or not Path(target.path).is_dir():
        raise RunError(f"target {target.slug}: checkpoint folder {target.path!r} is missing on "
                       f"this worker ({worker_host()}); run `manage.py setup_demo` here")
    return MeasureJob(spec=protocol.spec, target_path=target.path, drafter=spec,
                      prompts=prompts_for(protocol), skip=done,
                      between_run_variance=ProtocolCalibration.variance_for(protocol.pk))


# ---- recording -----------------------------------------------------------------------

def divide_by_baseline(result: Result, outputs: dict | None = None, run_records=None,
                       baseline_records=None, base: Result | None = None) -> bool:
    """Divide a drafter cell by its baseline cell (services.baselines.baseline_cell_for, or
    `base` when given) and store the pinned figures: baseline_result, speedup with its 95%
    interval (worker.intervals.speedup_interval over the two cells' requests) and, at
    temperature 0, the lossless share. `outputs` are this cell's outputs by prompt id;
    `run_records` / `baseline_records` the two runs' RunRecords when the caller has them.
    False when there is no baseline cell yet."""
    run = result.run
    base = base or baseline_cell_for(result, run)
    if base is None:
        return False
    run_records = run_records if run_records is not None and run_records.run_id == run.pk \
        else records.RunRecords(run.pk)
    if baseline_records is None or baseline_records.run_id != base.run_id:
        baseline_records = (run_records if base.run_id == run.pk
                            else records.RunRecords(base.run_id))
    cell, base_cell = Cell.of(result), Cell.of(base, k=0)
    result.baseline_result = base
    for name, value in speedup_with_interval(result, base, run_records.cell(cell),
                                             baseline_records.cell(base_cell)).items():
        setattr(result, name, value)
    if result.temperature == 0:
        if outputs is None:
            outputs = run_records.outputs(cell)
        result.lossless_share = metrics.lossless_share(outputs, baseline_records.outputs(base_cell))
    result.save(update_fields=["baseline_result", *SPEEDUP_FIELDS, "lossless_share"])
    return True


def within_run_speedup(result: Result, base: Result, drafter_records, baseline_records):
    """(speedup, low, high) of one run: worker.intervals.speedup_interval over the requests
    of both cells (paired by prompt id and repetition). Rows measured before protocol v2
    have no per-request time share: their speedup is the ratio of throughputs, without
    interval."""
    if drafter_records and baseline_records and all(
            "time_share" in r for r in (*drafter_records, *baseline_records)):
        from worker import intervals
        return tuple(intervals.speedup_interval(drafter_records, baseline_records))
    return metrics.speedup(result.output_throughput, base.output_throughput), None, None


# The stored speedup figures of a drafter cell (speedup_with_interval; Result's comments).
SPEEDUP_FIELDS = ("speedup", "speedup_low", "speedup_high", "speedup_prompts_low",
                  "speedup_prompts_high", "speedup_passes_se", "speedup_between_run_variance")


def speedup_with_interval(result: Result, base: Result, drafter_records, baseline_records,
                          variance: float | None = None) -> dict:
    """{SPEEDUP_FIELDS: value} as stored, with the protocol's between-run variance of the
    log-speedup (`variance`, else the newest ProtocolCalibration; None before the protocol
    is calibrated):
    - the interval across prompts: the within-run interval (`within_run_speedup`) widened
      by the variance (worker.calibration.widen);
    - speedup_low/high, the one the leaderboard ranks by: the rerun interval, the passes'
      log standard error with the prompts held fixed and the variance
      (worker.calibration.rerun_interval); the interval across prompts where there is no
      calibration or no passes' standard error (one pass), so a bound is never narrower
      than a rerun has shown. Pages, the API and the CSV read these stored bounds."""
    from worker import calibration, intervals

    point, low, high = within_run_speedup(result, base, drafter_records, baseline_records)
    if variance is None:
        variance = ProtocolCalibration.variance_for(result.run.protocol_id)
    if variance:
        low, high = calibration.widen(point, low, high, variance)
    passes_se = (intervals.speedup_passes_standard_error(drafter_records, baseline_records)
                 if low is not None else None)
    rank_low, rank_high = calibration.rerun_interval(point, passes_se, variance)
    if rank_low is None:
        rank_low, rank_high = low, high
    return dict(speedup=point, speedup_low=rank_low, speedup_high=rank_high,
                speedup_prompts_low=low, speedup_prompts_high=high,
                speedup_passes_se=passes_se, speedup_between_run_variance=variance)


def record_cell(run: Run, cell_result) -> Result:
    """Upsert one measured cell (its raw records first, so a row never lacks them). A
    drafter cell is divided by its baseline cell; a paired run's k = 0 cell re-divides the
    run's stored drafter cells of its group (on resume a group is measured again whole, so
    the stored speedups follow the new pair)."""
    cell = cell_result.cell
    records.write_cell(run.pk, cell, cell_result.records)
    key = dict(run=run, task=cell.task, batch_size=cell.batch_size,
               temperature=float(cell.temperature), k=cell.k)
    values = dict(cell_result.figures, measured_at=timezone.now())
    values["checks"] = dict(getattr(cell_result, "checks", None) or {})
    try:
        with transaction.atomic():
            result, _ = Result.objects.update_or_create(**key, defaults=values)
    except IntegrityError:  # a concurrent writer inserted the same cell first
        Result.objects.filter(**key).update(**values)
        result = Result.objects.get(**key)
    if run.is_baseline:
        return result
    if cell.k == 0:  # paired: this run's own baseline cell
        for drafter_cell in Result.objects.filter(
                run=run, task=cell.task, batch_size=cell.batch_size,
                temperature=float(cell.temperature), k__gt=0).select_related("run"):
            divide_by_baseline(drafter_cell, base=result)
    else:
        divide_by_baseline(result, cell_result.outputs)
    return result


def record_started(run: Run, info: dict):
    """The engine the run measures with. A drafter run under a shared protocol whose engine
    version has no baseline run yet queues one (a new engine version gets its baseline)."""
    run.engine_version = info.get("engine_version", "")
    run.versions = info.get("versions", {})
    run.hardware_description = info.get("hardware_description", "")
    # The engine's environment (KV cache size, thread binding, the tcmalloc preload) is part
    # of how it ran: kept with its arguments, under "environment".
    run.engine_args = {**info.get("engine_args", {}),
                       "environment": info.get("engine_env", {})}
    if info.get("drafter_engine_args"):
        run.engine_args["drafter_engines"] = info["drafter_engine_args"]
    run.save(update_fields=["engine_version", "versions", "hardware_description", "engine_args"])
    if run.engine_version and needs_shared_baseline(run.protocol, run.drafter, run.engine_version):
        queue_run(run.protocol, None)


def update_progress(run: Run, measured_this_attempt: int, attempt_started: float):
    done = measurements_done(run)
    remaining = max(run.cells_total - done, 0)
    eta = None
    if measured_this_attempt:
        eta = (time.monotonic() - attempt_started) / measured_this_attempt * remaining
    Run.objects.filter(pk=run.pk).update(cells_done=done, eta_seconds=eta,
                                         heartbeat_at=timezone.now())
    run.cells_done, run.eta_seconds = done, eta


def heartbeat_and_cancel_flag(run: Run) -> bool:
    Run.objects.filter(pk=run.pk).update(heartbeat_at=timezone.now())
    workers.seen_from_run(run.worker_host)
    return Run.objects.filter(pk=run.pk, cancel_requested=True).exists()


def finish(run: Run, state: str, error: str = "", tail: str = ""):
    """Mark the run finished exactly once (only a running run can finish). A succeeded run's
    records are read once, for its artifact and then its analysis or the speedups that were
    waiting for it (a baseline)."""
    fields = dict(state=state, finished_at=timezone.now(), eta_seconds=None,
                  error=error[:10000], log_tail=tail[-20000:])
    run_records = records.RunRecords(run.pk)
    if state == Run.SUCCEEDED:
        fields["artifact"] = records.write_artifact(
            run.pk, (run_records.cell(c) for c in cells_for(run.protocol, run.drafter)))
        fields["cells_done"] = measurements_done(run)
    if not run.is_baseline:
        fields["drift"] = run_drift(run)
        fields["drift_flagged"] = (fields["drift"] is not None
                                   and fields["drift"] > run.protocol.spec.max_drift)
    # One transaction: whoever sees the run succeeded sees its analysis (or the speedups it
    # filled in) too, never the state first and the figures a moment later.
    with transaction.atomic():
        changed = Run.objects.filter(pk=run.pk, state=Run.RUNNING).update(**fields)
        if changed:
            for name in ("drift", "drift_flagged"):
                if name in fields:
                    setattr(run, name, fields[name])
        if changed and state == Run.SUCCEEDED:
            try:
                with transaction.atomic():   # a fault here loses the figures, not the run
                    if run.is_baseline:
                        backfill_speedups(run, run_records)
                    else:
                        record_analysis(run, run_records)
            except (OperationalError, InterfaceError):
                raise   # the database went away: the whole finish is retried
            except Exception:  # noqa: BLE001 - logged; the measured cells stand
                log.exception("run %s: its analysis could not be stored", run.pk)
    return bool(changed)


def run_drift(run: Run) -> float | None:
    """The largest drift between the baseline passes of the run's own k = 0 cells (paired
    runs; None when there are none with two passes or more)."""
    from worker import intervals
    passes = [p for p in Result.objects.filter(run=run, k=0).values_list(
        "pass_throughputs", flat=True) if p and len(p) > 1]
    return max((intervals.drift(p) for p in passes), default=None)


def backfill_speedups(baseline: Run, baseline_records: records.RunRecords):
    """Drafter cells measured before their baseline get their speedup and lossless share,
    and their succeeded runs their analysis."""
    pending = Result.objects.filter(
        run__protocol_id=baseline.protocol_id, run__hardware=baseline.hardware,
        run__engine_version=baseline.engine_version, run__drafter__isnull=False,
        k__gt=0, baseline_result__isnull=True).select_related("run", "run__protocol"
                                                             ).order_by("run_id")
    records_by_run, divided = {}, {}
    for result in pending:
        run_records = records_by_run.setdefault(result.run_id, records.RunRecords(result.run_id))
        if divide_by_baseline(result, run_records=run_records,
                              baseline_records=baseline_records):
            divided[result.run_id] = result.run
    for run_id, drafter_run in divided.items():
        if drafter_run.state == Run.SUCCEEDED:
            record_analysis(drafter_run, records_by_run[run_id], baseline_records)


def record_analysis(run: Run, run_records: records.RunRecords | None = None,
                    baseline_records: records.RunRecords | None = None) -> int:
    """Store the "When does it pay?" figures (worker.analysis.EXPORT_COLUMNS) on the cells
    of a succeeded drafter run whose baseline has succeeded. Returns the number of cells
    updated (0 when there is no baseline yet or no raw records). The records come from the
    RunRecords given, else are read here."""
    results = list(Result.objects.filter(run=run, k__gt=0).order_by(
        "task", "batch_size", "temperature", "k"))
    base_ids = {r.baseline_result_id for r in results if r.baseline_result_id}
    base = (Run.objects.filter(results__id__in=base_ids)
            .filter(Q(state=Run.SUCCEEDED) | Q(pk=run.pk))
            .order_by("-queued_at").first() if base_ids else None)
    if run.drafter_id is None or base is None:
        return 0
    run_records = run_records or records.RunRecords(run.pk)
    if baseline_records is None or baseline_records.run_id != base.pk:
        baseline_records = records.RunRecords(base.pk)
    cells = run_records.with_records([r.as_cell_dict() for r in results])
    # The cost model reads the baseline's batch-1 records (prefill slope), the rest by TPOT.
    base_cells = baseline_records.with_records(
        [r.as_cell_dict() for r in base.results.filter(k=0)], batch_size=1)
    rows = analysis.analyse_run_or_stored_only(cells, base_cells, run.drafter.method,
                                               f"run {run.pk}")
    for result, row in zip(results, rows):
        measured = result.decode_steps is not None  # the worker measured tokens per step
        for column, value in zip(analysis.EXPORT_COLUMNS, analysis.export_values(row)):
            if not (measured and column == "tokens_per_step"):
                setattr(result, column, value)
    Result.objects.bulk_update(results, list(analysis.EXPORT_COLUMNS))
    return len(results)


def run_log_path(run: Run) -> Path:
    folder = settings.VAR_DIR / "logs"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"run-{run.pk}.log"


# ---- measuring -----------------------------------------------------------------------

def _drop_connection():
    """Forget a connection that broke, so that the next query opens a new one."""
    try:
        connection.close()
    except (OperationalError, InterfaceError):
        pass  # it is closed either way


def through_outage(write, what: str):
    """Run a database write of a measuring run, waiting out a database that does not answer
    (stopped, restarting, unreachable) for up to SPECBOARD_DB_OUTAGE_WAIT_S: the connection
    is dropped and the write tried again every few seconds. The measurement goes on meanwhile
    (the child's results wait in its pipe), so no cell is lost, and writes are upserts, so
    none is doubled. After the wait the error is raised as before."""
    deadline = time.monotonic() + settings.DB_OUTAGE_WAIT_S
    delay, warned = 1.0, False
    while True:
        try:
            return write()
        except (OperationalError, InterfaceError) as e:
            if time.monotonic() + delay > deadline:
                raise
            if not warned:
                log.warning("database unavailable while %s (%s); waiting up to %ss for it",
                            what, str(e).strip().splitlines()[0] if str(e).strip() else
                            type(e).__name__, settings.DB_OUTAGE_WAIT_S)
                warned = True
            _drop_connection()
            time.sleep(delay)
            delay = min(delay * 2, 10.0)


def engine_version_refusal(protocol: Protocol) -> str | None:
    """Why this environment may not measure the protocol's runs: the protocol pins an engine
    version (ProtocolSpec.engine_version) other than the one installed here
    (package_versions). None when it may."""
    from worker.engines import engine_module

    pinned = protocol.spec.engine_version
    if not pinned:
        return None
    installed = engine_module(protocol.engine).package_versions().get(protocol.engine)
    if installed == pinned:
        return None
    how = start_worker_command(protocol.hardware, pinned, protocol.spec.queue)
    return (f"protocol {protocol} pins {protocol.engine} {pinned}, but this environment has "
            f"{installed or 'none installed'}; its runs are measured by a worker of that "
            f"version, on queue {protocol.spec.queue} ({how}; docs/deployment.md)")


def execute_run(run_id: int, host: str | None = None, progress=None,
                resend_refused: bool = False) -> str | None:
    """Measure one run to its end. Returns its final state, or None if not ours. A run whose
    protocol pins another engine version than this environment's is not claimed: it stays
    queued for a worker of that version (`resend_refused`: its message is sent again after
    RUN_STALE_AFTER_S, for such a worker on the same queue; one that starts later sends it
    itself, resend_unfinished_runs)."""
    queued = Run.objects.select_related("protocol").filter(pk=run_id).first()
    refusal = engine_version_refusal(queued.protocol) if queued is not None else None
    if refusal is not None:
        log.warning("run %s: not measured here: %s", run_id, refusal)
        if resend_refused and queued.state == Run.QUEUED:
            enqueue(queued, countdown=settings.RUN_STALE_AFTER_S)
        return None
    run = claim(run_id, host or worker_host())
    if run is None:
        log.info("run %s: not claimed (finished, cancelled or held by a live worker)", run_id)
        return None
    log_path = run_log_path(run)
    started, measured = time.monotonic(), 0

    def on_event(event):
        nonlocal measured
        if isinstance(event, dict) and event.get("type") == "started":
            through_outage(lambda: record_started(run, event), "recording the engine")
            return
        through_outage(lambda: record_cell(run, event), f"recording a cell of run {run.pk}")
        measured += 1
        through_outage(lambda: update_progress(run, measured, started), "writing progress")
        if progress:
            progress(run)

    def should_stop():
        # Called after every cell and every couple of seconds: a heartbeat, and the flag.
        # While the database is away the measurement goes on (the next call tries again).
        try:
            return heartbeat_and_cancel_flag(run)
        except (OperationalError, InterfaceError):
            _drop_connection()
            return False

    try:
        job = build_job(run)
        # the child holds the host lock (settings.HOST_LOCK) while it measures: a second
        # measurement on this host waits, the Gradio demo yields
        outcome = run_job_in_child(job, log_path, on_event, should_stop,
                                   host_lock_path=str(settings.HOST_LOCK))
    except SoftTimeLimitExceeded:
        minutes = round(settings.RUN_SOFT_LIMIT_S / 60)
        finish(run, Run.FAILED, f"timed out after {minutes} minutes", log_tail(log_path))
        return Run.FAILED
    except ChildFailed as e:
        finish(run, Run.FAILED, e.message, e.log_tail)
        return Run.FAILED
    except Exception as e:  # noqa: BLE001 - any failure is written on the run
        log.exception("run %s failed", run_id)
        finish(run, Run.FAILED, f"{type(e).__name__}: {e}", log_tail(log_path))
        return Run.FAILED
    if outcome == "stopped":
        through_outage(lambda: finish(run, Run.CANCELLED, "cancelled by request",
                                      log_tail(log_path)), "finishing the run")
        return Run.CANCELLED
    through_outage(lambda: finish(run, Run.SUCCEEDED, tail=log_tail(log_path)),
                   "finishing the run")
    return Run.SUCCEEDED


def resend_unfinished_runs(queues) -> None:
    """When a worker starts: runs whose worker died mid-run on its queues (their heartbeat
    goes stale) are sent again; the claim makes a duplicate a no-op, and the run measures
    only its missing cells. Queued runs whose message was lost (the embedded broker keeps no
    unacked messages across a kill) are sent again too."""
    wait = settings.RUN_STALE_AFTER_S + 1
    for run in Run.objects.filter(state=Run.RUNNING, queue__in=queues):
        enqueue(run, countdown=wait)
        log.info("run %s: running; sent again in %ss, taken over only if its heartbeat is "
                 "stale by then (its worker stopped)", run.pk, wait)
    for run in Run.objects.filter(state=Run.QUEUED, queue__in=queues):
        enqueue(run)
