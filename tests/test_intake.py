"""Intake (leaderboard/services/intake.py): a submission is answered at once and checked by
a real Celery intake worker on its own queue, out of the web process; it ends accepted,
refused or failed exactly once, a lost message is sent again when an intake worker starts,
and a hub reference is taken by the submit form and the API (the stand-in hub,
tests/hub_standin.py)."""
import json
import time
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from leaderboard import tokens
from leaderboard.celery import INTAKE_QUEUE
from leaderboard.models import Drafter, DrafterFile, Run, Submission
from leaderboard.services import intake, submissions
from worker.checkpoint import Upload

from . import factories as f
from . import published_formats as pf
from .conftest import purge_queue
from .test_hub import standin  # noqa: F401 (a fixture)
from .test_hub_submission import DEMO_TARGET, REPO, SHIPPED, VERIFIER
from .test_submission import HIDDEN, LAYERS, VOCAB, form_data, tiny_config, tiny_weights, upload


def stored_files(media):
    return sorted(p for p in media.rglob("*") if p.is_file()) if media.exists() else []


def wait_ended(pk, worker, seconds=180):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        s = Submission.objects.get(pk=pk)
        if s.state != Submission.CHECKING:
            return s
        if worker.proc.poll() is not None:
            pytest.fail(f"the intake worker exited:\n{worker.output()[-3000:]}")
        time.sleep(0.5)
    pytest.fail(f"submission {pk} still checking after {seconds} s:\n{worker.output()[-3000:]}")


def small_protocol(hardware="intake-test"):
    target = f.make_target(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS)
    return f.make_protocol(target, hardware=hardware, ks=(2,))


# ---- a real intake worker ------------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_an_intake_worker_checks_what_the_page_received(celery_worker_factory, media):
    purge_queue(INTAKE_QUEUE)
    protocol = small_protocol()
    user = User.objects.create_user("author", password="pw-intake-123")
    client = Client()
    client.force_login(user)
    good = client.post(reverse("submit"), form_data(
        protocol, name="tiny draft", files=[upload("config.json", tiny_config()),
                                            upload("model.safetensors", tiny_weights())]))
    bad = client.post(reverse("submit"), form_data(
        protocol, name="wrong vocab", files=[upload("config.json", tiny_config(vocab_size=32)),
                                             upload("model.safetensors", tiny_weights(vocab=32))]))
    assert good.status_code == bad.status_code == 302
    # answered with nothing checked: both wait, staged, for the intake worker
    assert list(Submission.objects.values_list("state", flat=True)) == ["checking"] * 2
    assert not Drafter.objects.exists() and len(stored_files(media)) == 4
    queue_page = client.get(reverse("queue")).content.decode()
    assert "2 submissions are being checked" in queue_page and "tiny draft" in queue_page

    worker = celery_worker_factory(queue=INTAKE_QUEUE)
    accepted = wait_ended(int(good["Location"].split("/")[-2]), worker)
    refused = wait_ended(int(bad["Location"].split("/")[-2]), worker)
    assert accepted.state == Submission.ACCEPTED, accepted.problems
    assert accepted.attempts == 1 and accepted.finished_at is not None
    drafter = accepted.drafter
    assert drafter.name == "tiny draft" and drafter.owner == user
    assert Run.objects.filter(drafter=drafter, state=Run.QUEUED).count() == 1
    assert refused.state == Submission.REFUSED
    assert ("config.json", "vocab_size") in {(p["file"], p["field"]) for p in refused.problems}
    # only the accepted drafter's files remain; the staged uploads are gone
    assert {p.name for p in stored_files(media)} == {
        Path(df.file.name).name for df in DrafterFile.objects.filter(drafter=drafter)}
    page = client.get(bad["Location"]).content.decode()
    assert 'id="refused"' in page and "vocab_size" in page
    assert "check_submission" in worker.output()


@pytest.mark.django_db(transaction=True)
def test_a_submission_whose_message_was_lost_is_checked_when_an_intake_worker_starts(
        celery_worker_factory, media):
    purge_queue(INTAKE_QUEUE)
    protocol = small_protocol()
    user = User.objects.create_user("author")
    received = intake.receive(owner=user, protocol=protocol, method="draft_model",
                              name="lost message",
                              uploads=[Upload("config.json", tiny_config_file(media), None),
                                       Upload("model.safetensors", tiny_weights_file(media),
                                              None)],
                              send=False)   # as if the broker lost the message
    worker = celery_worker_factory(queue=INTAKE_QUEUE)
    ended = wait_ended(received.pk, worker)
    assert ended.state == Submission.ACCEPTED, ended.problems
    assert Drafter.objects.filter(name="lost message").count() == 1
    assert "still checking sent again" in worker.output()


def tiny_config_file(folder):
    path = folder.parent / "upload-config.json"
    path.write_bytes(tiny_config())
    return path


def tiny_weights_file(folder):
    path = folder.parent / "upload-model.safetensors"
    path.write_bytes(tiny_weights())
    return path


# ---- exactly once -------------------------------------------------------------------------

@pytest.mark.django_db
def test_a_submission_checked_twice_ends_once(media, django_capture_on_commit_callbacks):
    protocol = small_protocol()
    user = User.objects.create_user("author")
    with django_capture_on_commit_callbacks(execute=False) as sent:
        received = intake.receive(owner=user, protocol=protocol, method="ngram", name="twice",
                                  params={"prompt_lookup_min": 1, "prompt_lookup_max": 3})
    assert len(sent) == 1 and received.state == Submission.CHECKING
    first = intake.check(received.pk)
    again = intake.check(received.pk)   # a redelivered message
    assert first.state == again.state == Submission.ACCEPTED
    assert again.attempts == 1 and Drafter.objects.count() == 1 and Run.objects.filter(
        drafter__isnull=False).count() == 1


@pytest.mark.django_db
def test_a_fault_while_checking_fails_the_submission_clearly_and_it_does_not_count(
        media, monkeypatch, settings):
    settings.SPECBOARD_SUBMISSIONS_PER_DAY = 1
    protocol = small_protocol()
    user = User.objects.create_user("author")
    received = intake.receive(owner=user, protocol=protocol, method="draft_model",
                              name="unlucky", send=False,
                              uploads=[Upload("config.json", tiny_config_file(media), None),
                                       Upload("model.safetensors", tiny_weights_file(media),
                                              None)])
    assert len(stored_files(media)) == 2

    def broken(*args, **kwargs):
        raise RuntimeError("the checks broke (test)")

    monkeypatch.setattr(submissions, "validate_in_sandbox", broken)
    ended = intake.check(received.pk)
    assert ended.state == Submission.FAILED
    (problem,) = ended.problems
    assert "RuntimeError" in problem["message"] and "nothing was stored" in problem["message"]
    assert stored_files(media) == [] and not Drafter.objects.exists()
    # the site's failure is not the submitter's: the daily limit is untouched
    submissions.check_rate_limit(user)


@pytest.mark.django_db
def test_the_submission_page_is_its_owners_and_staffs(client, media):
    protocol = small_protocol()
    owner = User.objects.create_user("owner")
    received = intake.receive(owner=owner, protocol=protocol, method="ngram", name="mine",
                              params={"prompt_lookup_min": 1, "prompt_lookup_max": 3},
                              send=False)
    url = reverse("submission", args=[received.pk])
    client.force_login(User.objects.create_user("someone else"))
    assert client.get(url).status_code == 404
    client.force_login(User.objects.create_user("staff", is_staff=True))
    assert client.get(url).status_code == 200
    client.force_login(owner)
    listing = client.get(reverse("submissions")).content.decode()
    assert url in listing and "checking" in listing


# ---- by model-hub reference ----------------------------------------------------------------

@pytest.fixture
def demo_like_protocol():
    target = f.make_target(vocab_size=DEMO_TARGET.vocab_size,
                           hidden_size=DEMO_TARGET.hidden_size, num_layers=DEMO_TARGET.num_layers)
    return f.make_protocol(target, hardware="hub-test", ks=(3,))


@pytest.mark.django_db
def test_a_hub_reference_through_the_form_and_the_api(standin, demo_like_protocol, client,  # noqa: F811
                                                      tmp_path, media, settings):
    pf.speculators_eagle3(SHIPPED, tmp_path / "published", VERIFIER)
    files = {p.name: p.read_bytes() for p in (tmp_path / "published").iterdir()}
    first = standin.publish(REPO, files)
    standin.tag(REPO, "v1", first)
    user = User.objects.create_user("author", password="pw-intake-123")
    client.force_login(user)

    # the form: nothing is fetched in the web request
    response = client.post(reverse("submit"), form_data(
        demo_like_protocol, method="eagle3", name="from the hub", hub_reference=f"{REPO}@v1"))
    assert response.status_code == 302
    assert standin.requests == []
    checking = client.get(response["Location"]).content.decode()
    assert f"{REPO}@v1" in checking and 'id="checking"' in checking
    submission = f.submitted(response)
    assert submission.state == Submission.ACCEPTED, submission.problems
    assert submission.drafter.intake["hub"] == {"repo_id": REPO, "revision": "v1",
                                                "commit": first}

    # the API, another protocol of the target (else a duplicate): a moved branch is pinned
    config = json.loads(files["config.json"])
    config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 2
    second = standin.publish(REPO, dict(files, **{"config.json": json.dumps(config).encode()}))
    token = tokens.create_token(user, "t")[1]
    answer = client.post("/api/drafters", {
        "protocol": f"{demo_like_protocol.slug}@{demo_like_protocol.version}",
        "method": "eagle3", "name": "main today", "hub_reference": REPO},
        headers={"Authorization": f"Bearer {token}"})
    assert answer.status_code == 202 and answer.json()["hub_reference"] == f"{REPO}@main"
    f.submitted(answer)
    body = client.get(f"/api/submissions/{answer.json()['id']}",
                      headers={"Authorization": f"Bearer {token}"}).json()
    assert body["state"] == "accepted", body
    drafter = Drafter.objects.get(slug=body["drafter"]["slug"])
    assert drafter.intake["hub"]["commit"] == second

    # an unknown repository: refused, by field, nothing stored
    before = stored_files(media)
    unknown = client.post(reverse("submit"), form_data(
        demo_like_protocol, method="eagle3", name="nothing", hub_reference="smol-lab/nothing"))
    refused = f.submitted(unknown)
    assert refused.state == Submission.REFUSED
    assert refused.problems[0]["file"] == "(hub)" and "repository" in refused.problems[0]["message"]
    assert stored_files(media) == before


@pytest.mark.django_db
def test_files_and_a_hub_reference_together_are_refused_at_once(client, media):
    protocol = small_protocol()
    client.force_login(User.objects.create_user("author"))
    response = client.post(reverse("submit"), form_data(
        protocol, files=[upload("config.json", tiny_config())], hub_reference="a/b"))
    assert response.status_code == 400
    assert "not both" in response.context["form"].errors["hub_reference"][0]
    assert not Submission.objects.exists() and stored_files(media) == []


@pytest.mark.django_db
def test_an_unreachable_hub_fails_the_submission_and_it_does_not_count(
        media, settings, monkeypatch):
    settings.SPECBOARD_SUBMISSIONS_PER_DAY = 1
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")   # nothing listens on port 9
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "2")
    target = f.make_target(vocab_size=DEMO_TARGET.vocab_size,
                           hidden_size=DEMO_TARGET.hidden_size, num_layers=DEMO_TARGET.num_layers)
    protocol = f.make_protocol(target, hardware="hub-test", ks=(3,))
    user = User.objects.create_user("author")
    received = intake.receive(owner=user, protocol=protocol, method="eagle3", name="offline",
                              hub_reference=REPO, send=False)
    ended = intake.check(received.pk)
    assert ended.state == Submission.FAILED
    assert ended.problems[0]["file"] == "(hub)" and "submit it again later" in \
        ended.problems[0]["message"]
    submissions.check_rate_limit(user)   # not counted
