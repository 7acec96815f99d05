"""Who may manage a drafter or a run (leaderboard/permissions.py): its owner and staff; a
baseline run and a drafter without an owner, staff only; nobody signed out. The pages and
the API that ask it are tested in test_pages.py and test_api.py."""
import pytest
from django.contrib.auth.models import AnonymousUser, User

from leaderboard import permissions

from . import factories as f

pytestmark = pytest.mark.django_db


@pytest.fixture
def people():
    return {"owner": User.objects.create_user("owner", password="pw"),
            "other": User.objects.create_user("other", password="pw"),
            "staff": User.objects.create_user("staff", password="pw", is_staff=True),
            "anonymous": AnonymousUser()}


@pytest.fixture
def owned(people):
    protocol = f.make_protocol(f.make_target())
    drafter = f.make_drafter(protocol.target, "owned", owner=people["owner"])
    return {"drafter": drafter,
            "run": f.make_run(protocol, drafter, state="queued"),
            "baseline run": f.make_run(protocol),
            "site drafter": f.make_drafter(protocol.target, "site trained", owner=None)}


EXPECTED = {  # who may manage what
    "owner": {"drafter", "run"},
    "other": set(),
    "staff": {"drafter", "run", "baseline run", "site drafter"},
    "anonymous": set(),
}


@pytest.mark.parametrize("who", EXPECTED)
def test_the_owner_and_staff_manage_a_drafter_and_its_runs_and_only_staff_a_baseline(
        people, owned, who):
    user = people[who]
    allowed = {name for name, thing in owned.items()
               if (permissions.can_manage_run(user, thing) if "run" in name
                   else permissions.can_manage_drafter(user, thing))}
    assert allowed == EXPECTED[who]


@pytest.mark.parametrize("who", EXPECTED)
def test_a_summary_row_gets_the_same_answer_from_its_owner_id(people, owned, who):
    """The queue and drafter pages hold dicts with the drafter's owner_id (None for a
    baseline run): the same rule answers from it."""
    user = people[who]
    owner_ids = {"drafter": owned["drafter"].owner_id, "run": owned["run"].drafter.owner_id,
                 "baseline run": None, "site drafter": owned["site drafter"].owner_id}
    allowed = {name for name, owner_id in owner_ids.items()
               if permissions.is_owner_or_staff(user, owner_id)}
    assert allowed == EXPECTED[who]
