"""Protocol versions that differ only by engine version (issue 34): derive one from another
and queue on it what its family has measured, so that every drafter's history across engine
versions fills in with one action. The admin action, `manage.py derive_protocol` and
POST /api/protocols/{slug}/{version}/engine-versions all call `derive_and_queue`.

- `derive_engine_version`: a new version of the same slug whose spec is the source's pinned
  to another engine version (ProtocolSpec.with_engine_version): the same target, prompts,
  sampling, batch sizes, k and passes, so the same family hash. It starts with a copy of
  the family's newest between-run calibration (services.calibration.inherit), so that its
  speedups are ranked and compared across versions by the same kind of interval.
- `queue_family_runs`: on a protocol, the shared baseline and every approved drafter of its
  target that has a succeeded run under a protocol of its family, each once.
"""
from __future__ import annotations

from typing import NamedTuple

from django.db import IntegrityError, transaction

from ..models import Drafter, Protocol, Run
from ..queues import start_worker_command
from ..selectors.protocols import protocol_family
from . import calibration, runs
from .baselines import PAIRED, shared_baseline_exists
from .errors import ServiceError


class DeriveRefused(ServiceError, ValueError):
    """A protocol version that cannot be derived; the message says why and what to do."""


class Derived(NamedTuple):
    protocol: Protocol
    runs: list[Run]


def derive_engine_version(protocol: Protocol, engine_version: str,
                          title: str | None = None) -> Protocol:
    """A new version of `protocol`'s slug pinned to `engine_version`, everything else the
    source's (the title too, unless given). Refused when the engine version is not a
    release or when a version of the family already pins it (one protocol per engine
    version keeps a drafter's history to one row per version)."""
    engine_version = (engine_version or "").strip()
    try:
        spec = protocol.spec.with_engine_version(engine_version, protocol.next_version())
    except (ValueError, TypeError) as e:
        raise DeriveRefused(f"cannot derive {protocol} for engine version "
                            f"{engine_version!r}: {e}") from None
    family = protocol_family(protocol)
    for member in family:
        if member.spec.engine_version == engine_version:
            raise DeriveRefused(
                f"{member} already pins {member.engine} {engine_version} (same family as "
                f"{protocol}); measure there instead (manage.py measure DRAFTER --protocol "
                f"{member.slug}@{member.version})")
    try:
        with transaction.atomic():
            derived = Protocol.objects.create(title=protocol.title if title is None else title,
                                              target=protocol.target, spec=spec.to_dict())
            calibration.inherit(derived, family)
            return derived
    except IntegrityError:   # another version of the slug was created meanwhile
        raise DeriveRefused(f"version {spec.version} of {protocol.slug} was just created by "
                            "someone else; try again") from None


def family_drafters(protocol: Protocol):
    """Approved drafters of the protocol's target with a succeeded run under a protocol of
    its family (itself included), oldest first."""
    family = [p.pk for p in protocol_family(protocol)]
    measured = Run.objects.filter(protocol_id__in=family, state=Run.SUCCEEDED,
                                  drafter__isnull=False).values("drafter_id")
    return (Drafter.objects.filter(target_id=protocol.target_id, review_state="approved",
                                   pk__in=measured).order_by("created_at", "pk"))


def queue_family_runs(protocol: Protocol, send: bool = True) -> list[Run]:
    """Queue on `protocol` the shared baseline (unless one is succeeded, queued or running;
    under a paired protocol each drafter run measures its own) and every family drafter
    (family_drafters) that has no run there yet, in any state. Returns the new runs, the
    baseline first; a second call queues nothing new."""
    new = []
    with transaction.atomic():
        if protocol.spec.baseline != PAIRED and not shared_baseline_exists(protocol):
            new.append(runs.queue_run(protocol, None, send=send))
        for drafter in family_drafters(protocol):
            run = runs.queue_if_no_run(protocol, drafter, send=send)
            if run is not None:
                new.append(run)
    return new


def derive_and_queue(protocol: Protocol, engine_version: str, queue: bool = True,
                     title: str | None = None, send: bool = True) -> Derived:
    """derive_engine_version, then (with `queue`) queue_family_runs on the new version, in
    one transaction: a refusal or a failure leaves nothing behind, and the runs' messages
    are sent once it commits."""
    with transaction.atomic():
        derived = derive_engine_version(protocol, engine_version, title)
        return Derived(derived, queue_family_runs(derived, send=send) if queue else [])


def worker_hint(protocol: Protocol) -> str:
    """How to start a worker that measures the protocol's runs (its queue, ProtocolSpec.queue)."""
    spec = protocol.spec
    if not spec.engine_version:
        return f"a worker of the default engine on queue {spec.queue!r} measures them"
    return (f"start a worker for it: "
            f"{start_worker_command(spec.hardware, spec.engine_version, spec.queue)} "
            f"(queue {spec.queue!r})")
