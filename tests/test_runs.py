"""The run service without the engine: claiming, baseline reuse, cancel, and a drafter
whose file is corrupt failing with a reason its submitter understands."""
import json

import pytest
from django.core.files.base import ContentFile

from leaderboard.services import runs, setup
from leaderboard.models import Drafter, DrafterFile, Protocol, Run, Target
from worker.protocol import ProtocolSpec, TaskSpec


pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def protocol(demo_target_dir, prompt_files, settings, tmp_path):
    settings.DATA_DIR = tmp_path / "data"
    target = Target.objects.create(slug="t", name="T", path=str(demo_target_dir),
                                   weights_sha256="0" * 64, vocab_size=49152, hidden_size=576,
                                   num_layers=30)
    qa, _ = setup.import_prompt_set(prompt_files / "mt_bench.jsonl", "mt-bench", slug="qa")
    spec = ProtocolSpec(slug="p", version=1, target="t", target_sha256="0" * 64, engine="vllm",
                        hardware="cpu", tasks=(TaskSpec("qa", "qa", qa.source_sha256, 1),),
                        batch_sizes=(1,), ks=(2,), baseline="shared")
    return Protocol.objects.create(target=target, spec=spec.to_dict())


def test_a_drafter_run_under_a_shared_protocol_queues_its_baseline_once(protocol):
    ngram = Drafter.objects.create(slug="n", name="n", method="ngram", target=protocol.target)
    first = runs.queue_run(protocol, ngram, send=False)
    runs.queue_run(protocol, ngram, send=False)
    assert Run.objects.filter(drafter__isnull=True).count() == 1
    assert first.cells_total == 1 and Run.objects.get(drafter__isnull=True).cells_total == 1


def test_claim_is_a_compare_and_set(protocol):
    run = runs.queue_run(protocol, None, send=False)
    assert runs.claim(run.pk, "a") is not None
    assert runs.claim(run.pk, "b") is None  # a second delivery while the first is alive
    run.refresh_from_db()
    assert run.worker_host == "a" and run.attempts == 1
    Run.objects.filter(pk=run.pk).update(state=Run.SUCCEEDED)
    assert runs.claim(run.pk, "c") is None  # a finished run is never measured again


def test_a_cancelled_queued_run_is_never_claimed(protocol):
    run = runs.queue_run(protocol, None, send=False)
    assert runs.request_cancel(run) == Run.CANCELLED
    assert runs.execute_run(run.pk) is None
    run.refresh_from_db()
    assert run.state == Run.CANCELLED and run.attempts == 0


def test_corrupt_drafter_file_fails_the_run_with_a_reason(protocol, demo_target_dir):
    drafter = Drafter.objects.create(slug="d", name="draft", method="draft_model",
                                     target=protocol.target, content_sha256="f" * 64)
    config = json.loads((demo_target_dir / "config.json").read_text())
    config["num_hidden_layers"] = 2
    weights = (demo_target_dir / "model.safetensors").read_bytes()[:4096]  # cut short
    for name, data in (("config.json", json.dumps(config).encode()), ("model.safetensors", weights)):
        f = DrafterFile(drafter=drafter, name=name, size=len(data), sha256="0" * 64)
        f.file.save(name, ContentFile(data), save=True)
    run = runs.queue_run(protocol, drafter, send=False)
    assert runs.execute_run(run.pk) == Run.FAILED
    run.refresh_from_db()
    assert run.state == Run.FAILED and run.finished_at is not None
    assert "model.safetensors" in run.error and "truncated" in run.error
    assert run.results.count() == 0


def test_unsupported_method_names_method_and_hardware(protocol):
    drafter = Drafter.objects.create(slug="m", name="mtp", method="mtp", target=protocol.target)
    run = runs.queue_run(protocol, drafter, send=False)
    assert runs.execute_run(run.pk) == Run.FAILED
    run.refresh_from_db()
    assert "'mtp'" in run.error and "'cpu'" in run.error


def _messages(queue_name):
    """The task messages waiting in a broker queue (read and removed): (task name, args)."""
    from leaderboard.celery import app

    out = []
    with app.connection_for_read() as conn:
        queue = conn.SimpleQueue(queue_name, no_ack=True)
        try:
            while True:
                message = queue.get(block=True, timeout=2)
                out.append((message.headers["task"], message.payload[0]))
        except queue.Empty:
            pass
        finally:
            queue.close()
    return out


def test_a_starting_worker_sends_again_the_runs_of_its_queues(protocol):
    """resend_unfinished_runs (the worker_ready hook): queued runs whose message was lost,
    and running ones whose worker went silent, are sent again to their own queue; runs of
    other queues and finished runs are left alone."""
    from leaderboard.celery import MEASURE_RUN
    from tests.conftest import purge_queue

    for name in ("resend-a", "resend-b"):
        purge_queue(name)
    queued = Run.objects.create(protocol=protocol, hardware="resend-a", state=Run.QUEUED)
    running = Run.objects.create(protocol=protocol, hardware="resend-a", state=Run.RUNNING)
    Run.objects.create(protocol=protocol, hardware="resend-a", state=Run.SUCCEEDED)
    other = Run.objects.create(protocol=protocol, hardware="resend-b", state=Run.QUEUED)
    runs.resend_unfinished_runs(["resend-a"])
    sent = _messages("resend-a")
    assert sorted(sent) == sorted([(MEASURE_RUN, [queued.pk]), (MEASURE_RUN, [running.pk])])
    assert _messages("resend-b") == []
    runs.resend_unfinished_runs(["resend-b"])
    assert _messages("resend-b") == [(MEASURE_RUN, [other.pk])]
