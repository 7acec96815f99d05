"""Protocol v2 on the site: one rule for the baseline a cell divides by (pinned), paired
runs, drift, intervals, tied ranks, prompt ids per category, refusal of protocols whose
prompts cannot fill a batch. Real rows written by the run service from CellResult objects
built here (the worker's output shape), real pages, real API calls."""
import csv
import io
from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse
from django.utils import timezone

from leaderboard import records
from leaderboard.models import Protocol, Result, Run
from leaderboard.services import runs
from worker import metrics
from worker.measure import CellResult
from worker.protocol import Cell, ProtocolSpec, TaskSpec

from . import factories as f

pytestmark = pytest.mark.django_db

PROMPTS = ("writing-0", "coding-0", "writing-1", "coding-1")


@pytest.fixture(autouse=True)
def no_page_cache(settings):
    settings.SPECBOARD_PAGE_CACHE_SECONDS = 0


def cell_result(cell, throughput, passes=None, k_al=2.0, checks=None, host_load=0.1):
    """A CellResult as worker.measure yields it: per-request records (prompt, repetition,
    output tokens, time share) whose tokens / time give `throughput` per pass (`passes`:
    one throughput per repetition; default one pass at `throughput`)."""
    passes = passes or [throughput]
    records, tokens_total, wall_total = [], 0, 0.0
    for rep, thr in enumerate(passes):
        lengths = [40 + 7 * i for i in range(len(PROMPTS))]
        wall = sum(lengths) / thr
        for i, (pid, n) in enumerate(zip(PROMPTS, lengths)):
            # uneven shares (still summing to the pass's wall time), so bootstraps vary
            share = wall * (n * (1 + 0.1 * ((i + rep + cell.k) % 3 - 1))) / sum(
                m * (1 + 0.1 * ((j + rep + cell.k) % 3 - 1)) for j, m in enumerate(lengths))
            records.append({"prompt_id": pid, "repetition": rep, "output_token_ids":
                            list(range(n)), "time_share": share, "latency": share,
                            "decode_tokens": n - 1, "decode_steps": n - 1,
                            "drafts": 0, "accepted_tokens": 0})
        tokens_total += sum(lengths)
        wall_total += wall
    drafts = 0 if cell.k == 0 else tokens_total // 3
    accepted = int(drafts * (k_al - 1))
    sc = metrics.SpecCounts(drafts, drafts * cell.k, accepted,
                            [accepted // max(cell.k, 1)] * cell.k)
    figures = dict(
        requests=len(records), generated_tokens=tokens_total, wall_seconds=wall_total,
        drafts=drafts, draft_tokens=drafts * cell.k, accepted_tokens=accepted,
        accepted_at=list(sc.accepted_at), acceptance_length=metrics.acceptance_length(sc),
        acceptance_rate=metrics.acceptance_rate(sc),
        per_position_acceptance=metrics.per_position_acceptance(sc),
        conditional_acceptance=metrics.conditional_acceptance(sc),
        output_throughput=tokens_total / wall_total,
        **{f"ttft_{s}": 0.1 for s in ("mean", "p50", "p90", "p99")},
        **{f"tpot_{s}": 0.02 for s in ("mean", "p50", "p90", "p99")},
        repetitions=len(passes), decode_tokens=tokens_total - len(records),
        decode_steps=(tokens_total - len(records)) // (2 if cell.k else 1),
        tokens_per_step=2.0 if cell.k else 1.0,
        engine_acceptance_length=(metrics.acceptance_length(sc) + 0.05) if cell.k else None,
        output_throughput_low=0.95 * tokens_total / wall_total,
        output_throughput_high=1.05 * tokens_total / wall_total,
        acceptance_length_low=None, acceptance_length_high=None,
        pass_throughputs=list(passes), host_load=host_load, loaded=host_load > 0.5)
    checks = checks or {"ok": True, "failed": [], "in_flight_reached": True,
                        "prefix_caching": False}
    outputs = {r["prompt_id"]: r["output_token_ids"] for r in records if r["repetition"] == 0}
    return CellResult(cell=cell, figures=figures, outputs=outputs, records=records,
                      checks=checks)


def one_cell_protocol(baseline="shared", **kw):
    target = f.make_target()
    return f.make_protocol(target, slug=f"v2-{baseline}", tasks=("chat",), batch_sizes=(1,),
                           ks=(2,), baseline=baseline, **kw)


def test_a_remeasured_shared_baseline_leaves_every_place_showing_the_pinned_speedup(client):
    protocol = one_cell_protocol("shared")
    base_cell, cell = Cell("chat", 1, 0.0, 0), Cell("chat", 1, 0.0, 2)
    first = f.make_run(protocol)
    runs.record_cell(first, cell_result(base_cell, 50.0))
    drafter = f.make_drafter(protocol.target, "pinned drafter")
    run = f.make_run(protocol, drafter)
    runs.record_cell(run, cell_result(cell, 80.0))
    other = f.make_drafter(protocol.target, "other drafter")
    runs.record_cell(f.make_run(protocol, other), cell_result(cell, 60.0))
    # the baseline is measured again, 25% slower: 80/40 = 2.0 would be the live figure
    second = f.make_run(protocol, queued_at=timezone.now() + timedelta(hours=1))
    runs.record_cell(second, cell_result(base_cell, 40.0))
    runs.backfill_speedups(second, records.RunRecords(second.pk))

    stored = Result.objects.get(run=run, k=2)
    assert stored.baseline_result.run_id == first.pk
    assert stored.speedup == pytest.approx(1.6)
    assert stored.speedup_low < stored.speedup < stored.speedup_high  # a real interval
    pinned, live = f"{stored.speedup:.2f}", "2.00"
    ref = f"{protocol.slug}@{protocol.version}"

    board = client.get(reverse("home"), {"protocol": ref, "task": "chat", "batch_size": 1})
    row = board.context["board"]["rows"][0]
    assert row["speedup"] == stored.speedup
    assert row["baseline_runs"][0]["id"] == first.pk
    html = board.content.decode()
    assert f"{pinned}&times;" in html and f"{live}&times;" not in html
    assert f"run #{first.pk}" in html

    compare = client.get(reverse("compare"), {"protocol": ref, "d": [drafter.slug, other.slug]})
    summary = compare.context["summary"][0]
    assert summary["drafter"]["slug"] == drafter.slug
    assert summary["speedup_by_batch"][1] == pytest.approx(stored.speedup, rel=1e-9)

    page = client.get(reverse("drafter", args=[drafter.slug]))
    (c,) = page.context["page"]["cells"]
    assert c["speedup"] == stored.speedup
    assert page.context["page"]["baseline_run"]["id"] == first.pk
    assert f"{pinned}&times;" in page.content.decode()

    pays = client.get(f"/api/protocols/{protocol.slug}/{protocol.version}/analysis").json()
    mine = next(d for d in pays["drafters"] if d["drafter"]["slug"] == drafter.slug)
    assert mine["baseline_run_id"] == first.pk
    curve = next(c for c in pays["curves"] if c["drafter"]["slug"] == drafter.slug)
    assert curve["by_batch"][0]["measured_speedup"] == pytest.approx(stored.speedup, rel=1e-9)
    best = pays["matrix"][0]["cells"][0]
    assert best["drafter"]["slug"] == drafter.slug
    assert best["speedup"] == pytest.approx(stored.speedup, rel=1e-12)
    pays_page = client.get(reverse("protocol_pays", args=[protocol.slug, protocol.version]),
                           {"w_chat": "1", "batch_size": "1"})
    assert pays_page.status_code == 200

    rec = client.get("/api/recommend", {"protocol": ref, "mix": "chat:1",
                                        "batch_size": 1}).json()
    option = next(o for o in rec["options"] if o["drafter"] and o["drafter"]["slug"] == drafter.slug)
    assert option["speedup"] == pytest.approx(stored.speedup, rel=1e-9)
    assert option["per_task"][0]["speedup"] == stored.speedup

    api = client.get("/api/results", {"run": run.pk}).json()["items"]
    assert api[0]["speedup"] == stored.speedup
    assert api[0]["baseline_result_id"] == stored.baseline_result_id
    assert api[0]["baseline_run_id"] == first.pk
    assert api[0]["speedup_low"] == stored.speedup_low
    assert api[0]["tokens_per_step"] == 2.0 and api[0]["checks_ok"] is True

    text = b"".join(client.get("/api/results", {"run": run.pk, "format": "csv"})
                    .streaming_content).decode()
    (line,) = list(csv.DictReader(io.StringIO(text)))
    assert float(line["speedup"]) == pytest.approx(stored.speedup, rel=1e-12)
    assert line["baseline_run_id"] == str(first.pk)
    assert float(line["speedup_high"]) == pytest.approx(stored.speedup_high, rel=1e-12)


def test_paired_cells_divide_by_their_own_runs_k0_cells(client):
    protocol = one_cell_protocol("paired", repetitions=3)
    # a shared-looking baseline run with another throughput must not be used
    other = f.make_run(protocol)
    runs.record_cell(other, cell_result(Cell("chat", 1, 0.0, 0), 20.0))
    drafter = f.make_drafter(protocol.target, "paired drafter")
    run = f.make_run(protocol, drafter, state=Run.RUNNING)
    assert run.cells_total == 2  # its k=0 cell and its k=2 cell (ProtocolSpec.run_cells)
    runs.record_cell(run, cell_result(Cell("chat", 1, 0.0, 0), 50.0, passes=[50, 50, 50]))
    runs.record_cell(run, cell_result(Cell("chat", 1, 0.0, 2), 75.0, passes=[75, 75, 75]))
    cell = Result.objects.get(run=run, k=2)
    assert cell.baseline_result.run_id == run.pk
    assert cell.speedup == pytest.approx(1.5)
    # a resumed group is measured again whole: the new pair replaces the stored speedup
    runs.record_cell(run, cell_result(Cell("chat", 1, 0.0, 0), 60.0, passes=[60, 60, 60]))
    runs.record_cell(run, cell_result(Cell("chat", 1, 0.0, 2), 75.0, passes=[75, 75, 75]))
    cell.refresh_from_db()
    assert cell.speedup == pytest.approx(1.25)
    assert Result.objects.filter(run=run).count() == 2
    assert runs.finish(run, Run.SUCCEEDED)
    run.refresh_from_db()
    assert run.drift == 0.0 and not run.drift_flagged
    ref = f"{protocol.slug}@{protocol.version}"
    row = client.get(reverse("home"), {"protocol": ref}).context["board"]["rows"][0]
    assert row["k"] == 2 and row["paired"] and row["baseline_runs"][0]["same_run"]
    page = client.get(reverse("drafter", args=[drafter.slug]))
    assert [c["k"] for c in page.context["page"]["cells"]] == [2]
    assert "same run" in page.content.decode()


def test_a_run_with_drift_between_baseline_passes_is_flagged(client):
    protocol = one_cell_protocol("paired", repetitions=3)
    drafter = f.make_drafter(protocol.target, "drifting drafter")
    run = f.make_run(protocol, drafter, state=Run.RUNNING)
    runs.record_cell(run, cell_result(Cell("chat", 1, 0.0, 0), 50.0, passes=[50, 55, 50]))
    runs.record_cell(run, cell_result(Cell("chat", 1, 0.0, 2), 75.0, passes=[75, 80, 76]))
    runs.finish(run, Run.SUCCEEDED)
    run.refresh_from_db()
    assert run.drift == pytest.approx(5 / (155 / 3))
    assert run.drift_flagged
    html = client.get(reverse("run", args=[run.pk])).content.decode()
    assert "DRIFT FLAGGED" in html
    api = client.get(f"/api/runs/{run.pk}").json()
    assert api["drift_flagged"] is True and api["drift"] == pytest.approx(run.drift)
    # a quiet run is not flagged
    quiet = f.make_run(protocol, drafter, state=Run.RUNNING)
    runs.record_cell(quiet, cell_result(Cell("chat", 1, 0.0, 0), 50.0, passes=[50, 51, 50]))
    runs.finish(quiet, Run.SUCCEEDED)
    quiet.refresh_from_db()
    assert not quiet.drift_flagged
    assert "DRIFT FLAGGED" not in client.get(reverse("run", args=[quiet.pk])).content.decode()


def test_run_page_shows_checks_and_host_load(client):
    protocol = one_cell_protocol("shared")
    run = f.make_run(protocol)
    runs.record_cell(run, cell_result(Cell("chat", 1, 0.0, 0), 50.0, host_load=1.4, checks={
        "ok": False, "failed": ["in-flight 3 < batch size 4"], "in_flight_reached": False,
        "prefix_caching": False}))
    html = client.get(reverse("run", args=[run.pk])).content.decode()
    assert "failed: in-flight 3 &lt; batch size 4" in html
    assert "loaded" in html and "1.40" in html
    row = client.get("/api/results", {"run": run.pk}).json()["items"][0]
    assert row["checks_ok"] is False and row["checks_failed"] == ["in-flight 3 < batch size 4"]
    assert row["loaded"] is True


def test_overlapping_speedup_intervals_rank_as_a_tie(client):
    target = f.make_target()
    protocol = f.make_protocol(target)
    seeded = f.seed_board(protocol, 3)
    for d, (lo, s, hi) in zip(seeded["drafters"], [(1.0, 1.1, 1.2), (1.15, 1.3, 1.45),
                                                   (1.6, 1.7, 1.8)]):
        Result.objects.filter(run__drafter=d).update(speedup=s, speedup_low=lo,
                                                     speedup_high=hi)
    ref = f"{protocol.slug}@{protocol.version}"
    response = client.get(reverse("home"), {"protocol": ref, "task": "chat", "k": 2})
    rows = response.context["board"]["rows"]
    assert [r["speedup"] for r in rows] == [1.7, 1.3, 1.1]
    assert [(r["rank"], r["tied"]) for r in rows] == [(1, False), (2, True), (2, True)]
    html = response.content.decode()
    assert "=2" in html and "1.70&times; ± 0.10" in html


def test_protocol_page_lists_the_prompt_ids_measured_per_category(client):
    target = f.make_target()
    protocol = f.make_protocol(target, slug="strat", selection="stratified")
    html = client.get(reverse("protocol", args=[protocol.slug, protocol.version])).content.decode()
    # 4 prompts per task, in turn from writing and coding
    assert "writing-0, writing-1" in html and "coding-0, coding-1" in html
    api = client.get(f"/api/protocols/{protocol.slug}/{protocol.version}").json()
    assert api["tasks"][0]["prompt_ids"] == {"writing": ["writing-0", "writing-1"],
                                             "coding": ["coding-0", "coding-1"]}
    assert api["baseline_mode"] == "shared" and "does not change stored" in api["pinned_rule"]
    assert "BCa" in api["interval_method"]
    first = f.make_protocol(target, slug="firsts")
    ids = client.get(f"/api/protocols/{first.slug}/{first.version}").json()["tasks"][0]["prompt_ids"]
    assert ids == {"writing": ["writing-0", "writing-1", "writing-2", "writing-3"]}


def test_a_protocol_whose_prompts_cannot_fill_a_batch_is_refused():
    target = f.make_target()
    small = f.make_prompt_set("small-set", categories=("writing",), per_category=3)
    spec = ProtocolSpec(slug="too-big", version=1, target=target.slug,
                        target_sha256=target.weights_sha256, engine="vllm", hardware="cpu",
                        tasks=(TaskSpec("chat", small.slug, small.source_sha256, 4),),
                        batch_sizes=(1, 4), ks=(2,))
    with pytest.raises(ValueError, match="needs 4 prompts; the prompt set has 3"):
        Protocol.objects.create(target=target, spec=spec.to_dict())
    p = Protocol(target=target, spec=spec.to_dict())
    with pytest.raises(ValidationError, match="largest batch size is 4"):
        p.clean()
    ok = f.make_protocol(target, slug="fits", batch_sizes=(1, 4))
    with pytest.raises(ValueError, match="fewer than the largest batch size 16"):
        ok.new_version(batch_sizes=[1, 16])


def test_paired_protocol_queues_no_separate_baseline_and_shared_does():
    paired = one_cell_protocol("paired")
    d = f.make_drafter(paired.target, "queued drafter")
    run = runs.queue_run(paired, d, send=False)
    assert run.cells_total == 2
    assert not Run.objects.filter(protocol=paired, drafter__isnull=True).exists()
    shared = f.make_protocol(paired.target, slug="shared-q", tasks=("chat",), batch_sizes=(1,),
                             ks=(2,))
    runs.queue_run(shared, d, send=False)
    assert Run.objects.filter(protocol=shared, drafter__isnull=True).count() == 1


def test_a_new_engine_version_gets_its_own_shared_baseline():
    protocol = one_cell_protocol("shared")
    f.make_run(protocol, engine_version="1.0")
    d = f.make_drafter(protocol.target, "upgraded")
    run = f.make_run(protocol, d, state=Run.RUNNING, engine_version="")
    runs.record_started(run, {"engine_version": "2.0"})
    queued = Run.objects.filter(protocol=protocol, drafter__isnull=True, state=Run.QUEUED)
    assert queued.count() == 1
    runs.record_started(run, {"engine_version": "2.0"})  # not twice
    assert queued.count() == 1


def test_the_worker_figures_are_result_columns():
    from worker.cell import FIGURE_KEYS

    columns = {f.name for f in Result._meta.get_fields()}
    assert set(FIGURE_KEYS) <= columns
    assert set(FIGURE_KEYS) <= set(Result.CELL_FIELDS)


def test_the_demo_waits_for_the_host_lock_then_labels_contention(tmp_path):
    from demo import backend as demo_backend
    from worker.hostlock import HostLock

    lock = tmp_path / "host.lock"
    waited = []
    assert demo_backend.host_contended(lock, 0.2, on_wait=lambda: waited.append(1)) is False
    assert waited == []
    with HostLock(lock, log=lambda m: None):
        # held by an open file of this process: the probe opens its own, so it sees it held
        assert demo_backend.host_contended(lock, 0.3, on_wait=lambda: waited.append(1)) is True
    assert waited == [1]
    assert demo_backend.host_contended(lock, 0.2) is False


def test_repin_speedups_moves_a_run_to_the_baseline_the_rule_picks_now():
    from django.core.management import call_command

    protocol = one_cell_protocol("shared")
    base_cell, cell = Cell("chat", 1, 0.0, 0), Cell("chat", 1, 0.0, 2)
    first = f.make_run(protocol)
    runs.record_cell(first, cell_result(base_cell, 50.0))
    run = f.make_run(protocol, f.make_drafter(protocol.target, "repinned"))
    runs.record_cell(run, cell_result(cell, 80.0))
    second = f.make_run(protocol, queued_at=timezone.now() + timedelta(hours=1))
    runs.record_cell(second, cell_result(base_cell, 40.0))
    assert Result.objects.get(run=run, k=2).speedup == pytest.approx(1.6)
    out = io.StringIO()
    call_command("repin_speedups", str(run.pk), stdout=out)
    moved = Result.objects.get(run=run, k=2)
    assert moved.speedup == pytest.approx(2.0) and moved.baseline_result.run_id == second.pk
    assert "-> 2.0" in out.getvalue()
