"""Who may manage a drafter or a run: edit or withdraw the drafter, cancel the run. The
pages and the REST API ask here, and nowhere else."""
from __future__ import annotations

from .models import Drafter, Run


def is_owner_or_staff(user, owner_id: int | None) -> bool:
    """The rule: staff manage everything; a signed-in user manages the drafters they own
    and those drafters' runs. Nothing owned by nobody (a baseline run, a site-trained
    drafter without an owner) is anyone's but staff's."""
    if not user.is_authenticated:
        return False
    return user.is_staff or (owner_id is not None and owner_id == user.pk)


def can_manage_drafter(user, drafter: Drafter) -> bool:
    return is_owner_or_staff(user, drafter.owner_id)


def can_manage_run(user, run: Run) -> bool:
    """A run belongs to its drafter's owner; a baseline run (no drafter) to staff only."""
    return is_owner_or_staff(user, run.drafter.owner_id if run.drafter_id else None)
