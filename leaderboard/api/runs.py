"""Runs: their state, progress and queue position, their raw per-request records, and
cancelling one's own; the measurement workers and the queues they serve."""
from __future__ import annotations

from datetime import datetime
from typing import Any, Literal, Optional

from django.core.files.storage import default_storage
from django.http import FileResponse
from django.urls import reverse
from ninja import Path, Query, Router, Schema
from pydantic import Field

from .. import permissions
from ..selectors import runs as run_reads
from ..services import submissions
from ..models import Run
from .auth import token_auth
from .common import ID_MAX, INT_MAX, PROTOCOL_REF, SLUG, Out, PageOut, PageQuery
from .errors import ApiError, error_responses, not_found, not_manager, problem

router = Router()

RUN_ID = Path(..., ge=1, le=ID_MAX, description="run id")


class RunProtocolRef(Out):
    slug: str = Field(description="protocol slug")
    version: int = Field(description="protocol version")
    label: str = Field(description='"slug vN"')
    url: str = Field(description="the protocol's page")


class RunDrafterRef(Out):
    id: int = Field(description="drafter id")
    slug: str = Field(description="drafter slug")
    name: str = Field(description="drafter name")
    method: str = Field(description="drafter method")
    owner: Optional[str] = Field(description="username of the submitter")
    review_state: str = Field(description="review state")
    url: str = Field(description="the drafter's page")


class RunOut(Out):
    id: int = Field(description="run id")
    state: Literal["queued", "running", "succeeded", "failed", "cancelled"] = Field(
        description="queued -> running -> succeeded | failed | cancelled")
    is_baseline: bool = Field(description="true for the baseline (no drafter)")
    drafter: Optional[RunDrafterRef] = Field(description="the drafter; null for the baseline")
    protocol: RunProtocolRef = Field(description="the protocol it measures under")
    hardware: str = Field(description="hardware class")
    queue: str = Field(description="the queue it is sent to: its hardware class, or, where its "
                                   "protocol pins an engine version, e.g. cpu.vllm-0.31.0 "
                                   "(served by a worker of that version)")
    position: Optional[int] = Field(description="place in its queue (1 = next); null unless "
                                                "queued")
    cells_done: int = Field(description="cell measurements stored: a cell counts once per "
                                        "engine start its passes came from")
    cells_total: int = Field(description="cell measurements in all: the grid's cells times "
                                         "the protocol's engine starts (1 before v4)")
    progress: float = Field(description="cells_done / cells_total")
    eta_seconds: Optional[float] = Field(description="estimated seconds left while running")
    cancel_requested: bool = Field(description="a cancel was asked for")
    attempts: int = Field(description="times a worker claimed it")
    worker_host: str = Field(description="worker that measures or measured it")
    engine_version: str = Field(description="engine version, e.g. the vllm version")
    versions: dict[str, Any] = Field(description="versions of vllm, torch, transformers")
    hardware_description: str = Field(description="the hardware, in words")
    engine_args: dict[str, Any] = Field(description="engine arguments, and the engine's "
                                                    "environment under `environment`")
    error: str = Field(description="why it failed (empty otherwise)")
    log_tail: str = Field(description="last lines of its log, for a failure")
    artifact_url: Optional[str] = Field(description="download of the raw per-request "
                                                    "records; null until it succeeds")
    queued_at: datetime = Field(description="when it was queued")
    started_at: Optional[datetime] = Field(description="when a worker first claimed it")
    heartbeat_at: Optional[datetime] = Field(description="last sign of life of its worker")
    finished_at: Optional[datetime] = Field(description="when it finished")
    drift: Optional[float] = Field(description="paired runs: (max - min) / mean of the "
                                               "baseline passes' throughputs, the largest over "
                                               "its baseline cells; null otherwise")
    drift_flagged: bool = Field(description="drift above the protocol's max_drift")


class RunPage(PageOut):
    items: list[RunOut] = Field(description="this page")


class RunFilters(PageQuery):
    state: Optional[Literal["queued", "running", "succeeded", "failed", "cancelled"]] = Field(
        None, description="run state")
    hardware: Optional[str] = Field(None, pattern=SLUG, max_length=50,
                                    description="hardware class")
    drafter: Optional[str] = Field(None, pattern=SLUG, max_length=50, description="drafter slug")
    protocol: Optional[str] = Field(None, pattern=PROTOCOL_REF, max_length=80,
                                    description='protocol slug, or "slug@version"')
    version: Optional[int] = Field(None, ge=1, le=INT_MAX, description="protocol version")
    baseline: Optional[bool] = Field(None, description="true: baseline runs only; false: "
                                                       "drafter runs only")


def api_run(summary: dict) -> dict:
    """A run_summary with its artifact link pointing at the API's download."""
    if summary.get("artifact_url"):
        summary = dict(summary, artifact_url=reverse("api:run_artifact", args=[summary["id"]]))
    return summary


@router.get("/runs", response={200: RunPage, **error_responses(422)}, tags=["reads"],
            summary="Runs, newest first: state, progress, queue position, error")
def list_runs(request, filters: Query[RunFilters]):
    count, items = run_reads.runs_page(
        state=filters.state, hardware=filters.hardware, drafter=filters.drafter,
        protocol=filters.protocol, version=filters.version, baseline=filters.baseline,
        limit=filters.limit, offset=filters.offset,
        show_rejected=permissions.sees_rejected(request.user))
    return {"count": count, "limit": filters.limit, "offset": filters.offset,
            "items": [api_run(r) for r in items]}


@router.get("/runs/{run_id}", response={200: RunOut, **error_responses(404)},
            tags=["reads"], summary="One run: state, progress, queue position, error")
def get_run(request, run_id: int = RUN_ID):
    run = run_reads.run_with_position(run_id)
    if run is None or not permissions.can_see(
            request.user, (run.get("drafter") or {}).get("review_state")):
        raise not_found("run_id", f"no run {run_id}")
    return api_run(run)


@router.get("/runs/{run_id}/artifact", response={200: None, **error_responses(404)},
            tags=["reads"], url_name="run_artifact",
            summary="Raw per-request records of a run (gzipped JSON lines)",
            openapi_extra={"responses": {200: {
                "description": "the run's raw per-request records, one JSON object a line, "
                               "gzipped",
                "content": {"application/gzip": {"schema": {"type": "string",
                                                            "format": "binary"}}}}}})
def run_artifact(request, run_id: int = RUN_ID):
    run = Run.objects.filter(pk=run_id).select_related("drafter").first()
    if run is None or not permissions.can_see_run(request.user, run):
        raise not_found("run_id", f"no run {run_id}")
    if not run.artifact:
        raise not_found("artifact", f"run {run_id} is {run.state} and has no raw data yet: "
                                    "it is written when the run succeeds")
    if not default_storage.exists(run.artifact.name):
        raise not_found("artifact", f"the raw data of run {run_id} is missing from the storage")
    return FileResponse(default_storage.open(run.artifact.name, "rb"), as_attachment=True,
                        filename=f"specboard-run-{run_id}-requests.jsonl.gz",
                        content_type="application/gzip")


@router.post("/runs/{run_id}/cancel",
             response={200: RunOut, **error_responses(401, 403, 404, 409)}, auth=token_auth,
             tags=["writes"], summary="Cancel one's own run")
def cancel_run(request, run_id: int = RUN_ID):
    """A queued run is cancelled at once; a running one stops after the cell it is
    measuring (its state stays running with cancel_requested true until then)."""
    run = run_reads.get_run(run_id)
    if run is None:
        raise not_found("run_id", f"no run {run_id}")
    if not permissions.can_manage_run(request.auth, run):
        raise not_manager()
    if run.state in Run.FINISHED:
        raise ApiError(409, problem("(path)", "run_id", f"run {run_id} already {run.state}"))
    submissions.cancel_run(run)
    return api_run(run_reads.run_with_position(run_id))


class WorkerOut(Out):
    hostname: str = Field(description="Celery node name, e.g. engine-0.31.0@host")
    hardware: str = Field(description="hardware class")
    engine: str = Field(description="engine, e.g. vllm")
    engine_version: str = Field(description="engine version installed in its environment "
                                            "(empty: none)")
    queues: list[str] = Field(description="queues it consumes: its engine version's "
                                          "(cpu.vllm-0.31.0) and, for the default "
                                          "environment, the hardware class's")
    python_version: str = Field(description="Python version of its environment")
    torch_version: str = Field(description="torch version of its environment")
    started_at: datetime = Field(description="when it announced itself")
    last_seen_at: datetime = Field(description="its last sign of life")
    live: bool = Field(description="seen within SPECBOARD_RUN_STALE_AFTER_S")


class WorkerFilters(Schema):
    live: bool = Field(True, description="true: only live workers; false: every one that "
                                         "announced itself and did not stop cleanly")


@router.get("/workers", response={200: list[WorkerOut], **error_responses(422)},
            tags=["reads"], summary="Measurement workers: hardware, engine version, queues")
def list_workers(request, filters: Query[WorkerFilters]):
    """The measurement workers that announced themselves, by hardware class, engine and
    version. A run goes to the queue of its protocol's hardware class and pinned engine
    version (e.g. cpu.vllm-0.31.0; the hardware class when it pins none); runs on a queue
    no live worker consumes wait."""
    return run_reads.workers(live_only=filters.live)
