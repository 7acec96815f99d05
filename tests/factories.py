"""Test data for the page tests and bench/web_load.py.

The counts are chosen here with simple formulas (NOT measured); every figure stored in a
Result row is computed from those counts by worker.metrics, exactly as a worker would.
Real measured results come from the measurement tests (test_celery_runs.py)."""
from __future__ import annotations

import hashlib
import math

from django.utils import timezone

from leaderboard.models import Drafter, Prompt, PromptSet, Protocol, Result, Run, Target
from worker import metrics
from worker.protocol import ProtocolSpec, TaskSpec

REQUESTS = 8
TOKENS_PER_REQUEST = 100


def make_target(slug="tiny", vocab_size=64, hidden_size=16, num_layers=2, name=None):
    return Target.objects.get_or_create(slug=slug, defaults=dict(
        name=name or f"Tiny test target ({slug})", weights_sha256="0" * 64,
        vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers))[0]


def make_prompt_set(slug="chat-set", categories=("writing", "coding"), per_category=5):
    ps, created = PromptSet.objects.get_or_create(slug=slug, defaults=dict(
        name=slug, format="spec-bench", source_name=f"{slug}.jsonl",
        source_sha256=hashlib.sha256(slug.encode()).hexdigest()))
    if created:
        Prompt.objects.bulk_create([
            Prompt(prompt_set=ps, external_id=f"{c}-{i}", position=n, category=c,
                   turns=[f"test prompt {c} {i}"])
            for n, (c, i) in enumerate((c, i) for c in categories for i in range(per_category))])
    return ps


def make_protocol(target, slug="pages", version=1, hardware="pages-test",
                  tasks=("chat", "code"), batch_sizes=(1, 4), temperatures=(0.0,), ks=(2, 4),
                  prompt_set=None, baseline="shared", repetitions=1, selection="first",
                  engine_starts=None):
    ps = prompt_set or make_prompt_set()
    spec = ProtocolSpec(
        slug=slug, version=version, target=target.slug, target_sha256=target.weights_sha256,
        engine="vllm", hardware=hardware,
        tasks=tuple(TaskSpec(t, ps.slug, ps.source_sha256, max(batch_sizes), selection=selection)
                    for t in tasks),
        temperatures=tuple(temperatures), batch_sizes=tuple(batch_sizes), ks=tuple(ks),
        baseline=baseline, repetitions=repetitions, engine_starts=engine_starts)
    return Protocol.objects.create(title=f"test protocol {slug}", target=target,
                                   spec=spec.to_dict())


def make_drafter(target, name, method="ngram", owner=None, **fields):
    from django.utils.text import slugify

    defaults = dict(params={"prompt_lookup_min": 2, "prompt_lookup_max": 4}
                    if method == "ngram" else {})
    defaults.update(fields)
    return Drafter.objects.create(owner=owner, slug=slugify(name), name=name, method=method,
                                  target=target, **defaults)


def make_training_dataset(target, slug, n, answer_tokens, seconds):
    """A TrainingDataset row with its figures (no file: the recipe page reads the row)."""
    from leaderboard.models import TrainingDataset

    return TrainingDataset.objects.create(
        slug=slug, target=target, sha256=f"{n:064x}", n=n, tokens=answer_tokens * 2,
        path=f"{slug}.jsonl", params={"stats": {"seconds": seconds, "answer_tokens": answer_tokens}})


def make_trained_drafter(target, name, recipe, method, data=None, seconds=100.0, details=None,
                         sha="0" * 64):
    """A drafter trained by `recipe` on `data` (a TrainingDataset, or None: shipped, with its
    data figures in `details`)."""
    return make_drafter(target, name, method=method, params={}, trained_by_recipe=recipe,
                        training_data=data, training_data_sha256=data.sha256 if data else sha,
                        training_seed=0, training_seconds=seconds,
                        training_details=details or {"steps": 600})


def make_run(protocol, drafter=None, state=Run.SUCCEEDED, engine_version="0.0.test", **fields):
    cells = len(protocol.spec.run_cells(drafter.method if drafter else "baseline"))
    now = timezone.now()
    done = cells if state == Run.SUCCEEDED else fields.pop("cells_done", 0)
    return Run.objects.create(
        protocol=protocol, drafter=drafter, hardware=protocol.hardware, state=state,
        cells_total=cells, cells_done=done, engine_version=engine_version,
        versions={"vllm": engine_version, "torch": "test", "transformers": "test"},
        hardware_description="test data (not measured)",
        finished_at=now if state in Run.FINISHED else None, **fields)


def baseline_counts(task_index, batch_size, temperature):
    generated = REQUESTS * TOKENS_PER_REQUEST
    throughput = 50.0 * batch_size ** 0.7 / (1 + 0.1 * task_index) / (1 + 0.2 * temperature)
    return dict(requests=REQUESTS, generated_tokens=generated,
                wall_seconds=generated / throughput, drafts=0, draft_tokens=0,
                accepted_tokens=0, accepted_at=[])


def drafter_counts(quality, task_index, batch_size, temperature, k):
    """Chosen counts: acceptance p per position falls with the task index and temperature;
    the wall time is the baseline's / AL times a verification cost that grows with k and b."""
    base = baseline_counts(task_index, batch_size, temperature)
    p = max(0.05, min(0.95, quality * (1 - 0.15 * task_index) * (1 - 0.2 * temperature)))
    expected = sum(p ** i for i in range(1, k + 1))
    drafts = max(1, int(base["generated_tokens"] / (1 + expected)))
    accepted_at = [int(drafts * p ** i) for i in range(1, k + 1)]
    al = 1 + sum(accepted_at) / drafts
    wall = base["wall_seconds"] * (1 + 0.08 * k) * (1 + 0.06 * math.log2(batch_size)) / al
    return dict(base, wall_seconds=wall, drafts=drafts, draft_tokens=drafts * k,
                accepted_tokens=sum(accepted_at), accepted_at=accepted_at)


def result_from_counts(run, task, batch_size, temperature, k, c, baseline=None):
    """A Result whose figures worker.metrics computes from the counts `c`."""
    sc = metrics.SpecCounts(c["drafts"], c["draft_tokens"], c["accepted_tokens"],
                            c["accepted_at"])
    throughput = metrics.output_throughput(c["generated_tokens"], c["wall_seconds"])
    per_token = c["wall_seconds"] * batch_size / c["generated_tokens"]
    tpot = metrics.summary([per_token * f for f in (0.9, 1.0, 1.0, 1.1, 1.3)])
    ttft = metrics.summary([per_token * f for f in (2.0, 2.5, 3.0)])
    r = Result(
        run=run, task=task, batch_size=batch_size, temperature=temperature, k=k,
        requests=c["requests"], generated_tokens=c["generated_tokens"],
        wall_seconds=c["wall_seconds"], drafts=c["drafts"], draft_tokens=c["draft_tokens"],
        accepted_tokens=c["accepted_tokens"], accepted_at=c["accepted_at"],
        acceptance_length=metrics.acceptance_length(sc),
        acceptance_rate=metrics.acceptance_rate(sc),
        per_position_acceptance=metrics.per_position_acceptance(sc),
        conditional_acceptance=metrics.conditional_acceptance(sc),
        output_throughput=throughput,
        **{f"ttft_{s}": v for s, v in ttft.items()}, **{f"tpot_{s}": v for s, v in tpot.items()},
    )
    if baseline is not None:
        r.baseline_result = baseline
        r.speedup = metrics.speedup(throughput, baseline.output_throughput)
        r.lossless_share = 1.0 if temperature == 0 else None
    return r


def add_baseline_results(run):
    spec = run.protocol.spec
    rows = [result_from_counts(run, c.task, c.batch_size, c.temperature, 0,
                               baseline_counts(_task_index(spec, c.task), c.batch_size,
                                               c.temperature))
            for c in spec.cells(with_drafter=False)]
    return Result.objects.bulk_create(rows)


def add_drafter_results(run, quality, baseline_results):
    spec = run.protocol.spec
    base = {(r.task, r.batch_size, float(r.temperature)): r for r in baseline_results}
    rows = [result_from_counts(run, c.task, c.batch_size, c.temperature, c.k,
                               drafter_counts(quality, _task_index(spec, c.task), c.batch_size,
                                              c.temperature, c.k),
                               baseline=base[(c.task, c.batch_size, float(c.temperature))])
            for c in spec.cells(with_drafter=True)]
    return Result.objects.bulk_create(rows, batch_size=1000)


def _task_index(spec, task):
    return [t.task for t in spec.tasks].index(task)


def seed_board(protocol, n_drafters, owner=None, prefix="drafter"):
    """A succeeded baseline and `n_drafters` n-gram drafters with succeeded runs."""
    baseline = make_run(protocol)
    base_results = add_baseline_results(baseline)
    drafters = []
    for i in range(n_drafters):
        d = make_drafter(protocol.target, f"{prefix} {protocol.slug} {i}", owner=owner,
                         params={"prompt_lookup_min": 1 + i % 3, "prompt_lookup_max": 4 + i % 3},
                         claimed_acceptance_length=2.0, claimed_speedup=1.8,
                         claimed_source="https://example.org/paper")
        run = make_run(protocol, d)
        add_drafter_results(run, 0.4 + 0.5 * (i + 1) / (n_drafters + 1), base_results)
        drafters.append(d)
    return {"baseline": baseline, "baseline_results": base_results, "drafters": drafters}


def landing_cell(run, cell, quality=0.6):
    """A CellResult as worker.measure yields it, for services.runs.record_cell (the path a
    worker's cell takes): the counts of `drafter_counts` / `baseline_counts`, figures by
    worker.metrics, one record per request (same outputs as the baseline: lossless)."""
    from worker.cell import FIGURE_KEYS, CellResult

    spec = run.protocol.spec
    i = _task_index(spec, cell.task)
    counts = (drafter_counts(quality, i, cell.batch_size, cell.temperature, cell.k) if cell.k
              else baseline_counts(i, cell.batch_size, cell.temperature))
    row = result_from_counts(run, cell.task, cell.batch_size, cell.temperature, cell.k, counts)
    figures = {key: getattr(row, key, None) for key in FIGURE_KEYS}
    figures.update(repetitions=1, pass_throughputs=[row.output_throughput], host_load=0.0,
                   loaded=False)
    per_request = counts["generated_tokens"] // counts["requests"]
    records = [{"prompt_id": f"p{n}", "repetition": 0,
                "output_token_ids": list(range(per_request))} for n in range(counts["requests"])]
    return CellResult(cell=cell, figures=figures, records=records,
                      outputs={r["prompt_id"]: r["output_token_ids"] for r in records},
                      checks={"ok": True, "failed": []})


# ---- intake: what the intake worker does, in the test process -----------------------------

def check_submissions(send=True) -> list:
    """Check every submission still checking, as the intake worker's task does (its body,
    leaderboard/services/intake.py ``check``; tests/test_intake.py runs a real worker)."""
    from leaderboard.models import Submission
    from leaderboard.services import intake

    pending = Submission.objects.filter(state=Submission.CHECKING).order_by("pk")
    return [intake.check(pk, send=send) for pk in list(pending.values_list("pk", flat=True))]


def submitted(response):
    """The submission a submit page's redirect (302) or the API's 202 names, checked by
    the intake task's body; None when the submit was refused at once."""
    from leaderboard.services import intake

    if response.status_code == 302 and "/submissions/" in response["Location"]:
        pk = int(response["Location"].rstrip("/").rsplit("/", 1)[-1])
    elif response.status_code == 202:
        pk = response.json()["id"]
    else:
        return None
    return intake.check(pk)
