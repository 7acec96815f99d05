"""Drafters: the list and one drafter's page, and the owner's writes: submit one
(multipart upload or hub reference; checked by the intake worker: leaderboard/api/submissions.py
follows it) and withdraw it. Reads and writes share this router because ninja
gives each router its own URL patterns: GET and POST /drafters must be in one."""
from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal, Optional

from django.utils.datastructures import MultiValueDict
from ninja import File, Form, Path, Query, Router, Schema, Status, UploadedFile
from pydantic import Field, field_validator
from pydantic.json_schema import SkipJsonSchema

from worker.checkpoint import Upload

from .. import permissions
from ..selectors import drafters, protocols
from ..selectors import runs as run_reads
from ..selectors import submissions as submission_reads
from ..services import intake, submissions
from ..forms import SubmitForm
from ..models import Drafter, Target
from .auth import submit_auth, token_auth
from .catalog import TargetRef
from .common import INT_MAX, METHODS, PROTOCOL_REF, SLUG, Out, PageOut, PageQuery
from .errors import ApiError, error_responses, not_found, not_manager, problem
from .runs import RunOut, api_run
from .submissions import SubmissionOut

router = Router()

DRAFTER_SLUG = Path(..., pattern=SLUG, max_length=50, description="drafter slug")


class TrainingOut(Out):
    recipe: str = Field(description="the training recipe (manage.py train_drafter --recipe)")
    data_slug: Optional[str] = Field(description="the shared training data it learnt from")
    data_version: Optional[int] = Field(description="version of that training data")
    data_sha256: str = Field(description="sha256 of the training data file")
    seed: Optional[int] = Field(description="training seed")
    seconds: Optional[float] = Field(description="training time in seconds")
    data_conversations: Optional[int] = Field(description="conversations in the training data")
    data_tokens: Optional[int] = Field(description="tokens in the training data")
    data_answer_tokens: Optional[int] = Field(description="answer tokens in the training data "
                                              "(the tokens the losses are computed on)")
    data_seconds: Optional[float] = Field(description="seconds the target took to write the data")
    steps: Optional[int] = Field(description="optimizer steps")
    first_loss: Optional[float] = Field(description="mean loss of the first tenth of the steps")
    final_loss: Optional[float] = Field(description="mean loss of the last tenth of the steps")
    final_top1: Optional[float] = Field(description="mean share of first drafted tokens that "
                                        "matched the target's over the last tenth of the steps, "
                                        "on training data (compare the measured position-1 "
                                        "acceptance on the evaluation prompts)")
    heldout: int = Field(description="conversations of the data left out of training (0: none)")
    heldout_top1: Optional[float] = Field(description="top-1 with the final weights on the "
                                          "held-out conversations (over-fitting: compare "
                                          "train_sample_top1)")
    train_sample_top1: Optional[float] = Field(description="top-1 with the final weights on as "
                                               "many training conversations")
    shipped: Optional[str] = Field(description="the shipped drafter's folder it was registered "
                                   "from (drafters/ in the repository), if any")


class IntakeOut(Out):
    format: str = Field(description="the published format it was submitted in: safetensors, "
                        "speculators, pytorch_model.bin (SafeAILab EAGLE), FasterDecoding "
                        "Medusa (empty: stored before intake recorded it)")
    converted_from: dict[str, str] = Field(description="stored file -> the uploaded pickle it "
                                           "was converted from")
    notes: list[str] = Field(description="what intake changed or dropped, and warnings")
    verifier: Optional[str] = Field(description="the target a speculators config names")
    hub: Optional[dict[str, str]] = Field(description="submitted by model-hub reference: "
                                          "repo_id, revision (as given) and commit (what is "
                                          "measured)")


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
    content_sha256: str = Field(description="hash of the tensors (names, dtypes, shapes, bytes) "
                                "and config, or of the method and params without files")
    intake: IntakeOut = Field(description="the published format and what intake did to it")
    params: dict[str, Any] = Field(description="method parameters")
    created_at: datetime = Field(description="when it was submitted")
    target: TargetRef = Field(description="the target model it drafts for")
    trained_by_recipe: str = Field(description="training recipe, if trained here")
    training: Optional[TrainingOut] = Field(description="how it was trained, if trained here")
    total_bytes: int = Field(description="size of its files")


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


class DrafterFilters(PageQuery):
    target: Optional[str] = Field(None, pattern=SLUG, max_length=50, description="target slug")
    method: Optional[Literal[METHODS]] = Field(None, description="method")  # type: ignore
    owner: Optional[str] = Field(None, max_length=150, pattern=r"^[\w.@+-]+$",
                                 description="username of the submitter")
    review_state: Optional[Literal["pending", "approved", "rejected", "withdrawn"]] = Field(
        None, description="review state (default: every state but withdrawn and rejected)")


class SubmitOut(Out):
    drafter: DrafterOut = Field(description="the new drafter")
    run: RunOut = Field(description="its queued run (follow it at /api/runs/{id})")


class WithdrawOut(Out):
    drafter: DrafterOut = Field(description="the drafter, now withdrawn")
    runs_cancelled: int = Field(description="unfinished runs cancelled or asked to stop")


@router.get("/drafters", response={200: DrafterPage, **error_responses(422)},
            tags=["reads"], summary="Drafters (withdrawn and rejected ones only on request)")
def list_drafters(request, filters: Query[DrafterFilters]):
    """Rejected drafters are listed for staff only (signed in to the site)."""
    if not permissions.can_see(request.user, filters.review_state):
        return {"count": 0, "limit": filters.limit, "offset": filters.offset, "items": []}
    count, items = drafters.drafters_page(
        target=filters.target, method=filters.method, owner=filters.owner,
        review_state=filters.review_state, limit=filters.limit, offset=filters.offset)
    return {"count": count, "limit": filters.limit, "offset": filters.offset, "items": items}


@router.get("/drafters/{slug}", response={200: DrafterDetailOut, **error_responses(404)},
            tags=["reads"], summary="One drafter, its files and its runs")
def get_drafter(request, slug: str = DRAFTER_SLUG):
    page = drafters.drafter_page(slug)
    if page is None or not permissions.can_see(request.user, page["drafter"]["review_state"]):
        raise not_found("slug", f"no drafter {slug!r}: see /api/drafters")
    return {"drafter": page["drafter"], "files": page["files"],
            "runs": [api_run(r) for r in page["runs"]]}


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
    hub_reference: str = Field("", max_length=300, description=(
        "owner/name or owner/name@revision (a branch, a tag or a commit hash) on the model "
        "hub, instead of files: the revision is pinned to its commit, which is measured"))

    @field_validator("target", "claimed_acceptance_length", "claimed_speedup", "k",
                     "prompt_lookup_min", "prompt_lookup_max", mode="before")
    @classmethod
    def _empty_is_absent(cls, value):
        return None if value == "" else value


FORM_FIELDS = ("method", "name", "description", "link", "licence", "claimed_acceptance_length",
               "claimed_speedup", "claimed_source", "k", "prompt_lookup_min",
               "prompt_lookup_max", "hub_reference")


def _form_problems(form) -> list[dict]:
    out = []
    for field, errs in form.errors.get_json_data().items():
        name = "files" if field == "files" else field
        for e in errs:
            out.append(problem("(upload)" if field == "files" else "(form)",
                               "(form)" if name == "__all__" else name, e["message"]))
    return out


@router.post("/drafters",
             response={202: SubmissionOut, **error_responses(401, 413, 422, 429, 507)},
             auth=submit_auth, tags=["writes"], summary="Submit a drafter (multipart)")
def submit(request, data: Form[SubmitIn],
           files: list[UploadedFile] = File(None, description=(
               "checkpoint files: config.json plus *.safetensors (or a published format: "
               "speculators, pytorch_model.bin, medusa_lm_head.pt) as several `files`, or "
               "one .zip / .tar.gz archive; none for ngram or with hub_reference"))):
    """The same form as the submit page. What is cheap is checked at once (422: the form,
    the method's parameters, a malformed hub reference; 429: the daily limit); the files are
    staged and answered with 202 and the submission in the state "checking". The intake
    worker then checks and converts them (worker/checkpoint/, in a sandboxed child) or
    fetches the hub reference's files at its commit: poll GET /api/submissions/{id} until it
    is accepted (its drafter, and the run measuring it) or refused (every problem by file
    and field; nothing stored)."""
    protocol = protocols.get_protocol(data.protocol)
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
    submission = intake.receive(
        owner=request.auth, protocol=cleaned["protocol"], method=cleaned["method"],
        name=cleaned["name"], uploads=[Upload(f.name, f, f.size) for f in cleaned["files"]],
        hub_reference=cleaned["hub_reference"], params=form.params(),
        description=cleaned["description"], link=cleaned["link"], licence=cleaned["licence"],
        claimed_acceptance_length=cleaned["claimed_acceptance_length"],
        claimed_speedup=cleaned["claimed_speedup"], claimed_source=cleaned["claimed_source"])
    submission.refresh_from_db()
    return Status(202, submission_reads.summary(submission, viewer=request.auth))


@router.post("/drafters/{slug}/withdraw",
             response={200: WithdrawOut, **error_responses(401, 403, 404)}, auth=token_auth,
             tags=["writes"], summary="Withdraw one's own drafter")
def withdraw(request, slug: str = DRAFTER_SLUG):
    """Hides the drafter from the leaderboard and the results, and cancels its
    unfinished runs."""
    drafter = Drafter.objects.filter(slug=slug).first()
    if drafter is None or not permissions.can_see(request.auth, drafter.review_state):
        raise not_found("slug", f"no drafter {slug!r}")   # a 403 would confirm it exists
    if not permissions.can_manage_drafter(request.auth, drafter):
        raise not_manager()
    n = submissions.withdraw_drafter(drafter)
    if n is None:   # rejected by staff meanwhile
        raise not_found("slug", f"no drafter {slug!r}")
    return {"drafter": drafters.drafter_page(slug)["drafter"], "runs_cancelled": n}
