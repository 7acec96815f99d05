"""The REST API (django-ninja): public reads of targets, protocols, drafters, runs and
results (paginated, or exported whole as CSV or JSON, streamed in constant memory), and
writes by API token: submit a drafter, cancel one's run, withdraw one's drafter.

Schema: /api/openapi.json; interactive docs: /api/docs. Reads go through
leaderboard.selectors (the same functions as the pages), writes through the services
(leaderboard.submissions, leaderboard.runs). Every error answers
{"detail": [{"file", "member", "field", "message"}]} (see ProblemOut).
"""
from __future__ import annotations

import csv
import io
import json
from datetime import datetime
from typing import Annotated, Any, Literal, Optional

from django.conf import settings
from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent
from django.core.files.storage import default_storage
from django.db import connection
from django.http import FileResponse, Http404, StreamingHttpResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.datastructures import MultiValueDict
from ninja import File, Form, NinjaAPI, Path, Query, Schema, Status, UploadedFile
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.security import HttpBearer
from pydantic import ConfigDict, Field, field_validator
from pydantic.json_schema import SkipJsonSchema

from worker.checkpoint import Upload

from . import permissions, selectors, submissions, tokens
from .forms import SubmitForm
from .models import Drafter, Run, Target

API_VERSION = "1.0.0"

DESCRIPTION = """\
Everything the SpecBoard site shows, as JSON or CSV.

* **Reads** are public. Lists are paginated with `limit` and `offset` and answer
  `{"count", "limit", "offset", "items"}`.
* **Results** (`/api/results`) are the cells of each run's grid, each row with its
  provenance (protocol slug, version and sha256, engine version, hardware class, run id).
  `format=csv` and `format=json` export every matching row at once, streamed
  (no pagination), with a file name naming the protocol and the date.
* **Writes** need an API token: `Authorization: Bearer TOKEN`. Create one on the account
  settings page or with `python manage.py api_token USERNAME`.
* **Errors** always answer `{"detail": [{"file", "member", "field", "message"}]}`: 401 no,
  unknown or revoked token; 403 not the owner (nor staff); 404 no such object; 409 a
  conflict (duplicate drafter, finished run); 413 upload over the size limit; 422 invalid
  parameters or a refused checkpoint; 429 too many submissions in 24 hours.
"""

# Numbers the database columns can hold (PositiveIntegerField; BigAutoField ids), so that
# an out-of-range filter is a 422, never a database error.
INT_MAX = 2 ** 31 - 1
ID_MAX = 2 ** 63 - 1
SLUG = r"^[-a-zA-Z0-9_]+$"
PROTOCOL_REF = r"^[-a-zA-Z0-9_]+(@[0-9]{1,9})?$"
TASK = r"^[-a-zA-Z0-9_.]+$"
METHODS = tuple(m for m, _ in Drafter.METHODS)
MAX_LIMIT = 1000
# A multipart body carries boundaries and the form fields besides the files.
FORM_OVERHEAD_BYTES = 1024 * 1024


class SpecBoardAPI(NinjaAPI):
    def get_openapi_schema(self, **kwargs):
        """The schema, where /api/results answers JSON either as one page (ResultPage) or,
        with format=json, as the array of every matching row."""
        schema = super().get_openapi_schema(**kwargs)
        for path, ops in schema["paths"].items():
            if path.endswith("/results"):
                content = ops["get"]["responses"][200]["content"]
                content["application/json"]["schema"] = {"oneOf": [
                    {"$ref": "#/components/schemas/ResultPage"},
                    {"type": "array", "items": {"$ref": "#/components/schemas/ResultOut"},
                     "description": "format=json: every matching row"}]}
        return schema


api = SpecBoardAPI(title="SpecBoard API", version=API_VERSION, description=DESCRIPTION,
                   urls_namespace="api")


# ---- errors --------------------------------------------------------------------------

class ProblemOut(Schema):
    file: str = Field(description="what the problem is about: an uploaded file's name, or "
                                  "(request), (query), (path), (form), (upload), (submission)")
    member: Optional[str] = Field(None, description="the archive member, for a problem "
                                                    "inside an uploaded archive")
    field: str = Field(description="the parameter, config key, tensor or aspect at fault "
                                   "(e.g. batch_size, vocab_size, extension, size)")
    message: str = Field(description="what is wrong and how to fix it")


class ErrorOut(Schema):
    detail: list[ProblemOut] = Field(description="every problem found")


def problem(file, field, message, member=None) -> dict:
    return {"file": file, "member": member, "field": field, "message": message}


def error(request, status: int, *problems: dict, headers: dict | None = None):
    response = api.create_response(request, {"detail": list(problems)}, status=status)
    for k, v in (headers or {}).items():
        response[k] = v
    return response


class ApiError(Exception):
    def __init__(self, status: int, *problems: dict):
        self.status, self.problems = status, problems
        super().__init__(problems)


class PayloadTooLarge(ApiError):
    def __init__(self, message):
        super().__init__(413, problem("(upload)", "size", message))


def not_found(field, message):
    return ApiError(404, problem("(path)", field, message))


@api.exception_handler(ApiError)
def _api_error(request, exc: ApiError):
    return error(request, exc.status, *exc.problems)


@api.exception_handler(ValidationError)
def _validation_error(request, exc: ValidationError):
    out = []
    for e in exc.errors:
        loc = [str(x) for x in e.get("loc", ())]
        source = loc[0] if loc else "request"
        out.append(problem(f"({source})", ".".join(loc[1:]) or source, e.get("msg", "invalid")))
    return error(request, 422, *out)


@api.exception_handler(AuthenticationError)
def _authentication_error(request, exc: AuthenticationError):
    return error(request, 401, problem(
        "(request)", "Authorization",
        "send an API token as `Authorization: Bearer TOKEN` (create one on the account "
        "settings page or with `python manage.py api_token USERNAME`)"),
        headers={"WWW-Authenticate": 'Bearer realm="specboard"'})


@api.exception_handler(HttpError)
def _http_error(request, exc: HttpError):
    return error(request, exc.status_code, problem("(request)", "(request)", str(exc)))


@api.exception_handler(Http404)
def _not_found(request, exc):
    return error(request, 404, problem("(path)", "(path)", str(exc) or "not found"))


@api.exception_handler(RequestDataTooBig)
def _too_big(request, exc):
    return error(request, 413, problem("(request)", "size", str(exc)))


@api.exception_handler(TooManyFilesSent)
def _too_many_files(request, exc):
    return error(request, 413, problem("(upload)", "files", str(exc)))


@api.exception_handler(TooManyFieldsSent)
def _too_many_fields(request, exc):
    return error(request, 413, problem("(request)", "fields", str(exc)))


@api.exception_handler(submissions.SubmissionRefused)
def _refused(request, exc: submissions.SubmissionRefused):
    """A refused submission: 429 over the rate limit, 413 over the size limit, 409 for a
    duplicate, 422 for everything else (each problem names its file and field)."""
    problems = exc.as_dicts()
    if any(p["field"] == "rate limit" for p in problems):
        status = 429
    elif any(p["field"] == "size" and "upload limit" in p["message"] for p in problems):
        status = 413
    elif exc.existing is not None:
        status = 409
    else:
        status = 422
    return error(request, status, *problems)


# ---- authentication ------------------------------------------------------------------

class TokenAuth(HttpBearer):
    """`Authorization: Bearer TOKEN`; only the token's sha256 is stored (ApiToken). With
    `upload=True` (submissions) it then refuses what can be refused before the upload is
    read: a body over the size limit (413) and the submission rate limit (429)."""

    def __init__(self, upload: bool = False):
        super().__init__()
        self.upload = upload

    def __call__(self, request):
        value = request.headers.get(self.header, "")
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthenticationError()
        return self.authenticate(request, token)

    def authenticate(self, request, token):
        user = tokens.user_for_token(token)
        if user is None:
            raise ApiError(401, problem("(request)", "Authorization",
                                        "this API token is unknown or revoked: create a new "
                                        "one on the account settings page"))
        if self.upload:
            check_upload_size(request)
            submissions.check_rate_limit(user)
        return user


def check_upload_size(request):
    limit = settings.SPECBOARD_MAX_UPLOAD_BYTES
    try:
        length = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = 0
    if length > limit + FORM_OVERHEAD_BYTES:
        raise PayloadTooLarge(
            f"the request body is {length} bytes; uploads are limited to {limit} bytes "
            "(SPECBOARD_MAX_UPLOAD_BYTES): upload a smaller checkpoint (bf16 weights, only "
            "the drafter's own tensors)")


token_auth = TokenAuth()
submit_auth = TokenAuth(upload=True)

ERRORS = {401: ErrorOut, 403: ErrorOut, 404: ErrorOut, 409: ErrorOut, 413: ErrorOut,
          422: ErrorOut, 429: ErrorOut}


def errors(*codes):
    return {c: ERRORS[c] for c in codes}


def not_manager():
    return ApiError(403, problem("(request)", "owner", "only the owner of the drafter or "
                                                      "staff may do this"))


# ---- schemas -------------------------------------------------------------------------

class Out(Schema):
    model_config = ConfigDict(extra="ignore")


class TargetRef(Out):
    slug: str = Field(description="the target's slug")
    name: str = Field(description="the target's name")


class TargetOut(Out):
    slug: str = Field(description="stable identifier")
    name: str = Field(description="display name")
    family: str = Field(description="model family, e.g. llama")
    hub_id: str = Field(description="model hub id, if any")
    revision: str = Field(description="model hub revision, if any")
    weights_sha256: str = Field(description="sha256 of the weights")
    vocab_size: int = Field(description="vocabulary size")
    hidden_size: int = Field(description="hidden size")
    num_layers: int = Field(description="number of layers")
    has_chat_template: bool = Field(description="whether the tokenizer has a chat template")
    created_at: datetime = Field(description="when it was added")


class ProtocolSummaryOut(Out):
    id: int = Field(description="database id")
    slug: str = Field(description="protocol slug; with version, identifies the protocol")
    version: int = Field(description="protocol version; a changed spec is a new version")
    label: str = Field(description='"slug vN"')
    ref: str = Field(description='"slug@version", as the protocol filters take it')
    title: str = Field(description="title")
    engine: str = Field(description="engine of record, e.g. vllm")
    hardware: str = Field(description="hardware class (the Celery queue), e.g. cpu, h100")
    sha256: str = Field(description="sha256 of canonical_json; every result carries it")
    created_at: datetime = Field(description="when it was created")
    target: TargetRef = Field(description="the target model it measures")
    tasks: list[str] = Field(description="task names")
    batch_sizes: list[int] = Field(description="batch sizes (requests in flight at once)")
    temperatures: list[float] = Field(description="sampling temperatures")
    ks: list[int] = Field(description="speculation budgets k")
    url: str = Field(description="the protocol's page")


class ProtocolOut(ProtocolSummaryOut):
    runs_count: int = Field(description="runs under this protocol")
    succeeded_runs: int = Field(description="succeeded runs under this protocol")
    spec: dict[str, Any] = Field(description="the full measurement spec")
    canonical_json: str = Field(description="the spec's canonical JSON (sha256 is its hash)")


class PromptSetUse(Out):
    task: str = Field(description="task name")
    prompt_set: str = Field(description="prompt set slug")
    categories: list[str] = Field(description="categories used (empty: all)")
    prompts: int = Field(description="prompts per task")
    spec_sha256: str = Field(description="sha256 of the prompt file the spec names")
    imported: bool = Field(description="whether the prompt set is imported here")
    name: Optional[str] = Field(description="prompt set name")
    format: Optional[str] = Field(description="spec-bench, mt-bench or humaneval")
    source_name: Optional[str] = Field(description="file the prompts were imported from")
    source_sha256: Optional[str] = Field(description="sha256 of that file")
    sha256_matches: bool = Field(description="whether the imported file is the one named")
    set_count: int = Field(description="prompts in the set")
    available: int = Field(description="prompts in the categories used")
    category_counts: dict[str, int] = Field(description="prompts per category")


class ProtocolDetailOut(Out):
    protocol: ProtocolSummaryOut = Field(description="the protocol")
    spec: dict[str, Any] = Field(description="the full measurement spec")
    canonical_json: str = Field(description="the spec's canonical JSON")
    sha256: str = Field(description="sha256 of canonical_json")
    tasks: list[PromptSetUse] = Field(description="each task's prompt set")
    multi_turn: Optional[str] = Field(description="multi-turn policy of the spec")
    multi_turn_policy: str = Field(description="what that policy means")
    metrics: list[tuple[str, str]] = Field(description="(metric, definition) pairs")
    runs: int = Field(description="runs under this protocol")
    succeeded_runs: int = Field(description="succeeded runs")
    cells_per_drafter_run: int = Field(description="cells in a drafter run's grid")
    cells_per_baseline_run: int = Field(description="cells in the baseline run's grid")


class TrainingOut(Out):
    recipe: str = Field(description="the training recipe (manage.py train_drafter --recipe)")
    data_slug: Optional[str] = Field(description="the shared training data it learnt from")
    data_version: Optional[int] = Field(description="version of that training data")
    data_sha256: str = Field(description="sha256 of the training data file")
    seed: Optional[int] = Field(description="training seed")
    seconds: Optional[float] = Field(description="training time in seconds")
    steps: Optional[int] = Field(description="optimizer steps")
    final_loss: Optional[float] = Field(description="mean loss of the last tenth of the steps")


class DrafterOut(Out):
    id: int = Field(description="database id")
    slug: str = Field(description="stable identifier")
    name: str = Field(description="display name")
    method: str = Field(description="ngram, draft_model, eagle, eagle3, medusa or mtp")
    method_label: str = Field(description="the method in words")
    owner: Optional[str] = Field(description="username of the submitter")
    owner_id: Optional[int] = Field(description="user id of the submitter")
    review_state: str = Field(description="pending, approved, rejected or withdrawn")
    url: str = Field(description="the drafter's page")
    claimed_acceptance_length: Optional[float] = Field(description="AL its authors report")
    claimed_speedup: Optional[float] = Field(description="speedup its authors report")
    claimed_source: str = Field(description="where the claims are published")
    description: str = Field(description="description")
    link: str = Field(description="code, paper or model card")
    licence: str = Field(description="licence of the weights")
    content_sha256: str = Field(description="hash of the uploaded files (or of the params)")
    params: dict[str, Any] = Field(description="method parameters")
    created_at: datetime = Field(description="when it was submitted")
    target: TargetRef = Field(description="the target model it drafts for")
    trained_by_recipe: str = Field(description="training recipe, if trained here")
    training: Optional[TrainingOut] = Field(description="how it was trained, if trained here")
    total_bytes: int = Field(description="size of its files")


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
    hardware: str = Field(description="hardware class (queue)")
    position: Optional[int] = Field(description="place in its hardware class's queue "
                                                "(1 = next); null unless queued")
    cells_done: int = Field(description="cells measured")
    cells_total: int = Field(description="cells in the grid")
    progress: float = Field(description="cells_done / cells_total")
    eta_seconds: Optional[float] = Field(description="estimated seconds left while running")
    cancel_requested: bool = Field(description="a cancel was asked for")
    attempts: int = Field(description="times a worker claimed it")
    worker_host: str = Field(description="worker that measures or measured it")
    engine_version: str = Field(description="engine version, e.g. the vllm version")
    versions: dict[str, Any] = Field(description="versions of vllm, torch, transformers")
    hardware_description: str = Field(description="the hardware, in words")
    engine_args: dict[str, Any] = Field(description="engine arguments")
    error: str = Field(description="why it failed (empty otherwise)")
    log_tail: str = Field(description="last lines of its log, for a failure")
    artifact_url: Optional[str] = Field(description="download of the raw per-request "
                                                    "records; null until it succeeds")
    queued_at: datetime = Field(description="when it was queued")
    started_at: Optional[datetime] = Field(description="when a worker first claimed it")
    heartbeat_at: Optional[datetime] = Field(description="last sign of life of its worker")
    finished_at: Optional[datetime] = Field(description="when it finished")


class PageOut(Out):
    """What every paginated answer has besides its items."""
    count: int = Field(description="rows matching the filters")
    limit: int = Field(description="page size")
    offset: int = Field(description="rows skipped")


class RunPage(PageOut):
    items: list[RunOut] = Field(description="this page")


class DrafterPage(PageOut):
    items: list[DrafterOut] = Field(description="this page")


class DrafterFileOut(Out):
    name: str = Field(description="path inside the checkpoint folder")
    size: int = Field(description="bytes")
    sha256: str = Field(description="sha256 of the file")


class DrafterDetailOut(Out):
    drafter: DrafterOut = Field(description="the drafter")
    files: list[DrafterFileOut] = Field(description="its checkpoint files")
    runs: list[RunOut] = Field(description="its runs, newest first (at most 100)")


class ResultOut(Out):
    """One cell of a run's grid with its provenance (the columns of the CSV export, in
    the same order)."""
    id: int = Field(description="result id")
    run_id: int = Field(description="the run that measured the cell")
    protocol: str = Field(description="protocol slug")
    protocol_version: int = Field(description="protocol version")
    protocol_sha256: str = Field(description="sha256 of the protocol's canonical JSON")
    target: str = Field(description="target slug")
    engine: str = Field(description="engine of record")
    engine_version: str = Field(description="engine version the run used")
    hardware: str = Field(description="hardware class of the run")
    hardware_description: str = Field(description="the hardware, in words")
    run_state: str = Field(description="state of the run")
    drafter: Optional[str] = Field(description="drafter slug; null for the baseline")
    method: str = Field(description="drafter method, or baseline")
    task: str = Field(description="task")
    batch_size: int = Field(description="requests in flight at once")
    temperature: float = Field(description="sampling temperature")
    k: int = Field(description="speculation budget (0 for the baseline)")
    requests: int = Field(description="requests measured")
    generated_tokens: int = Field(description="tokens generated")
    wall_seconds: float = Field(description="wall time of the cell")
    drafts: int = Field(description="speculative steps that proposed at least one token")
    draft_tokens: int = Field(description="tokens drafted")
    accepted_tokens: int = Field(description="drafted tokens accepted (not the bonus token)")
    accepted_at: list[int] = Field(description="accepted_at[i-1]: drafts whose position i "
                                               "was accepted")
    acceptance_length: Optional[float] = Field(description="1 + accepted_tokens / drafts")
    acceptance_rate: Optional[float] = Field(description="accepted_tokens / draft_tokens")
    per_position_acceptance: list[float] = Field(description="alpha_i = accepted_at[i] / "
                                                             "drafts")
    conditional_acceptance: list[float] = Field(description="beta_i = accepted_at[i] / "
                                                            "accepted_at[i-1]")
    output_throughput: Optional[float] = Field(description="generated tokens / wall seconds")
    ttft_mean: Optional[float] = Field(description="time to first token, mean (s)")
    ttft_p50: Optional[float] = Field(description="time to first token, p50 (s)")
    ttft_p90: Optional[float] = Field(description="time to first token, p90 (s)")
    ttft_p99: Optional[float] = Field(description="time to first token, p99 (s)")
    tpot_mean: Optional[float] = Field(description="time per output token, mean (s)")
    tpot_p50: Optional[float] = Field(description="time per output token, p50 (s)")
    tpot_p90: Optional[float] = Field(description="time per output token, p90 (s)")
    tpot_p99: Optional[float] = Field(description="time per output token, p99 (s)")
    speedup: Optional[float] = Field(description="throughput / the baseline cell's; null "
                                                 "until the baseline is measured")
    lossless_share: Optional[float] = Field(description="at temperature 0: share of requests "
                                                        "equal to the baseline's output")
    measured_at: str = Field(description="when the cell was measured (ISO 8601, UTC)")
    baseline_result_id: Optional[int] = Field(description="the baseline cell speedup divides by")
    tokens_per_step: Optional[float] = Field(description="decode tokens / decode steps "
                                                         "(from the raw records; null "
                                                         "without them and for the baseline)")
    predicted_speedup: Optional[float] = Field(description="tokens per step x t_fwd(b) / "
                                                           "(draft cost + t_fwd(b, k+1)), "
                                                           "cost model of the baseline run")
    engine_efficiency: Optional[float] = Field(description="measured speedup / predicted")
    oracle_speedup: Optional[float] = Field(description="speedup if every step proposed "
                                                        "exactly the emitted tokens, up to k")
    no_waste_speedup: Optional[float] = Field(description="own steps, verifying only the "
                                                          "accepted tokens + 1")
    prefill_share: Optional[float] = Field(description="share of request time in TTFT")
    verification_share: Optional[float] = Field(description="share of request time in "
                                                            "verification (cost model)")
    drafting_other_share: Optional[float] = Field(description="share in drafting, rejection "
                                                              "sampling and other overhead")


class ResultPage(PageOut):
    items: list[ResultOut] = Field(description="this page")


class SubmitOut(Out):
    drafter: DrafterOut = Field(description="the new drafter")
    run: RunOut = Field(description="its queued run (follow it at /api/runs/{id})")


class WithdrawOut(Out):
    drafter: DrafterOut = Field(description="the drafter, now withdrawn")
    runs_cancelled: int = Field(description="unfinished runs cancelled or asked to stop")


class MeOut(Out):
    username: str = Field(description="the token's user")
    is_staff: bool = Field(description="staff may manage every drafter and run")


# ---- query parameters ----------------------------------------------------------------

class PageQuery(Schema):
    limit: int = Field(100, ge=1, le=MAX_LIMIT, description=f"page size (at most {MAX_LIMIT})")
    offset: int = Field(0, ge=0, le=INT_MAX, description="rows to skip")


class ResultFilters(PageQuery):
    protocol: Optional[str] = Field(None, pattern=PROTOCOL_REF, max_length=80,
                                    description='protocol slug, or "slug@version"')
    version: Optional[int] = Field(None, ge=1, le=INT_MAX, description="protocol version")
    target: Optional[str] = Field(None, pattern=SLUG, max_length=50, description="target slug")
    drafter: Optional[str] = Field(None, pattern=SLUG, max_length=50, description="drafter slug")
    method: Optional[Literal[METHODS + ("baseline",)]] = Field(  # type: ignore[valid-type]
        None, description="drafter method, or baseline for the baseline runs")
    task: Optional[str] = Field(None, pattern=TASK, max_length=50, description="task")
    batch_size: Optional[int] = Field(None, ge=1, le=INT_MAX, description="batch size")
    temperature: Optional[float] = Field(None, ge=0, le=1000, allow_inf_nan=False,
                                         description="sampling temperature")
    k: Optional[int] = Field(None, ge=0, le=INT_MAX, description="speculation budget (0: "
                                                                 "the baseline)")
    run: Optional[int] = Field(None, ge=1, le=ID_MAX, description="run id")
    run_state: Optional[Literal["queued", "running", "succeeded", "failed", "cancelled"]] = \
        Field(None, description="state of the run (default: every state)")
    format: Optional[Literal["csv", "json"]] = Field(
        None, description="csv or json: export every matching row at once, streamed, as a "
                          "file (limit and offset are ignored); absent: one JSON page")


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


class DrafterFilters(PageQuery):
    target: Optional[str] = Field(None, pattern=SLUG, max_length=50, description="target slug")
    method: Optional[Literal[METHODS]] = Field(None, description="method")  # type: ignore
    owner: Optional[str] = Field(None, max_length=150, pattern=r"^[\w.@+-]+$",
                                 description="username of the submitter")
    review_state: Optional[Literal["pending", "approved", "rejected", "withdrawn"]] = Field(
        None, description="review state (default: every state but withdrawn and rejected)")


DRAFTER_SLUG = Path(..., pattern=SLUG, max_length=50, description="drafter slug")
RUN_ID = Path(..., ge=1, le=ID_MAX, description="run id")


# ---- reads ---------------------------------------------------------------------------

@api.get("/targets", response=list[TargetOut], tags=["reads"], summary="Target models")
def list_targets(request):
    return selectors.target_list()


@api.get("/protocols", response=list[ProtocolOut], tags=["reads"],
         summary="Protocols, with their canonical spec JSON and sha256")
def list_protocols(request):
    return selectors.protocol_list_with_specs()


@api.get("/protocols/{slug}/{version}", response={200: ProtocolDetailOut, **errors(404)},
         tags=["reads"], summary="One protocol: spec, prompt sets, metric definitions")
def get_protocol(request, slug: str = Path(..., pattern=SLUG, max_length=50,
                                          description="protocol slug"),
                 version: int = Path(..., ge=1, le=INT_MAX, description="protocol version")):
    protocol = selectors.get_protocol(f"{slug}@{version}")
    if protocol is None:
        raise not_found("version", f"no protocol {slug} v{version}: see /api/protocols")
    return selectors.protocol_detail(protocol)


# ---- when does it pay? -----------------------------------------------------------------

class DrafterRefOut(Out):
    slug: str = Field(description="drafter slug")
    name: str = Field(description="drafter name")
    method: str = Field(description="drafter method")
    url: str = Field(description="the drafter's page")


class AnalysisRunOut(Out):
    drafter: DrafterRefOut = Field(description="the drafter")
    run_id: int = Field(description="its newest succeeded run, which the figures come from")
    has_records: bool = Field(description="whether the run has raw per-request records "
                                          "(needed for breakdown, bounds and costs)")
    baseline_run_id: Optional[int] = Field(description="the baseline run its speedups "
                                                       "divide by and its cost model is "
                                                       "fitted on")


class MatrixCellOut(Out):
    batch_size: int = Field(description="batch size")
    drafter: Optional[DrafterRefOut] = Field(description="the best drafter; null: the "
                                                         "baseline (no drafter beats it)")
    k: Optional[int] = Field(description="its speculation budget")
    speedup: float = Field(description="its measured speedup (1.0 for the baseline)")
    best_drafter_speedup: Optional[float] = Field(description="the best drafter's measured "
                                                              "speedup, even below 1")


class MatrixRowOut(Out):
    task: str = Field(description="task")
    cells: list[Optional[MatrixCellOut]] = Field(description="one per batch size, in the "
                                                             "protocol's order")


class BatchBoundsOut(Out):
    batch_size: int = Field(description="batch size")
    measured_speedup: Optional[float] = Field(description="summed throughput over the "
                                                          "baseline's, all tasks")
    predicted_speedup: Optional[float] = Field(description="from tokens per step and the "
                                                           "measured costs, all tasks")
    oracle_speedup: Optional[float] = Field(description="every step proposes exactly the "
                                                        "tokens emitted, up to k, at no "
                                                        "draft cost")
    shares: Optional[dict[str, float]] = Field(description="share of the wall time per "
                                                           "phase (prefill, verification, "
                                                           "drafting_other; reference "
                                                           "traces: drafting, verification, "
                                                           "sampling, other)")


class CrossoverOut(Out):
    measured: Optional[int] = Field(description="smallest measured batch size whose "
                                                "speedup is below 1; null: never")
    interpolated: Optional[float] = Field(description="where the speedup crosses 1, "
                                                      "linear in log2 b between measured "
                                                      "batch sizes")


class CurveOut(Out):
    drafter: DrafterRefOut = Field(description="the drafter")
    k: int = Field(description="speculation budget")
    by_batch: list[BatchBoundsOut] = Field(description="speedups per batch size")
    crossover: CrossoverOut = Field(description="crossover batch size")
    mean_speedup: Optional[float] = Field(description="mean measured speedup over batch "
                                                      "sizes")


class ParetoOut(Out):
    drafter: DrafterRefOut = Field(description="the drafter")
    k: int = Field(description="speculation budget")
    cost: Optional[float] = Field(description="measured draft cost per step over the "
                                              "target's forward time t_fwd(b)")
    al: Optional[float] = Field(description="acceptance length from summed counts")
    frontier: bool = Field(description="not dominated (lower cost and higher AL)")


class CombineDrafterOut(Out):
    drafter: DrafterRefOut = Field(description="the drafter")
    tokens_per_step: Optional[float] = Field(description="its decode tokens per step on "
                                                         "the same requests")


class CombineOut(Out):
    task: str = Field(description="task")
    batch_size: int = Field(description="batch size")
    k: int = Field(description="speculation budget")
    requests: int = Field(description="requests every combined drafter has, with the "
                                      "baseline's output")
    tokens: int = Field(description="decode tokens of those requests")
    steps: int = Field(description="steps of the oracle combination")
    al_combine: float = Field(description="tokens / steps of the combination")
    speedup_bound: Optional[float] = Field(description="its speedup by the cost model, "
                                                       "without draft cost")
    drafters: list[CombineDrafterOut] = Field(description="each drafter on the same "
                                                          "requests")


class ProtocolAnalysisOut(Out):
    protocol: ProtocolSummaryOut = Field(description="the protocol")
    temperature: float = Field(description="the temperature of every figure here")
    tasks: list[str] = Field(description="tasks")
    batch_sizes: list[int] = Field(description="batch sizes")
    ks: list[int] = Field(description="speculation budgets")
    drafters: list[AnalysisRunOut] = Field(description="the runs analysed")
    matrix: list[MatrixRowOut] = Field(description="best drafter per task and batch size")
    curves: list[CurveOut] = Field(description="per (drafter, k): speedups by batch size "
                                               "and crossover")
    pareto: list[ParetoOut] = Field(description="acceptance against draft cost")
    combine: list[CombineOut] = Field(description="oracle combination across drafters "
                                                  "(temperature 0)")
    definitions: list[tuple[str, str]] = Field(description="(name, definition) of each "
                                                           "figure")
    has_records: bool = Field(description="whether any run has raw records")


class TaskWeightOut(Out):
    task: str = Field(description="task")
    weight: float = Field(description="normalised weight")


class TaskOptionOut(Out):
    task: str = Field(description="task")
    throughput: Optional[float] = Field(description="measured output tokens / s")
    speedup: Optional[float] = Field(description="over the baseline's cell")


class OptionOut(Out):
    drafter: Optional[DrafterRefOut] = Field(description="the drafter; null: the baseline")
    k: int = Field(description="speculation budget (0 for the baseline)")
    throughput: float = Field(description="expected throughput of the mix: 1 / sum(w_t / "
                                          "throughput_t)")
    speedup: Optional[float] = Field(description="over the baseline's mix throughput")
    speedup_min: Optional[float] = Field(description="smallest per-task speedup")
    speedup_max: Optional[float] = Field(description="largest per-task speedup")
    per_task: list[TaskOptionOut] = Field(description="per task of the mix")


class RecommendOut(Out):
    protocol: ProtocolSummaryOut = Field(description="the protocol")
    temperature: float = Field(description="temperature of the cells used")
    requested_batch_size: int = Field(description="the batch size asked for")
    batch_size: Optional[int] = Field(description="the nearest measured batch size used")
    mix: list[TaskWeightOut] = Field(description="the task mix, normalised")
    best: Optional[OptionOut] = Field(description="the option with the highest throughput")
    options: list[OptionOut] = Field(description="every option, best first")


class RecommendQuery(Schema):
    protocol: str = Field(pattern=PROTOCOL_REF, max_length=80,
                          description='protocol slug, or "slug@version"')
    batch_size: int = Field(ge=1, le=INT_MAX, description="requests in flight at once (the "
                                                          "nearest measured one is used)")
    mix: str = Field("", max_length=2000, description='task weights, e.g. '
                     '"chat:0.5,code:0.5" (normalised; empty: every task equally)')
    temperature: Optional[float] = Field(None, ge=0, le=1000, allow_inf_nan=False,
                                         description="one of the protocol's temperatures "
                                                     "(default: its first)")


def _temperature(protocol, temperature):
    temps = [float(t) for t in protocol.spec["temperatures"]]
    if temperature is not None and float(temperature) not in temps:
        raise ApiError(422, problem("(query)", "temperature", "the protocol measures "
                                    "temperatures " + ", ".join(f"{t:g}" for t in temps)))
    return temperature


@api.get("/protocols/{slug}/{version}/analysis",
         response={200: ProtocolAnalysisOut, **errors(404, 422)}, tags=["reads"],
         url_name="protocol_analysis",
         summary="When does it pay? Bounds, best drafter per task and batch size, crossover, "
                 "Pareto, oracle combination")
def protocol_analysis(request, slug: str = Path(..., pattern=SLUG, max_length=50,
                                               description="protocol slug"),
                      version: int = Path(..., ge=1, le=INT_MAX,
                                          description="protocol version"),
                      temperature: Optional[float] = Query(
                          None, ge=0, le=1000, allow_inf_nan=False,
                          description="one of the protocol's temperatures (default: its "
                                      "first)")):
    """The figures of the protocol's "When does it pay?" page (definitions in
    `definitions` and in worker/analysis.py)."""
    protocol = selectors.get_protocol(f"{slug}@{version}")
    if protocol is None:
        raise not_found("version", f"no protocol {slug} v{version}: see /api/protocols")
    return selectors.protocol_pays(protocol, _temperature(protocol, temperature))


@api.get("/recommend", response={200: RecommendOut, **errors(404, 422)}, tags=["reads"],
         summary="The drafter and k with the highest measured throughput for a task mix "
                 "and batch size")
def recommend(request, q: Query[RecommendQuery]):
    """Per (drafter, k), the mix's throughput is the weighted harmonic mean of its cells'
    measured throughput (time per token adds up); the baseline is an option too."""
    protocol = selectors.get_protocol(q.protocol)
    if protocol is None:
        raise not_found("protocol", f"no protocol {q.protocol!r}: see /api/protocols")
    tasks = [t["task"] for t in protocol.spec["tasks"]]
    try:
        mix = selectors.parse_mix(q.mix, tasks)
    except ValueError as e:
        raise ApiError(422, problem("(query)", "mix", str(e))) from None
    return selectors.recommendation(protocol, mix, q.batch_size,
                                    _temperature(protocol, q.temperature))


@api.get("/drafters", response={200: DrafterPage, **errors(422)}, tags=["reads"],
         summary="Drafters (withdrawn and rejected ones only on request)")
def list_drafters(request, filters: Query[DrafterFilters]):
    count, items = selectors.drafters_page(
        target=filters.target, method=filters.method, owner=filters.owner,
        review_state=filters.review_state, limit=filters.limit, offset=filters.offset)
    return {"count": count, "limit": filters.limit, "offset": filters.offset, "items": items}


@api.get("/drafters/{slug}", response={200: DrafterDetailOut, **errors(404)}, tags=["reads"],
         summary="One drafter, its files and its runs")
def get_drafter(request, slug: str = DRAFTER_SLUG):
    page = selectors.drafter_page(slug)
    if page is None:
        raise not_found("slug", f"no drafter {slug!r}: see /api/drafters")
    return {"drafter": page["drafter"], "files": page["files"],
            "runs": [_api_run(r) for r in page["runs"]]}


def _api_run(summary: dict) -> dict:
    """A run_summary with its artifact link pointing at the API's download."""
    if summary.get("artifact_url"):
        summary = dict(summary, artifact_url=reverse("api:run_artifact", args=[summary["id"]]))
    return summary


@api.get("/runs", response={200: RunPage, **errors(422)}, tags=["reads"],
         summary="Runs, newest first: state, progress, queue position, error")
def list_runs(request, filters: Query[RunFilters]):
    count, items = selectors.runs_page(
        state=filters.state, hardware=filters.hardware, drafter=filters.drafter,
        protocol=filters.protocol, version=filters.version, baseline=filters.baseline,
        limit=filters.limit, offset=filters.offset)
    return {"count": count, "limit": filters.limit, "offset": filters.offset,
            "items": [_api_run(r) for r in items]}




@api.get("/runs/{run_id}", response={200: RunOut, **errors(404)}, tags=["reads"],
         summary="One run: state, progress, queue position, error")
def get_run(request, run_id: int = RUN_ID):
    run = selectors.run_with_position(run_id)
    if run is None:
        raise not_found("run_id", f"no run {run_id}")
    return _api_run(run)


@api.get("/runs/{run_id}/artifact", response={200: None, **errors(404)}, tags=["reads"],
         url_name="run_artifact", summary="Raw per-request records of a run (gzipped JSON lines)",
         openapi_extra={"responses": {200: {
             "description": "the run's raw per-request records, one JSON object a line, gzipped",
             "content": {"application/gzip": {"schema": {"type": "string",
                                                         "format": "binary"}}}}}})
def run_artifact(request, run_id: int = RUN_ID):
    run = Run.objects.filter(pk=run_id).only("pk", "state", "artifact").first()
    if run is None:
        raise not_found("run_id", f"no run {run_id}")
    if not run.artifact:
        raise not_found("artifact", f"run {run_id} is {run.state} and has no raw data yet: "
                                    "it is written when the run succeeds")
    if not default_storage.exists(run.artifact.name):
        raise not_found("artifact", f"the raw data of run {run_id} is missing from the storage")
    return FileResponse(default_storage.open(run.artifact.name, "rb"), as_attachment=True,
                        filename=f"specboard-run-{run_id}-requests.jsonl.gz",
                        content_type="application/gzip")


RESULTS_EXTRA = {"responses": {200: {"content": {
    "text/csv": {"schema": {"type": "string"}},
}}}}


@api.get("/results", response={200: ResultPage, **errors(422)}, tags=["reads"],
         summary="Results: one row per cell, filtered; paginated JSON, or CSV/JSON export",
         openapi_extra=RESULTS_EXTRA)
def list_results(request, filters: Query[ResultFilters]):
    """One row per measured cell (run, task, batch size, temperature, k), each with the
    protocol slug, version and sha256, the engine version, the hardware class and the run
    id. Without `format`: one page (`limit`, `offset`). With `format=csv` or `format=json`:
    every matching row, streamed in constant memory, as a download named after the
    protocol and the date (`specboard-results-<protocol>-v<version>-<date>.csv`)."""
    qs = selectors.results_queryset(
        protocol=filters.protocol, version=filters.version, target=filters.target,
        drafter=filters.drafter, method=filters.method, task=filters.task,
        batch_size=filters.batch_size, temperature=filters.temperature, k=filters.k,
        run=filters.run, run_state=filters.run_state)
    if filters.format:
        return export_response(qs, filters.format, export_filename(filters, filters.format))
    count, items = selectors.results_page(qs, filters.limit, filters.offset)
    return {"count": count, "limit": filters.limit, "offset": filters.offset, "items": items}


# ---- export --------------------------------------------------------------------------

def export_filename(filters, ext: str) -> str:
    """specboard-results-<slug>[-v<version>]-<date>.<ext> (all-protocols without one)."""
    name = "all-protocols"
    if filters.protocol:
        slug, _, v = filters.protocol.partition("@")
        version = v or (str(filters.version) if filters.version else "")
        name = slug + (f"-v{version}" if version else "")
    elif filters.version:
        name = f"all-protocols-v{filters.version}"
    return f"specboard-results-{name}-{timezone.now().date().isoformat()}.{ext}"


ROWS_PER_WRITE = 2000
# On PostgreSQL the CSV lines are written by the database (COPY ... TO STDOUT), several
# times faster than csv.writer; elsewhere (SQLite) by csv.writer. Same columns and values.
CSV_BY_COPY = True
COPY_BLOCK_BYTES = 1 << 18


def csv_chunks(qs):
    """The CSV bytes of every row, a header first, in chunks (constant memory)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(selectors.RESULT_COLUMNS)
    if CSV_BY_COPY and connection.vendor == "postgresql":
        yield buf.getvalue().encode()
        yield from selectors.result_csv_blocks(qs, block_bytes=COPY_BLOCK_BYTES)
        return
    n = 0
    for row in selectors.result_rows(qs, json_as_text=True, chunk_size=ROWS_PER_WRITE):
        writer.writerow(row)
        n += 1
        if n == ROWS_PER_WRITE:
            yield buf.getvalue().encode()
            buf.seek(0)
            buf.truncate()
            n = 0
    if buf.tell():
        yield buf.getvalue().encode()


def json_chunks(qs):
    """A JSON array of row objects (the ResultOut fields), streamed."""
    columns = selectors.RESULT_COLUMNS
    dumps = json.JSONEncoder(ensure_ascii=False, allow_nan=False,
                             separators=(",", ":")).encode
    parts, sep = ["["], ""
    for row in selectors.result_rows(qs, chunk_size=ROWS_PER_WRITE):
        parts.append(sep + dumps(dict(zip(columns, row))))
        sep = ",\n"
        if len(parts) >= ROWS_PER_WRITE:
            yield "".join(parts)
            parts = []
    parts.append("]\n")
    yield "".join(parts)


def export_response(qs, fmt: str, filename: str) -> StreamingHttpResponse:
    if fmt == "csv":
        chunks, content_type = csv_chunks(qs), "text/csv; charset=utf-8"
    else:
        chunks, content_type = (c.encode() for c in json_chunks(qs)), "application/json"
    response = StreamingHttpResponse(chunks, content_type=content_type)
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    response["Cache-Control"] = "no-store"
    return response


# ---- writes --------------------------------------------------------------------------

@api.get("/me", response={200: MeOut, **errors(401)}, auth=token_auth, tags=["writes"],
         summary="Whose token this is")
def me(request):
    return {"username": request.auth.username, "is_staff": request.auth.is_staff}


# A multipart form cannot send null: an optional field is left out (or sent empty).
Opt = SkipJsonSchema[None]


class SubmitIn(Schema):
    protocol: str = Field(pattern=PROTOCOL_REF, max_length=80,
                          description='the protocol to measure under: "slug@version", or '
                                      "the slug for its newest version")
    method: Literal[METHODS] = Field(description="the drafter's method")  # type: ignore
    name: str = Field(min_length=1, max_length=200, description="display name")
    target: Annotated[str, Field(pattern=SLUG, max_length=50)] | Opt = Field(
        None, description="target slug (default: the protocol's)")
    description: str = Field("", max_length=20000, description="description")
    link: str = Field("", max_length=200, description="code, paper or model card URL")
    licence: str = Field("", max_length=100, description="e.g. Apache-2.0")
    claimed_acceptance_length: Annotated[float, Field(ge=1, le=1e6, allow_inf_nan=False)] | \
        Opt = Field(None, description="AL its authors report")
    claimed_speedup: Annotated[float, Field(ge=0, le=1e6, allow_inf_nan=False)] | Opt = Field(
        None, description="speedup its authors report")
    claimed_source: str = Field("", max_length=200, description="URL of the claims (needed "
                                                                "with a claim)")
    k: Annotated[int, Field(ge=0, le=INT_MAX)] | Opt = Field(
        None, description="one of the protocol's ks")
    prompt_lookup_min: Annotated[int, Field(ge=-INT_MAX, le=INT_MAX)] | Opt = Field(
        None, description="ngram only: 1-16")
    prompt_lookup_max: Annotated[int, Field(ge=-INT_MAX, le=INT_MAX)] | Opt = Field(
        None, description="ngram only: 1-16, >= the min")

    @field_validator("target", "claimed_acceptance_length", "claimed_speedup", "k",
                     "prompt_lookup_min", "prompt_lookup_max", mode="before")
    @classmethod
    def _empty_is_absent(cls, value):
        return None if value == "" else value


FORM_FIELDS = ("method", "name", "description", "link", "licence", "claimed_acceptance_length",
               "claimed_speedup", "claimed_source", "k", "prompt_lookup_min",
               "prompt_lookup_max")


def _form_problems(form) -> list[dict]:
    out = []
    for field, errs in form.errors.get_json_data().items():
        name = "files" if field == "files" else field
        for e in errs:
            out.append(problem("(upload)" if field == "files" else "(form)",
                               "(form)" if name == "__all__" else name, e["message"]))
    return out


@api.post("/drafters", response={201: SubmitOut, **errors(401, 409, 413, 422, 429)},
          auth=submit_auth, tags=["writes"], summary="Submit a drafter (multipart)")
def submit(request, data: Form[SubmitIn],
           files: list[UploadedFile] = File(None, description=(
               "checkpoint files: config.json plus *.safetensors, or one .zip / .tar.gz "
               "archive; none for ngram"))):
    """The same validation as the submit page (worker/checkpoint.py through
    leaderboard/submissions.py): config.json plus *.safetensors as several `files`, or one
    .zip / .tar.gz; no files for ngram. Nothing is stored when it is refused."""
    protocol = selectors.get_protocol(data.protocol)
    if protocol is None:
        raise ApiError(422, problem("(form)", "protocol", f"no protocol {data.protocol!r}: "
                                                          "see /api/protocols"))
    target_id = protocol.target_id
    if data.target:
        target = Target.objects.filter(slug=data.target).first()
        if target is None:
            raise ApiError(422, problem("(form)", "target", f"no target {data.target!r}: see "
                                                            "/api/targets"))
        target_id = target.pk
    form_data = {f: getattr(data, f) for f in FORM_FIELDS if getattr(data, f) is not None}
    form_data.update(protocol=protocol.pk, target=target_id)
    form = SubmitForm(form_data, MultiValueDict({"files": list(files or [])}))
    if not form.is_valid():
        raise ApiError(422, *_form_problems(form))
    cleaned = form.cleaned_data
    drafter, run = submissions.submit_drafter(
        owner=request.auth, protocol=cleaned["protocol"], method=cleaned["method"],
        name=cleaned["name"], uploads=[Upload(f.name, f, f.size) for f in cleaned["files"]],
        params=form.params(), description=cleaned["description"], link=cleaned["link"],
        licence=cleaned["licence"],
        claimed_acceptance_length=cleaned["claimed_acceptance_length"],
        claimed_speedup=cleaned["claimed_speedup"], claimed_source=cleaned["claimed_source"])
    page = selectors.drafter_page(drafter.slug)
    return Status(201, {"drafter": page["drafter"],
                        "run": _api_run(selectors.run_with_position(run.pk))})


@api.post("/runs/{run_id}/cancel", response={200: RunOut, **errors(401, 403, 404, 409)},
          auth=token_auth, tags=["writes"], summary="Cancel one's own run")
def cancel_run(request, run_id: int = RUN_ID):
    """A queued run is cancelled at once; a running one stops after the cell it is
    measuring (its state stays running with cancel_requested true until then)."""
    run = selectors.get_run(run_id)
    if run is None:
        raise not_found("run_id", f"no run {run_id}")
    if not permissions.can_manage_run(request.auth, run):
        raise not_manager()
    if run.state in Run.FINISHED:
        raise ApiError(409, problem("(path)", "run_id", f"run {run_id} already {run.state}"))
    submissions.cancel_run(run)
    return _api_run(selectors.run_with_position(run_id))


@api.post("/drafters/{slug}/withdraw", response={200: WithdrawOut, **errors(401, 403, 404)},
          auth=token_auth, tags=["writes"], summary="Withdraw one's own drafter")
def withdraw(request, slug: str = DRAFTER_SLUG):
    """Hides the drafter from the leaderboard and the results, and cancels its
    unfinished runs."""
    drafter = Drafter.objects.filter(slug=slug).first()
    if drafter is None:
        raise not_found("slug", f"no drafter {slug!r}")
    if not permissions.can_manage_drafter(request.auth, drafter):
        raise not_manager()
    n = submissions.withdraw_drafter(drafter)
    return {"drafter": selectors.drafter_page(slug)["drafter"], "runs_cancelled": n}
