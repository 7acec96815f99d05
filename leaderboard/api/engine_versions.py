"""Engine versions (staff): derive a protocol version pinned to another engine version and
queue on it the baseline and the drafters its family has measured
(leaderboard/services/engine_versions.py). The family of a protocol is in its detail
(GET /api/protocols/{slug}/{version}, `engine_family`)."""
from __future__ import annotations

from typing import Optional

from ninja import Router, Schema, Status
from pydantic import Field

from ..selectors import runs as run_reads
from ..selectors.shapes import protocol_summary
from ..services import engine_versions
from .auth import token_auth
from .catalog import PROTOCOL_SLUG, PROTOCOL_VERSION, ProtocolSummaryOut, protocol_or_404
from .common import Out
from .errors import ApiError, ErrorOut, error_responses, problem
from .runs import RunOut, api_run

router = Router()


class DeriveIn(Schema):
    engine_version: str = Field(..., max_length=50,
                                description="the engine version to pin, e.g. 0.31.0")
    queue: bool = Field(True, description="queue the baseline and the family's approved "
                                          "drafters on the new version")
    title: Optional[str] = Field(None, max_length=200,
                                 description="the new version's title (default: the source's)")


class DerivedProtocolOut(ProtocolSummaryOut):
    engine_version: str = Field(description="the engine version it pins")
    queue: str = Field(description="the Celery queue its runs go to")


class DerivedOut(Out):
    protocol: DerivedProtocolOut = Field(description="the new protocol version")
    runs: list[RunOut] = Field(description="the runs queued on it, the baseline first")
    worker_hint: str = Field(description="how to start a worker for its queue")


def staff_only(user):
    if not user.is_staff:
        raise ApiError(403, problem("(request)", "Authorization",
                                    "only staff may derive protocol versions"))


@router.post("/protocols/{slug}/{version}/engine-versions",
             response={201: DerivedOut, 400: ErrorOut, **error_responses(401, 403, 404, 422)},
             auth=token_auth, tags=["writes"],
             summary="Derive a version for another engine version and queue its drafters "
                     "(staff)")
def derive_engine_version(request, body: DeriveIn, slug: str = PROTOCOL_SLUG,
                          version: int = PROTOCOL_VERSION):
    """A new version of the protocol with everything but the engine version kept (the same
    family hash); with `queue`, the baseline (shared protocols) and every approved drafter
    with a succeeded run in the family are queued on it, each once. 400 when a version of
    the family already pins that engine version, or it is not a release number."""
    staff_only(request.auth)
    source = protocol_or_404(slug, version)
    try:
        derived, new_runs = engine_versions.derive_and_queue(
            source, body.engine_version, queue=body.queue, title=body.title)
    except engine_versions.DeriveRefused as e:
        raise ApiError(400, problem("(request)", "engine_version", str(e))) from None
    spec = derived.spec
    return Status(201, {
        "protocol": {**protocol_summary(derived), "engine_version": spec.engine_version,
                     "queue": spec.queue},
        "runs": [api_run(run_reads.run_with_position(r.pk)) for r in new_runs],
        "worker_hint": engine_versions.worker_hint(derived),
    })
