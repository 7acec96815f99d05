"""Reads of submissions (leaderboard/services/intake.py): one submission as its page and the
API show it, a submitter's own, and the intake queue's length. A submission is seen only by
its owner and staff (a refused one never becomes public)."""
from __future__ import annotations

from django.urls import reverse

from ..models import Run, Submission
from ..permissions import can_see
from .shapes import drafter_summary, protocol_label


def for_viewer(user, pk: int) -> Submission | None:
    """The submission if ``user`` may see it (its owner, or staff), else None."""
    if not getattr(user, "is_authenticated", False):
        return None
    qs = Submission.objects.select_related("protocol", "drafter", "drafter__owner", "owner")
    if not user.is_staff:
        qs = qs.filter(owner=user)
    return qs.filter(pk=pk).first()


def position(submission: Submission) -> int | None:
    """1 + the submissions received earlier and still checking (the intake queue is first
    in, first out), for one still checking."""
    if submission.state != Submission.CHECKING:
        return None
    return Submission.objects.filter(state=Submission.CHECKING, pk__lt=submission.pk).count() + 1


def first_runs(submissions) -> dict:
    """{(drafter id, protocol id): {"pk", "state"}} of the first run each accepted
    submission queued, in one query."""
    drafters = {s.drafter_id for s in submissions if s.drafter_id}
    out = {}
    for run in (Run.objects.filter(drafter_id__in=drafters).order_by("queued_at", "pk")
                .values("pk", "state", "drafter_id", "protocol_id")):
        out.setdefault((run["drafter_id"], run["protocol_id"]), run)
    return out


def summary(submission: Submission, with_position: bool = True, viewer=None,
            runs: dict | None = None) -> dict:
    """A submission for its page and the API. Its drafter and protocol must be
    select_related by the caller. A drafter ``viewer`` may not see (rejected since) is left
    out, with its run. ``runs``: first_runs of a list it belongs to (else one query)."""
    p, d = submission.protocol, submission.drafter
    if d is not None and viewer is not None and not can_see(viewer, d.review_state):
        d = None
    run = None
    if d is not None and p is not None:
        run = (runs if runs is not None else first_runs([submission])).get((d.pk, p.pk))
    return {
        "id": submission.pk, "state": submission.state, "name": submission.name,
        "method": submission.method, "owner": submission.owner.username
        if submission.owner_id else None,
        "protocol": {"slug": p.slug, "version": p.version, "label": protocol_label(p),
                     "url": reverse("protocol", args=[p.slug, p.version])} if p else None,
        "hub_reference": submission.hub_reference or None,
        "files": [{"name": name, "size": size} for name, _, size in submission.staged],
        "params": submission.params, "problems": submission.problems,
        "drafter": drafter_summary(d) if d is not None else None,
        "run": {"id": run["pk"], "state": run["state"],
                "url": reverse("run", args=[run["pk"]])} if run else None,
        "position": position(submission) if with_position else None,
        "attempts": submission.attempts, "created_at": submission.created_at,
        "finished_at": submission.finished_at,
        "url": reverse("submission", args=[submission.pk]),
    }


def of_owner(user, limit: int = 50, state: str | None = None) -> list[dict]:
    """The user's latest submissions (in ``state``, if given), newest first."""
    qs = (Submission.objects.select_related("protocol", "drafter", "drafter__owner", "owner")
          .filter(owner=user).order_by("-created_at", "-pk"))
    if state is not None:
        qs = qs.filter(state=state)
    subs = list(qs[:limit])
    runs = first_runs(subs)
    return [summary(s, with_position=False, viewer=user, runs=runs) for s in subs]


def accepted_for(drafter_id: int) -> dict | None:
    """The submission a drafter was accepted from (None for a site drafter registered
    without intake): when it was received and accepted, for the drafter page."""
    s = (Submission.objects.filter(drafter_id=drafter_id, state=Submission.ACCEPTED)
         .values("pk", "created_at", "finished_at").first())
    return s and {"id": s["pk"], "created_at": s["created_at"], "finished_at": s["finished_at"],
                  "url": reverse("submission", args=[s["pk"]])}


def checking_count() -> int:
    return Submission.objects.filter(state=Submission.CHECKING).count()
