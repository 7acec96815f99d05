"""Run services: queue, claim, record cells, finish, cancel. The Celery task
(worker/tasks.py) is a thin shell over these; `manage.py measure --sync` calls them too.

Guarantees: a run is claimed by a compare-and-set update (a duplicate delivery is a no-op);
each cell is an upsert on its unique key (a redelivery never doubles a row); a run whose
worker died is taken over and measures only its missing cells.
"""
from __future__ import annotations

import gzip
import io
import json
import logging
import socket
import time
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.db import IntegrityError, transaction
from django.db.models import F, Q
from django.db.models.functions import Coalesce
from django.utils import timezone

from worker import metrics
from worker.protocol import Cell

from .models import Drafter, Prompt, Protocol, Result, Run

log = logging.getLogger(__name__)


class RunError(Exception):
    """A run cannot be measured; the message says why and what to fix."""


# ---- queueing ----------------------------------------------------------------------

def enqueue(run: Run):
    """Send the run to its hardware class's queue once the transaction commits."""
    from worker.tasks import measure_run

    transaction.on_commit(lambda: measure_run.apply_async(args=[run.pk], queue=run.hardware))


def cells_for(protocol: Protocol, drafter: Drafter | None):
    return protocol.spec_obj.cells(with_drafter=drafter is not None)


def baseline_run(protocol: Protocol, engine_version: str | None = None):
    """The baseline run of a protocol that is not failed or cancelled (the newest)."""
    qs = Run.objects.filter(protocol=protocol, drafter__isnull=True, hardware=protocol.hardware)
    qs = qs.exclude(state__in=[Run.FAILED, Run.CANCELLED])
    if engine_version:
        qs = qs.filter(Q(engine_version=engine_version) | Q(engine_version=""))
    return qs.order_by("-queued_at").first()


def queue_run(protocol: Protocol, drafter: Drafter | None, send=True) -> Run:
    """Queue a run. A drafter run makes sure the protocol's baseline exists (queued first,
    so a single worker measures it first; speedups of cells measured before it are filled
    in when it finishes)."""
    if drafter is not None and drafter.target_id != protocol.target_id:
        raise RunError(f"drafter {drafter.slug} is for target {drafter.target.slug}, but "
                       f"protocol {protocol} measures {protocol.target.slug}")
    with transaction.atomic():
        if drafter is not None and baseline_run(protocol) is None:
            queue_run(protocol, None, send=send)
        run = Run.objects.create(drafter=drafter, protocol=protocol, hardware=protocol.hardware,
                                 cells_total=len(cells_for(protocol, drafter)))
        if send:
            enqueue(run)
    return run


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
    return f"{socket.gethostname()}:{__import__('os').getpid()}"


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
    return Run.objects.filter(state=Run.RUNNING, hardware__in=queues, heartbeat_at__lt=stale)


# ---- building the job ----------------------------------------------------------------

def prompts_for(protocol: Protocol):
    from worker.measure import PromptItem

    out = {}
    for task in protocol.spec_obj.tasks:
        qs = Prompt.objects.filter(prompt_set__slug=task.prompt_set)
        first = qs.select_related("prompt_set").first()
        if first is None:
            raise RunError(f"task {task.task}: prompt set {task.prompt_set!r} is not imported; "
                           "run `manage.py import_prompts` or `manage.py setup_demo`")
        if first.prompt_set.source_sha256 != task.prompt_set_sha256:
            raise RunError(f"task {task.task}: prompt set {task.prompt_set!r} was imported from "
                           "a different file than the protocol names (sha256 differs)")
        if task.categories:
            qs = qs.filter(category__in=task.categories)
        items = [PromptItem(id=p.external_id, turns=p.turns)
                 for p in qs.order_by("position")[: task.prompts]]
        if len(items) < task.prompts:
            raise RunError(f"task {task.task}: the protocol asks for {task.prompts} prompts, "
                           f"the prompt set has {len(items)}")
        out[task.task] = items
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
    from worker.measure import DrafterSpec, MeasureJob
    from worker.methods import check_supported

    protocol, drafter = run.protocol, run.drafter
    if drafter is None:
        spec = DrafterSpec(method="baseline")
    else:
        check_supported(drafter.method, run.hardware)
        path = drafter_folder(drafter) if drafter.files.exists() else None
        spec = DrafterSpec(method=drafter.method, path=path, params=dict(drafter.params))
    done = frozenset(
        (r.task, r.batch_size, float(r.temperature), r.k)
        for r in Result.objects.filter(run=run).only("task", "batch_size", "temperature", "k"))
    target = protocol.target
    if not target.path or not Path(target.path).is_dir():
        raise RunError(f"target {target.slug}: checkpoint folder {target.path!r} is missing on "
                       f"this worker ({worker_host()}); run `manage.py setup_demo` here")
    return MeasureJob(spec=protocol.spec_obj, target_path=target.path, drafter=spec,
                      prompts=prompts_for(protocol), skip=done)


# ---- recording -----------------------------------------------------------------------

def cell_records_name(run_id, cell: Cell):
    return f"runs/{run_id}/cells/{cell.task}-b{cell.batch_size}-t{cell.temperature:g}-k{cell.k}.jsonl.gz"


def _write_gz_lines(name, records):
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz:
        for r in records:
            gz.write((json.dumps(r, separators=(",", ":")) + "\n").encode())
    if default_storage.exists(name):
        default_storage.delete(name)
    return default_storage.save(name, ContentFile(buf.getvalue()))


def _read_gz_lines(name):
    if not default_storage.exists(name):
        return []
    with default_storage.open(name, "rb") as f:
        data = gzip.decompress(f.read())
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


def cell_outputs(run_id, cell: Cell):
    return {r["prompt_id"]: r["output_token_ids"]
            for r in _read_gz_lines(cell_records_name(run_id, cell))}


def matching_baseline_cell(run: Run, cell: Cell):
    """The baseline cell that this cell's speedup divides by: same protocol, task, batch
    size, temperature, engine version and hardware class. None until it is measured."""
    return Result.objects.filter(
        run__protocol_id=run.protocol_id, run__drafter__isnull=True, run__hardware=run.hardware,
        run__engine_version=run.engine_version, task=cell.task, batch_size=cell.batch_size,
        temperature=cell.temperature, k=0,
    ).exclude(run__state__in=[Run.FAILED, Run.CANCELLED]).order_by("-run__queued_at").first()


def compare_with_baseline(result: Result, outputs=None):
    """Fill in speedup and (at temperature 0) the lossless share against the baseline."""
    run = result.run
    cell = Cell(result.task, result.batch_size, result.temperature, result.k)
    base = matching_baseline_cell(run, cell)
    if base is None:
        return False
    result.baseline_result = base
    result.speedup = metrics.speedup(result.output_throughput, base.output_throughput)
    if result.temperature == 0:
        outputs = outputs if outputs is not None else cell_outputs(run.pk, cell)
        base_cell = Cell(base.task, base.batch_size, base.temperature, 0)
        result.lossless_share = metrics.lossless_share(outputs, cell_outputs(base.run_id, base_cell))
    result.save(update_fields=["baseline_result", "speedup", "lossless_share"])
    return True


def record_cell(run: Run, cell_result) -> Result:
    """Upsert one measured cell (its raw records first, so a row never lacks them)."""
    cell = cell_result.cell
    _write_gz_lines(cell_records_name(run.pk, cell), cell_result.records)
    key = dict(run=run, task=cell.task, batch_size=cell.batch_size,
               temperature=float(cell.temperature), k=cell.k)
    values = dict(cell_result.figures, measured_at=timezone.now())
    try:
        with transaction.atomic():
            result, _ = Result.objects.update_or_create(**key, defaults=values)
    except IntegrityError:  # a concurrent writer inserted the same cell first
        Result.objects.filter(**key).update(**values)
        result = Result.objects.get(**key)
    if not run.is_baseline:
        compare_with_baseline(result, outputs=cell_result.outputs)
    return result


def record_started(run: Run, info: dict):
    run.engine_version = info.get("engine_version", "")
    run.versions = info.get("versions", {})
    run.hardware_description = info.get("hardware_description", "")
    run.engine_args = info.get("engine_args", {})
    run.save(update_fields=["engine_version", "versions", "hardware_description", "engine_args"])


def update_progress(run: Run, measured_this_attempt: int, attempt_started: float):
    done = Result.objects.filter(run=run).count()
    remaining = max(run.cells_total - done, 0)
    eta = None
    if measured_this_attempt:
        eta = (time.monotonic() - attempt_started) / measured_this_attempt * remaining
    Run.objects.filter(pk=run.pk).update(cells_done=done, eta_seconds=eta,
                                         heartbeat_at=timezone.now())
    run.cells_done, run.eta_seconds = done, eta


def heartbeat_and_cancel_flag(run: Run) -> bool:
    Run.objects.filter(pk=run.pk).update(heartbeat_at=timezone.now())
    return Run.objects.filter(pk=run.pk, cancel_requested=True).exists()


def _assemble_artifact(run: Run):
    records = []
    for cell in cells_for(run.protocol, run.drafter):
        records.extend(_read_gz_lines(cell_records_name(run.pk, cell)))
    name = _write_gz_lines(f"runs/{run.pk}/requests.jsonl.gz", records)
    return name


def finish(run: Run, state: str, error: str = "", tail: str = ""):
    """Mark the run finished exactly once (only a running run can finish)."""
    fields = dict(state=state, finished_at=timezone.now(), eta_seconds=None,
                  error=error[:10000], log_tail=tail[-20000:])
    if state == Run.SUCCEEDED:
        fields["artifact"] = _assemble_artifact(run)
        fields["cells_done"] = Result.objects.filter(run=run).count()
    changed = Run.objects.filter(pk=run.pk, state=Run.RUNNING).update(**fields)
    if changed and state == Run.SUCCEEDED:
        if run.is_baseline:
            backfill_speedups(run)
        else:
            record_analysis(run)
    return bool(changed)


def backfill_speedups(baseline: Run):
    """Drafter cells measured before their baseline get their speedup and lossless share,
    and their succeeded runs their analysis."""
    pending = Result.objects.filter(
        run__protocol_id=baseline.protocol_id, run__hardware=baseline.hardware,
        run__engine_version=baseline.engine_version, run__drafter__isnull=False,
        baseline_result__isnull=True).select_related("run")
    runs = {}
    for result in pending:
        if compare_with_baseline(result) and result.run.state == Run.SUCCEEDED:
            runs[result.run_id] = result.run
    for drafter_run in runs.values():
        record_analysis(drafter_run)


def record_analysis(run: Run) -> int:
    """Store the "When does it pay?" figures (selectors.ANALYSIS_COLUMNS, worker.analysis)
    on the cells of a succeeded drafter run whose baseline has succeeded. Returns the
    number of cells updated (0 when there is no baseline yet or no raw records)."""
    from . import selectors

    results = list(Result.objects.filter(run=run).order_by("task", "batch_size",
                                                            "temperature", "k"))
    base_ids = {r.baseline_result_id for r in results if r.baseline_result_id}
    base = (Run.objects.filter(results__id__in=base_ids, state=Run.SUCCEEDED)
            .order_by("-queued_at").first() if base_ids else None)
    if run.drafter_id is None or base is None:
        return 0
    cells = [selectors.cell_dict(r) for r in results]
    base_cells = [selectors.cell_dict(r) for r in base.results.all()]
    key = (run.pk, str(run.queued_at), base.pk, str(base.queued_at))
    rows = selectors.run_analysis(run.pk, cells, base.pk, base_cells, run.drafter.method, key)
    for result, row in zip(results, rows):
        for column, value in zip(selectors.ANALYSIS_COLUMNS,
                                 selectors.analysis_export_values(row)):
            setattr(result, column, value)
    Result.objects.bulk_update(results, list(selectors.ANALYSIS_COLUMNS))
    return len(results)


def run_log_path(run: Run) -> Path:
    folder = settings.VAR_DIR / "logs"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"run-{run.pk}.log"
