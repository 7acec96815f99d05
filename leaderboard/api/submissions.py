"""Submissions: what intake (leaderboard/services/intake.py) made of each attempt, for its
submitter. POST /api/drafters answers 202 with one of these, in the state "checking"; poll
its ``url`` here until it is accepted (its drafter and run given) or refused (its problems)."""
from __future__ import annotations

from datetime import datetime
from typing import Any, Literal, Optional

from ninja import Path, Query, Router, Schema
from pydantic import Field

from ..selectors import submissions as submission_reads
from .auth import token_auth
from .common import ID_MAX, Out
from .errors import ProblemOut, error_responses, not_found
from .runs import RunDrafterRef, RunProtocolRef

router = Router()

SUBMISSION_ID = Path(..., ge=1, le=ID_MAX, description="submission id")


class SubmittedFile(Out):
    name: str = Field(description="path inside the checkpoint, as uploaded")
    size: Optional[int] = Field(description="bytes")


class SubmissionRun(Out):
    id: int = Field(description="run id: GET /api/runs/{id}")
    state: str = Field(description="the run's state")
    url: str = Field(description="the run's page")


class SubmissionOut(Out):
    id: int = Field(description="submission id")
    state: Literal["checking", "accepted", "refused", "failed"] = Field(description=(
        "checking: waiting for or in the intake worker's checks; accepted: the drafter is "
        "stored and its run queued; refused: see problems (nothing stored); failed: the site "
        "could not check it (the hub unreachable, a fault), submit again"))
    name: str = Field(description="display name, as submitted")
    method: str = Field(description="the drafter's method")
    owner: Optional[str] = Field(description="username of the submitter")
    protocol: Optional[RunProtocolRef] = Field(description="the protocol to measure under")
    hub_reference: Optional[str] = Field(description="owner/name@revision, for a hub "
                                         "submission (the commit measured is the drafter's "
                                         "intake.hub.commit)")
    files: list[SubmittedFile] = Field(description="the files uploaded")
    params: dict[str, Any] = Field(description="method parameters, checked")
    problems: list[ProblemOut] = Field(description="why it was refused or failed")
    drafter: Optional[RunDrafterRef] = Field(description="the drafter, once accepted")
    run: Optional[SubmissionRun] = Field(description="its measurement run, once accepted")
    position: Optional[int] = Field(description="1 + the submissions ahead of it in the "
                                    "intake queue, while checking")
    attempts: int = Field(description="checks started (a worker that stopped mid-check is "
                          "replaced)")
    created_at: datetime = Field(description="received at")
    finished_at: Optional[datetime] = Field(description="accepted, refused or failed at")
    url: str = Field(description="the submission's page")


class SubmissionList(Out):
    items: list[SubmissionOut] = Field(description="newest first")
    checking: int = Field(description="submissions of all users being checked now")


class SubmissionFilters(Schema):
    limit: int = Field(50, ge=1, le=200, description="at most this many, newest first")


@router.get("/submissions", response={200: SubmissionList, **error_responses(401, 422)},
            auth=token_auth, tags=["writes"], summary="One's own submissions")
def list_submissions(request, filters: Query[SubmissionFilters]):
    return {"items": submission_reads.of_owner(request.auth, limit=filters.limit),
            "checking": submission_reads.checking_count()}


@router.get("/submissions/{submission_id}",
            response={200: SubmissionOut, **error_responses(401, 404, 422)}, auth=token_auth,
            tags=["writes"], summary="One submission: checking, accepted or refused")
def get_submission(request, submission_id: int = SUBMISSION_ID):
    """Its submitter's, or staff's. Poll it after POST /api/drafters."""
    submission = submission_reads.for_viewer(request.auth, submission_id)
    if submission is None:
        raise not_found("submission_id", f"no submission {submission_id} of yours")
    return submission_reads.summary(submission, viewer=request.auth)
