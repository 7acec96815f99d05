"""Submission services: turn checkpoint files into a Drafter with its files and a queued run,
and the owner's later edits (edit, withdraw, cancel). The submit page, the REST API and the
submit_drafter command go through intake (leaderboard/services/intake.py), whose worker calls
`submit_drafter`; the site's own drafters (setup_demo, training) call it directly.

A refused submission stores nothing: the files are validated by worker.checkpoint in a
temporary directory first; only then are they written through Django's default storage,
inside one transaction with the rows, and any failure deletes what was written.
"""
from __future__ import annotations

import errno
import hashlib
from datetime import timedelta
from pathlib import PurePosixPath

from django.conf import settings
from django.core.files import File
from django.core.files.storage import default_storage
from django.db import transaction
from django.urls import reverse
from django.utils import timezone
from django.utils.text import slugify

from worker.checkpoint import CheckpointRejected, Problem, TargetFacts, validate_method_params
from worker.checkpoint.sandboxed import validate_in_sandbox
from worker.protocol import canonical_json

from . import runs
from ..models import Drafter, DrafterFile, Protocol, Run, Submission

EDITABLE_FIELDS = ("name", "description", "link", "licence", "claimed_acceptance_length",
                   "claimed_speedup", "claimed_source")


class SubmissionRefused(Exception):
    """The submission was refused; `problems` are worker.checkpoint Problems (file, field,
    message, member), each saying what to fix. `existing` is the drafter a duplicate
    repeats, if that is the reason."""

    def __init__(self, problems: list[Problem], existing: Drafter | None = None):
        self.problems = list(problems)
        self.existing = existing
        super().__init__("; ".join(str(p) for p in self.problems))

    def as_dicts(self) -> list[dict]:
        return [p.as_dict() for p in self.problems]


class AlreadyEnded(Exception):
    """Another check of the same submission ended it first: this one stores nothing."""


def accept_submission(submission: Submission, drafter: Drafter) -> None:
    """Inside the transaction that stores the drafter: the intake submission ends accepted
    with it, or the transaction is undone (AlreadyEnded) when another check of it ended it
    first, so a submission checked twice at once stores one drafter."""
    ended = (Submission.objects.filter(pk=submission.pk, state=Submission.CHECKING)
             .update(state=Submission.ACCEPTED, drafter=drafter, problems=[],
                     finished_at=timezone.now()))
    if not ended:
        raise AlreadyEnded(submission.pk)


def check_rate_limit(user):
    """Drafters stored, and submissions being checked or refused, all count: a refused
    upload cost the checks as much as an accepted one."""
    limit = settings.SPECBOARD_SUBMISSIONS_PER_DAY
    if not limit or user.is_staff:
        return
    since = timezone.now() - timedelta(days=1)
    recent = Drafter.objects.filter(owner=user, created_at__gte=since)
    refused = Submission.objects.filter(owner=user, created_at__gte=since,
                                        state__in=(Submission.CHECKING, Submission.REFUSED))
    n = recent.count() + refused.count()
    if n >= limit:
        oldest = min(t for t in (
            recent.order_by("created_at").values_list("created_at", flat=True).first(),
            refused.order_by("created_at").values_list("created_at", flat=True).first())
            if t is not None)
        wait = max(int((oldest + timedelta(days=1) - timezone.now()).total_seconds() // 60), 1)
        raise SubmissionRefused([Problem(
            "(submission)", "rate limit",
            f"you have submitted {n} drafters in the last 24 hours (refused ones and "
            f"ones being checked included), the limit is {limit} "
            f"(SPECBOARD_SUBMISSIONS_PER_DAY): try again in {wait} minutes")])


def target_facts(protocol: Protocol) -> TargetFacts:
    t = protocol.target
    return TargetFacts(t.vocab_size, t.hidden_size, t.num_layers, t.hub_id or t.name)


def check_params(method: str, params: dict, protocol: Protocol) -> dict:
    """Method parameters, by the method's own rule (worker.checkpoint.validate_method_params);
    every method may name one speculation budget k from the protocol's ks. Returns the
    parameters to store: k is checked but not stored, since the protocol measures every k and
    the engines (worker.methods.ALLOWED_PARAMS) take no k parameter."""
    params = {key: v for key, v in (params or {}).items() if v is not None}
    try:
        checked = validate_method_params(method, params, list(protocol.spec.ks))
    except CheckpointRejected as e:
        raise SubmissionRefused(e.problems) from None
    return {key: v for key, v in checked.items() if key != "k"}


def params_sha256(method: str, params: dict) -> str:
    """The content hash of a drafter without files: its method and parameters."""
    return hashlib.sha256(canonical_json({"method": method, "params": params}).encode()).hexdigest()


def find_duplicate(content_sha256: str, protocol: Protocol) -> Drafter | None:
    """A drafter with the same content that staff rejected (for this target, under any
    name and protocol: a rejection is final), or one already measured or queued under this
    protocol and not withdrawn."""
    same = Drafter.objects.filter(content_sha256=content_sha256, target=protocol.target)
    rejected = same.filter(review_state="rejected").order_by("created_at").first()
    if rejected is not None:
        return rejected
    return (same.filter(runs__protocol=protocol).exclude(review_state="withdrawn")
            .order_by("created_at").first())


def duplicate_problem(existing: Drafter, file="(upload)") -> Problem:
    if existing.review_state == "rejected":
        return Problem(file, "content_sha256",
                       f"the same content (sha256 {existing.content_sha256[:12]}...) was "
                       "rejected by the site's staff; it cannot be submitted again")
    url = reverse("drafter", args=[existing.slug])
    return Problem(file, "content_sha256",
                   f"the same content (sha256 {existing.content_sha256[:12]}...) was already "
                   f"submitted under this protocol as \u201c{existing.name}\u201d: see {url}; "
                   "change the files or parameters, or choose another protocol")


FILE_NAME_MAX = DrafterFile._meta.get_field("file").max_length


def storage_name(content_sha256: str, index: int, name: str) -> str:
    """Where a checkpoint file is stored: short enough for the FileField; its path inside
    the checkpoint is DrafterFile.name."""
    return f"drafters/{content_sha256[:16]}/{index:03d}-{PurePosixPath(name).name[-60:]}"


SLUG_LENGTH = 40   # a SlugField holds 50; the rest is room for a "-N" suffix


def slug_base(name: str) -> str:
    """The name as a slug of at most SLUG_LENGTH characters, cut at a word boundary (a
    hyphen) when the name is longer, so a slug never ends mid-word."""
    slug = slugify(name) or "drafter"
    if len(slug) <= SLUG_LENGTH:
        return slug
    cut = slug[:SLUG_LENGTH + 1].rfind("-")
    return slug[:cut] if cut >= SLUG_LENGTH // 2 else slug[:SLUG_LENGTH].rstrip("-")


def unique_slug(name: str) -> str:
    base = slug_base(name)
    taken = set(Drafter.objects.filter(slug__startswith=base).values_list("slug", flat=True))
    if base not in taken:
        return base
    i = 2
    while f"{base}-{i}" in taken:
        i += 1
    return f"{base}-{i}"


def submit_drafter(*, owner, protocol: Protocol, method: str, name: str, uploads=(),
                   params: dict | None = None, description: str = "", link: str = "",
                   licence: str = "", claimed_acceptance_length: float | None = None,
                   claimed_speedup: float | None = None, claimed_source: str = "",
                   send: bool = True, extra_fields: dict | None = None,
                   queue: bool = True, provenance: dict | None = None,
                   submission: Submission | None = None) -> tuple[Drafter, Run | None]:
    """Validate and store a drafter for `protocol`'s target and queue its run.

    `uploads`: (name, file object or path, size) triples (worker.checkpoint.Upload). Raises
    SubmissionRefused (nothing stored) for the rate limit, bad parameters, a refused upload
    (the checkpoint's problems) or a duplicate content hash under the same protocol.
    ``extra_fields``: more Drafter fields (the training provenance of a baseline drafter,
    leaderboard/services/training.py); a drafter without an owner (a site baseline) has no rate limit.
    ``queue=False`` registers the drafter without a run (None is returned for it): setup_demo
    registers the shipped drafters so, and queues them after the n-gram run.
    ``provenance``: more of Drafter.intake (where the files came from: the hub's commit).
    ``submission``: the intake Submission being checked (its daily limit was checked when
    it was received); it ends accepted in the transaction that stores the drafter."""
    if owner is not None and submission is None:
        check_rate_limit(owner)
    params = check_params(method, params or {}, protocol)
    try:
        # In a child under hard limits: the files are never parsed by this process.
        ckpt = validate_in_sandbox(list(uploads), method, target_facts(protocol),
                                   max_total_bytes=settings.SPECBOARD_MAX_UPLOAD_BYTES)
    except CheckpointRejected as e:
        raise SubmissionRefused(e.problems) from None
    stored = []
    try:
        content = ckpt.content_sha256 if ckpt.files else params_sha256(method, params)
        with transaction.atomic():
            # Concurrent identical submissions: the duplicate check and the insert form one
            # transaction, serialised per protocol by a row lock (PostgreSQL) or by SQLite's
            # IMMEDIATE write lock, so exactly one of them is stored.
            list(Protocol.objects.select_for_update().filter(pk=protocol.pk).values_list("pk"))
            existing = find_duplicate(content, protocol)
            if existing is not None:
                raise SubmissionRefused([duplicate_problem(existing)], existing=existing)
            drafter = Drafter.objects.create(
                owner=owner, slug=unique_slug(name), name=name, method=method,
                target=protocol.target, params=params, description=description, link=link,
                licence=licence, content_sha256=content,
                intake={**ckpt.intake, **(provenance or {})},
                claimed_acceptance_length=claimed_acceptance_length,
                claimed_speedup=claimed_speedup, claimed_source=claimed_source,
                **(extra_fields or {}))
            if submission is not None:
                accept_submission(submission, drafter)
            for i, f in enumerate(ckpt.files):
                name = storage_name(content, i, f.name)
                # A new name is listed before it is written: a write cut short (a full disk)
                # leaves a partial file under it, removed below like the others. (A name
                # already taken is another drafter's file: the storage saves under a new one.)
                pending = None if default_storage.exists(name) else name
                if pending:
                    stored.append(pending)
                with f.open() as fh:
                    saved = default_storage.save(name, File(fh), max_length=FILE_NAME_MAX)
                if pending:
                    stored.pop()
                stored.append(saved)
                DrafterFile.objects.create(drafter=drafter, name=f.name, file=saved,
                                           size=f.size, sha256=f.sha256)
            run = runs.queue_run(protocol, drafter, send=send) if queue else None
    except BaseException as e:
        for saved in stored:
            try:
                if default_storage.exists(saved):
                    default_storage.delete(saved)
            except Exception:  # noqa: BLE001 - keep the original error
                pass
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise SubmissionRefused([Problem(
                "(upload)", "storage", "the server's storage is full: nothing was stored; "
                "try again later (the site's operators have been told by their logs)")]) from e
        raise
    finally:
        ckpt.cleanup()
    return drafter, run


def update_drafter(drafter: Drafter, **changes) -> Drafter:
    """Edit the descriptive fields (the files, method and parameters never change: a new
    checkpoint is a new submission)."""
    fields = [k for k in changes if k in EDITABLE_FIELDS]
    for k in fields:
        setattr(drafter, k, changes[k])
    if fields:
        drafter.full_clean(exclude=["slug", "owner", "target", "params"])
        drafter.save(update_fields=fields)
    return drafter


WITHDRAWABLE = ("pending", "approved")


def withdraw_drafter(drafter: Drafter) -> int | None:
    """Hide the drafter from the leaderboard and cancel its unfinished runs. Returns the
    number of runs cancelled or asked to stop (0 if it was withdrawn already), or None when
    staff rejected it meanwhile: the state changes only from a withdrawable one, in one
    conditional update, so a withdrawal never overwrites a rejection however the two
    interleave."""
    with transaction.atomic():
        changed = (Drafter.objects.filter(pk=drafter.pk, review_state__in=WITHDRAWABLE)
                   .update(review_state="withdrawn"))
        drafter.refresh_from_db(fields=["review_state"])
        if not changed:
            return 0 if drafter.review_state == "withdrawn" else None
        pending = list(Run.objects.filter(drafter=drafter,
                                          state__in=[Run.QUEUED, Run.RUNNING]))
        for run in pending:
            runs.request_cancel(run)
    return len(pending)


def cancel_run(run: Run) -> str:
    """Cancel a run (queued: at once; running: between two cells). Returns its state."""
    return runs.request_cancel(run)
