"""The first ten minutes: a run still measuring shows its cells as they land on the
leaderboard, drafter, compare and "When does it pay?" pages (marked measuring, never
ranked), a succeeded run stays shown while a re-run measures, an empty board says what is
measuring next. Cells are written by the run service (services.runs.record_cell) from
CellResult objects in the order the worker measures them (worker.measure), on the real
database, through real pages and API calls."""
import time

import pytest
from django.urls import reverse

from leaderboard.models import Result, Run
from leaderboard.services import runs
from worker.measure import first_comparison, measurement_groups_for

from . import factories as f
from .test_protocol_v2_site import cell_result

pytestmark = pytest.mark.django_db
REPS = 3


@pytest.fixture(autouse=True)
def no_page_cache(settings):
    settings.SPECBOARD_PAGE_CACHE_SECONDS = 0


def paired_protocol():
    target = f.make_target()
    return f.make_protocol(target, slug="measuring", tasks=("chat", "code"),
                           batch_sizes=(1, 4), ks=(2, 4), baseline="paired",
                           repetitions=REPS)


def throughput(cell):
    """A throughput per cell: the drafter's k = 2 cells beat the baseline, k = 4 less."""
    return 40.0 * cell.batch_size ** 0.5 * {0: 1.0, 2: 1.5, 4: 1.2}[cell.k]


def measure_groups(run, groups, started):
    """Write each group's cells as the run service does when the worker yields them."""
    for group in groups:
        for cell in group:
            runs.record_cell(run, cell_result(cell, throughput(cell),
                                              passes=[throughput(cell)] * REPS))
            runs.update_progress(run, Result.objects.filter(run=run).count(), started)


def running_run(protocol, name="n-gram"):
    drafter = f.make_drafter(protocol.target, name)
    run = f.make_run(protocol, drafter, state=Run.RUNNING, cells_done=0)
    return drafter, run


def test_an_empty_board_says_what_is_measuring_next_then_shows_the_first_comparison(client):
    protocol = paired_protocol()
    drafter, run = running_run(protocol)
    groups = measurement_groups_for(protocol.spec, drafter.method)
    task, temperature, b = first_comparison(protocol.spec)

    response = client.get(reverse("home"))
    assert response.context["board"]["rows"] == []
    (active,) = response.context["measuring"]
    assert active["id"] == run.pk and active["cells_total"] == run.cells_total
    assert active["next"] == {"task": task, "temperature": temperature, "batch_size": b,
                              "ks": [0, *protocol.spec.ks]}
    html = response.content.decode()
    assert 'id="measuring-now"' in html and reverse("queue") in html
    assert f"{task}, batch {b}, temperature 0: baseline, k=2, k=4" in html
    assert "queue.js" in html  # the queue's live progress and ETA

    measure_groups(run, groups[:1], time.monotonic())
    run.refresh_from_db()
    assert run.cells_done == len(groups[0]) and run.eta_seconds is not None

    response = client.get(reverse("home"))
    board = response.context["board"]
    # the default batch size is the smallest with rows: the first comparison's
    assert board["filters"]["batch_size"] == b == max(protocol.spec.batch_sizes)
    assert response.context["measuring"] == []        # the board has rows: no panel
    rows = board["rows"]
    assert sorted(r["k"] for r in rows) == list(protocol.spec.ks)
    for row in rows:
        cell = Result.objects.get(run=run, k=row["k"], batch_size=b)
        # the speedup divides by the run's own k = 0 cell (services.baselines' rule)
        assert cell.baseline_result == Result.objects.get(run=run, k=0, batch_size=b)
        assert row["speedup"] == cell.speedup == pytest.approx(
            throughput(cell) / cell.baseline_result.output_throughput)
        assert row["run"]["measuring"] and row["rank"] is None
        assert row["tasks_measured"] == 1
    html = response.content.decode()
    assert f"measuring: {len(groups[0])} of {run.cells_total} cells" in html
    assert reverse("run", args=[run.pk]) in html and "over 1 of 2 tasks so far" in html
    assert "No drafter has a finished" not in html
    # batch size 1 has nothing yet: an empty board with the panel, next group named
    response = client.get(reverse("home"), {"batch_size": 1})
    assert response.context["board"]["rows"] == []
    assert response.context["measuring"][0]["next"]["batch_size"] == groups[1][0].batch_size

    # the run finishes: the same cells, no longer marked, ranked
    measure_groups(run, groups[1:], time.monotonic())
    assert runs.finish(run, Run.SUCCEEDED)
    rows = client.get(reverse("home")).context["board"]["rows"]
    assert {r["batch_size"] for r in rows} == {min(protocol.spec.batch_sizes)}
    assert all(not r["run"]["measuring"] and r["rank"] for r in rows)


def test_a_measuring_row_takes_no_rank_and_finished_rows_keep_theirs(client):
    target = f.make_target()
    protocol = f.make_protocol(target)
    seeded = f.seed_board(protocol, 3)
    ref = f"{protocol.slug}@{protocol.version}"
    before = client.get(reverse("home"), {"protocol": ref}).context["board"]["rows"]
    ranks = {(r["run_id"], r["k"]): (r["rank"], r["tied"], r["speedup"]) for r in before}

    fast = f.make_drafter(target, "fast but measuring")
    run = f.make_run(protocol, fast, state=Run.RUNNING, cells_done=1)
    base = next(r for r in seeded["baseline_results"] if r.task == "chat" and r.batch_size == 1)
    f.result_from_counts(run, "chat", 1, 0.0, 2, f.drafter_counts(0.99, 0, 1, 0.0, 2),
                         baseline=base).save()
    rows = client.get(reverse("home"), {"protocol": ref}).context["board"]["rows"]
    mine = [r for r in rows if r["run_id"] == run.pk]
    assert len(mine) == 1 and mine[0]["rank"] is None and mine[0]["run"]["measuring"]
    assert mine[0]["speedup"] > max(s for _, _, s in ranks.values())
    assert rows[0] is mine[0]   # sorted by its figure among the others
    assert {(r["run_id"], r["k"]): (r["rank"], r["tied"], r["speedup"])
            for r in rows if r is not mine[0]} == ranks


def test_a_succeeded_run_stays_shown_while_a_rerun_measures(client):
    target = f.make_target()
    protocol = f.make_protocol(target)
    seeded = f.seed_board(protocol, 2)
    drafter = seeded["drafters"][0]
    old = drafter.runs.get()
    ref = f"{protocol.slug}@{protocol.version}"
    before = [r for r in client.get(reverse("home"), {"protocol": ref}).context["board"]["rows"]
              if r["drafter"]["slug"] == drafter.slug]
    rerun = f.make_run(protocol, drafter, state=Run.RUNNING, cells_done=1)
    f.result_from_counts(rerun, "chat", 1, 0.0, 2, f.drafter_counts(0.1, 0, 1, 0.0, 2),
                         baseline=seeded["baseline_results"][0]).save()

    response = client.get(reverse("home"), {"protocol": ref})
    after = [r for r in response.context["board"]["rows"] if r["drafter"]["slug"] == drafter.slug]
    strip = ("run",)
    assert [{k: v for k, v in r.items() if k not in strip} for r in after] == \
        [{k: v for k, v in r.items() if k not in strip} for r in before]
    assert all(r["run_id"] == old.pk and r["run"]["remeasuring"]["id"] == rerun.pk
               for r in after)
    assert f"re-measuring: 1 of {rerun.cells_total} cells" in response.content.decode()

    page = client.get(reverse("drafter", args=[drafter.slug]))
    assert page.context["page"]["run"]["id"] == old.pk
    assert page.context["page"]["remeasuring"]["id"] == rerun.pk
    assert [r["id"] for r in page.context["measuring"]] == [rerun.pk]
    html = page.content.decode()
    assert 'id="remeasuring-note"' in html and f"run #{rerun.pk}" in html

    compare = client.get(reverse("compare"), {"protocol": ref,
                                              "d": [d.slug for d in seeded["drafters"]]})
    entry = next(e for e in compare.context["summary"] if e["drafter"]["slug"] == drafter.slug)
    assert entry["run"]["id"] == old.pk and entry["run"]["remeasuring"]["id"] == rerun.pk


def test_the_drafter_page_of_a_queued_run_says_what_comes_next(client):
    protocol = paired_protocol()
    ahead = f.make_run(protocol, f.make_drafter(protocol.target, "ahead"), state=Run.QUEUED)
    drafter = f.make_drafter(protocol.target, "waiting")
    run = f.make_run(protocol, drafter, state=Run.QUEUED)
    page = client.get(reverse("drafter", args=[drafter.slug]))
    (active,) = page.context["measuring"]
    assert active["id"] == run.pk and active["position"] == 2 and ahead.pk != run.pk
    task, temperature, b = first_comparison(protocol.spec)
    assert (active["next"]["task"], active["next"]["batch_size"]) == (task, b)
    html = page.content.decode()
    assert 'id="measuring-now"' in html and reverse("queue") in html
    assert "No measured cells yet" in html


def test_compare_pays_and_the_api_mark_a_measuring_run(client):
    protocol = paired_protocol()
    finished, done_run = running_run(protocol, "finished")
    measure_groups(done_run, measurement_groups_for(protocol.spec, "ngram"),
                   time.monotonic())
    assert runs.finish(done_run, Run.SUCCEEDED)
    drafter, run = running_run(protocol, "still measuring")
    measure_groups(run, measurement_groups_for(protocol.spec, "ngram")[:1], time.monotonic())
    ref = f"{protocol.slug}@{protocol.version}"

    response = client.get(reverse("compare"), {"protocol": ref, "d": [finished.slug, drafter.slug]})
    cands = {c["slug"]: c["measuring"] for c in response.context["candidates"]}
    assert cands == {finished.slug: False, drafter.slug: True}
    summary = {s["drafter"]["slug"]: s for s in response.context["summary"]}
    assert summary[drafter.slug]["run"]["measuring"]
    assert not summary[finished.slug]["run"]["measuring"]
    b = first_comparison(protocol.spec)[2]
    assert summary[drafter.slug]["speedup_by_batch"][b] is not None
    html = response.content.decode()
    assert 'id="measuring-note"' in html and ", measuring" in html   # chart trace names

    pays = client.get(reverse("protocol_pays", args=[protocol.slug, protocol.version]))
    drafters = {d["drafter"]["slug"]: d for d in pays.context["data"]["drafters"]}
    assert drafters[drafter.slug]["measuring"] and drafters[drafter.slug]["has_records"]
    assert not drafters[finished.slug]["measuring"]
    curves = [c for c in pays.context["data"]["curves"] if c["drafter"]["slug"] == drafter.slug]
    assert curves and all(c["measuring"] for c in curves)
    assert "badge measuring" in pays.content.decode()

    url = f"/api/protocols/{protocol.slug}/{protocol.version}/analysis"
    default = {d["drafter"]["slug"] for d in client.get(url).json()["drafters"]}
    assert default == {finished.slug}          # unchanged for existing consumers
    both = client.get(url, {"include_running": 1}).json()["drafters"]
    assert {d["drafter"]["slug"]: d["measuring"] for d in both} == \
        {finished.slug: False, drafter.slug: True}

    rows = client.get("/api/results", {"protocol": ref, "limit": 1000}).json()["items"]
    states = {r["run_id"]: r["run_state"] for r in rows}
    assert states == {done_run.pk: "succeeded", run.pk: "running"}
    finished_only = client.get("/api/results", {"protocol": ref, "run_state": "succeeded",
                                                "limit": 1000}).json()["items"]
    assert {r["run_id"] for r in finished_only} == {done_run.pk}


def test_the_cached_board_follows_a_running_runs_cells(client, settings):
    from django.core.cache import cache

    settings.SPECBOARD_PAGE_CACHE_SECONDS = 60
    settings.SPECBOARD_LANDING_REFRESH_S = 0   # every landing cell, not one per interval
    cache.clear()
    protocol = paired_protocol()
    drafter, run = running_run(protocol)
    groups = measurement_groups_for(protocol.spec, drafter.method)
    assert client.get(reverse("home")).context["measuring"]
    measure_groups(run, groups[:1], time.monotonic())
    html = client.get(reverse("home")).content.decode()
    assert f"measuring: {len(groups[0])} of" in html
    measure_groups(run, groups[1:2], time.monotonic())
    html = client.get(reverse("home"), {"batch_size": groups[1][0].batch_size}).content.decode()
    assert f"measuring: {len(groups[0]) + len(groups[1])} of" in html
    # a run that fails leaves the board at once (its cells stay on its run page)
    assert runs.finish(run, Run.FAILED, "stopped")
    html = client.get(reverse("home")).content.decode()
    assert "badge measuring" not in html and "No drafter has a finished or measuring" in html
    cache.clear()


def test_a_run_over_two_engine_starts_shows_each_cell_after_its_first_start_and_resumes_the_rest(
        client, tmp_path):
    """Protocol v4 (engine_starts = 2): the worker yields every cell after each start's
    round. The site stores the first as a provisional cell (shown, counted as one of two
    measurements, not skipped on resume) and replaces it with the second."""
    protocol = f.make_protocol(f.make_target(), slug="starts", tasks=("chat",),
                               batch_sizes=(4,), ks=(2,), baseline="paired", repetitions=2,
                               engine_starts=2)
    protocol.target.path = str(tmp_path)       # build_job needs the target's folder
    protocol.target.save()
    drafter = f.make_drafter(protocol.target, "n-gram")
    run = runs.queue_run(protocol, drafter, send=False)
    cells = protocol.spec.run_cells("ngram")
    assert run.cells_total == 2 * len(cells) == 4
    Run.objects.filter(pk=run.pk).update(state=Run.RUNNING)
    run.refresh_from_db()

    def land(starts, started=time.monotonic()):
        for cell in cells:
            result = cell_result(cell, throughput(cell), passes=[throughput(cell)] * starts)
            result.figures["engine_starts"] = starts
            runs.record_cell(run, result)
            runs.update_progress(run, starts * len(cells), started)

    land(1)
    run.refresh_from_db()
    assert run.cells_done == 2 and run.progress == 0.5 and run.eta_seconds is not None
    assert runs.build_job(run).skip == frozenset()        # provisional: measured again
    assert list(Result.objects.filter(run=run).values_list("engine_starts", flat=True)) == [
        1, 1]
    page = client.get(reverse("run", args=[run.pk])).content.decode()
    assert page.count("(1/2 starts)") == 2 and 'id="engine-starts"' in page
    board = client.get(reverse("home"), {"protocol": "starts@1"}).context["board"]
    assert [r["run"]["measuring"] for r in board["rows"]] == [True]   # shown, unranked

    land(2)
    run.refresh_from_db()
    assert run.cells_done == run.cells_total == 4
    assert runs.build_job(run).skip == frozenset(c.key for c in cells)
    page = client.get(reverse("run", args=[run.pk])).content.decode()
    assert page.count("(2/2 starts)") == 2 and "(1/2 starts)" not in page
    api = client.get("/api/results", {"run": run.pk}).json()["items"]
    assert sorted(r["engine_starts"] for r in api) == [2, 2]
    assert Result.objects.filter(run=run).get(k=2).repetitions == 2
