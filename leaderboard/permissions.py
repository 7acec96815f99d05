"""Who may see and manage a drafter or a run: see a rejected drafter, edit or withdraw a
drafter, cancel a run. The pages and the REST API ask here, and nowhere else."""
from __future__ import annotations

from .models import Drafter, Run


def is_owner_or_staff(user, owner_id: int | None) -> bool:
    """The rule: staff manage everything; a signed-in user manages the drafters they own
    and those drafters' runs. Nothing owned by nobody (a baseline run, a site-trained
    drafter without an owner) is anyone's but staff's."""
    if not user.is_authenticated:
        return False
    return user.is_staff or (owner_id is not None and owner_id == user.pk)


# Staff's rejection is final: the drafter's page, API record, runs and raw data are hidden
# from everyone but staff, and its owner can no longer edit or withdraw it.
REJECTED = "rejected"


def sees_rejected(user) -> bool:
    """Whether lists (the queue, runs, progress) include rejected drafters for `user`."""
    return user.is_authenticated and user.is_staff


def can_see(user, review_state: str | None) -> bool:
    """Whether `user` may see a drafter in this review state (None: a baseline run)."""
    return review_state != REJECTED or sees_rejected(user)


def can_manage(user, owner_id: int | None, review_state: str | None) -> bool:
    """Edit or withdraw a drafter, cancel its runs: its owner or staff; staff only once
    it is rejected."""
    if review_state == REJECTED:
        return user.is_authenticated and user.is_staff
    return is_owner_or_staff(user, owner_id)


def can_manage_drafter(user, drafter: Drafter) -> bool:
    return can_manage(user, drafter.owner_id, drafter.review_state)


def can_see_run(user, run: Run) -> bool:
    return can_see(user, run.drafter.review_state if run.drafter_id else None)


def can_manage_run(user, run: Run) -> bool:
    """A run belongs to its drafter's owner; a baseline run (no drafter) to staff only."""
    if run.drafter_id:
        return can_manage_drafter(user, run.drafter)
    return is_owner_or_staff(user, None)
