"""Intake: a submission is answered at once and checked out of the web process.

``receive`` (the submit page, the REST API, the ``submit_drafter`` command) does only what is
cheap: the daily limit, the method's parameters, the form of a hub reference. It stages the
uploaded files in the storage (``intake/<token>/``, streamed, never parsed) and records a
``Submission`` in the state *checking*; the commit sends ``CHECK_SUBMISSION`` to the
``intake`` queue.

``check`` is that task's body, run by an intake worker: it fetches a hub reference's files
(worker/hub.py: the revision pinned to its commit, names, sizes and safetensors headers
judged before anything is downloaded), then ``submit_drafter`` checks and converts the files
in a sandboxed child, refuses duplicates, stores the drafter and queues its run. The
submission ends *accepted*, *refused* (its problems) or *failed* (the hub unreachable, or a
fault of the site), exactly once: the end state is a conditional update from *checking*, in
the same transaction as the drafter's rows. A worker that dies mid-check is replaced (the
message is acknowledged late, and a starting intake worker sends every submission still
checking again). The staged files are removed when the submission ends.
"""
from __future__ import annotations

import errno
import logging
import resource
import tempfile
import time
import uuid
from pathlib import Path, PurePosixPath

from django.conf import settings
from django.core.files import File
from django.core.files.storage import default_storage
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from worker.checkpoint import CheckpointRejected, Problem, Upload, check_files_given

from ..celery import CHECK_SUBMISSION, INTAKE_QUEUE, app
from ..models import Protocol, Submission
from . import submissions
from .submissions import AlreadyEnded, SubmissionRefused

log = logging.getLogger(__name__)

DETAIL_FIELDS = ("description", "link", "licence", "claimed_acceptance_length",
                 "claimed_speedup", "claimed_source")


def receive(*, owner, protocol: Protocol, method: str, name: str, uploads=(),
            hub_reference: str = "", params: dict | None = None, send: bool = True,
            **details) -> Submission:
    """Record a submission as *checking* and send it to the intake queue (on commit).

    ``uploads``: worker.checkpoint.Upload triples (or tuples); ``hub_reference``:
    ``owner/name[@revision]`` instead of files. Raises SubmissionRefused, storing nothing,
    for what is refused at once: the daily limit, the parameters, a malformed reference,
    files and a reference together, a full storage."""
    unknown = set(details) - set(DETAIL_FIELDS)
    if unknown:
        raise TypeError(f"unknown submission fields: {sorted(unknown)}")
    if owner is not None:
        submissions.check_rate_limit(owner)
    params = submissions.check_params(method, params or {}, protocol)
    uploads = [u if isinstance(u, Upload) else Upload(*u) for u in uploads]
    try:
        check_files_given(method, [u.name for u in uploads], hub_reference)
    except CheckpointRejected as e:
        raise SubmissionRefused(e.problems) from None
    if hub_reference:
        from worker import hub

        if uploads:
            raise SubmissionRefused([Problem("(upload)", "files", "send the checkpoint's files "
                                             "or a hub reference, not both")])
        try:
            repo_id, revision = hub.parse_reference(hub_reference)
        except ValueError as e:
            raise SubmissionRefused([Problem("(hub)", "hub_reference", str(e))]) from None
        hub_reference = f"{repo_id}@{revision}"
    staged = []
    try:
        token = uuid.uuid4().hex
        for i, up in enumerate(uploads):
            # Listed before it is written: a write cut short (a full disk) leaves a partial
            # file under this name, removed below. (The token's folder is new, so the
            # storage keeps the name.)
            where = f"intake/{token}/{i:03d}-{PurePosixPath(up.name).name[-60:] or 'file'}"
            staged.append([up.name, where, up.size])
            staged[-1][1] = _stage(where, up)
        with transaction.atomic():
            submission = Submission.objects.create(
                owner=owner, protocol=protocol, method=method, name=name[:200], params=params,
                details={k: v for k, v in details.items() if v not in (None, "")},
                hub_reference=hub_reference, staged=staged)
            if send:
                transaction.on_commit(lambda: enqueue(submission))
    except BaseException as e:
        _discard([s[1] for s in staged])
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise SubmissionRefused([Problem(
                "(upload)", "storage", "the server's storage is full: nothing was stored; "
                "try again later")]) from e
        raise
    return submission


def enqueue(submission: Submission, countdown: int | None = None) -> None:
    app.send_task(CHECK_SUBMISSION, args=[submission.pk], queue=INTAKE_QUEUE,
                  countdown=countdown)


def check(submission_id: int, *, send: bool = True) -> Submission | None:
    """Check a submission still *checking* and end it (the intake task). Returns it, or
    None when there is no such submission; one already ended is returned unchanged."""
    submission = (Submission.objects.select_related("protocol", "owner")
                  .filter(pk=submission_id).first())
    if submission is None or submission.state != Submission.CHECKING:
        return submission
    Submission.objects.filter(pk=submission.pk).update(attempts=F("attempts") + 1)
    started = time.monotonic()
    try:
        if submission.protocol is None:
            raise SubmissionRefused([Problem("(form)", "protocol", "the protocol was deleted "
                                             "while the submission waited to be checked")])
        with tempfile.TemporaryDirectory(prefix="specboard-intake-") as folder:
            uploads, provenance = _files_of(submission, Path(folder))
            submissions.submit_drafter(
                owner=submission.owner, protocol=submission.protocol,
                method=submission.method, name=submission.name, uploads=uploads,
                params=submission.params, provenance=provenance, send=send,
                submission=submission, **submission.details)
    except AlreadyEnded:
        pass   # another check of it ended it first
    except SubmissionRefused as e:
        # A full storage is the site's fault, not the submission's: it does not count.
        storage = any(p.field == "storage" for p in e.problems)
        _end(submission, Submission.FAILED if storage else Submission.REFUSED, e.as_dicts())
    except _Failed as e:
        _end(submission, Submission.FAILED, [e.problem.as_dict()])
    except Exception as e:  # noqa: BLE001 - a fault of the site, not of the submission
        log.exception("submission %s: the checks failed", submission.pk)
        _end(submission, Submission.FAILED, [Problem(
            "(submission)", "checks", f"the site failed while checking it ({type(e).__name__}); "
            "nothing was stored: submit it again, and tell the site's staff if it recurs"
        ).as_dict()])
    submission.refresh_from_db()
    if submission.state in Submission.FINISHED:
        _discard([s[1] for s in submission.staged])
    # The checks' own memory is their child's (worker/sandbox.py), reported here.
    log.info("submission %s %s in %.1f s; the largest child process so far peaked at %d MiB",
             submission.pk, submission.state, time.monotonic() - started,
             resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024)
    return submission


def resend_unchecked(countdown: int | None = None) -> int:
    """When an intake worker starts: send every submission still checking again (its
    worker died, or the embedded broker lost the message). A duplicate is harmless: the
    first check to end it wins, the other changes nothing."""
    pending = list(Submission.objects.filter(state=Submission.CHECKING))
    for submission in pending:
        enqueue(submission, countdown=countdown)
    if pending:
        log.info("intake: %d submission(s) still checking sent again", len(pending))
    return len(pending)


class _Failed(Exception):
    """The site could not check the submission (not the submitter's fault)."""

    def __init__(self, problem: Problem):
        self.problem = problem
        super().__init__(str(problem))


def _end(submission: Submission, state: str, problems: list[dict]) -> None:
    Submission.objects.filter(pk=submission.pk, state=Submission.CHECKING).update(
        state=state, problems=problems, finished_at=timezone.now())


def _files_of(submission: Submission, folder: Path):
    """The submission's files as Uploads, and what Drafter.intake records of their origin."""
    if not submission.hub_reference:
        return [Upload(name, _local(stored), size) for name, stored, size
                in submission.staged], None
    from worker import hub

    repo_id, revision = hub.parse_reference(submission.hub_reference)
    try:
        found = hub.inspect(repo_id, revision, token=settings.SPECBOARD_HF_TOKEN or None,
                            max_total_bytes=settings.SPECBOARD_MAX_UPLOAD_BYTES)
        uploads = hub.download(found, folder / "hub")
    except CheckpointRejected as e:
        raise SubmissionRefused(e.problems) from None
    except hub.HubError as e:
        raise _Failed(Problem("(hub)", "hub", f"{e}: nothing was stored; submit it again "
                              "later")) from None
    return uploads, {"hub": {"repo_id": found.repo_id, "revision": found.revision,
                             "commit": found.commit}}


def _stage(name: str, upload: Upload) -> str:
    source = upload.source
    if isinstance(source, (str, Path)):
        with open(source, "rb") as fh:
            return default_storage.save(name, File(fh))
    if hasattr(source, "seek"):
        source.seek(0)
    return default_storage.save(name, source if isinstance(source, File) else File(source))


def _local(stored: str):
    """A path the sandboxed checks can open (the storage's own file when it is local),
    else the open file, which the checks copy."""
    try:
        return default_storage.path(stored)
    except NotImplementedError:
        return default_storage.open(stored, "rb")


def _discard(names) -> None:
    folders = set()
    for name in names:
        try:
            if default_storage.exists(name):
                default_storage.delete(name)
            folders.add(PurePosixPath(name).parent)
        except Exception:  # noqa: BLE001 - keep the original outcome
            log.warning("could not remove the staged file %s", name, exc_info=True)
    for folder in folders:   # the token's folder, empty now (a local storage leaves it)
        try:
            Path(default_storage.path(str(folder))).rmdir()
        except (NotImplementedError, OSError):
            pass
