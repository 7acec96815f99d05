"""One speedup everywhere (issue #30): the leaderboard, the drafter page, "When does it pay?"
(page and API), the compare page, the results API and its CSV and JSON exports serve the
same speedup for every cell of a seeded database, by the one rule of
worker/analysis/speedups.py.

A cell's speedup is its stored figure (Result.speedup, over the baseline cell pinned to it,
Result.baseline_result). Over tasks, at one batch size, temperature and k, a drafter's
speedup is its cells' summed generated tokens over their summed wall seconds, divided by
the same for their pinned baseline cells.

The database holds a second, newer succeeded baseline run whose cells are slower: the
pinned baseline is then not the newest one, and a surface that divided by the newest
baseline (matching baseline cells by key, as some pages did before) serves other figures
and fails here. Every figure compared is read from what a user gets: the API's JSON, the
CSV, and the context the pages are rendered from."""
import csv
import io
import json
from collections import defaultdict
from datetime import timedelta

import pytest
from django.urls import reverse

from leaderboard.models import Result

from . import factories as f

pytestmark = pytest.mark.django_db

# How much slower the newer baseline run is than the one the drafters' cells are pinned to.
NEWER_BASELINE_SLOWDOWN = 1.3


@pytest.fixture(autouse=True)
def no_page_cache(settings):
    """Every page is built from the database on each request, so its context holds the
    figures (a cached fragment keeps only its HTML)."""
    settings.SPECBOARD_PAGE_CACHE_SECONDS = 0


@pytest.fixture
def seeded():
    """Two tasks, two batch sizes, two ks; two drafters whose cells are pinned to the first
    baseline run; then a newer succeeded baseline run of the same protocol, slower."""
    protocol = f.make_protocol(f.make_target())
    board = f.seed_board(protocol, 2)
    first = board["baseline"]
    newer = f.make_run(protocol, queued_at=first.queued_at + timedelta(hours=1))
    Result.objects.bulk_create([
        f.result_from_counts(newer, r.task, r.batch_size, r.temperature, 0, {
            "requests": r.requests, "generated_tokens": r.generated_tokens,
            "wall_seconds": r.wall_seconds * NEWER_BASELINE_SLOWDOWN, "drafts": 0,
            "draft_tokens": 0, "accepted_tokens": 0, "accepted_at": []})
        for r in board["baseline_results"]])
    return {"protocol": protocol, "first_baseline": first, "newer_baseline": newer,
            "drafters": board["drafters"]}


def protocol_ref(protocol):
    return f"{protocol.slug}@{protocol.version}"


# ---- what the results API serves (the ground for the expected figures) ----------------

def api_rows(client, protocol, **filters):
    """Every result row of the protocol from the paginated JSON API."""
    response = client.get("/api/results", {"protocol": protocol_ref(protocol),
                                            "limit": 1000, **filters})
    assert response.status_code == 200
    page = response.json()
    assert page["count"] == len(page["items"])  # one page holds them all
    return page["items"]


def cell_key(row):
    """(drafter slug, task, batch size, temperature, k) of a drafter cell."""
    return (row["drafter"], row["task"], row["batch_size"], float(row["temperature"]),
            row["k"])


def pooled_key(slug, batch_size, temperature, k):
    return (slug, batch_size, float(temperature), k)


def throughput(cells):
    return sum(c["generated_tokens"] for c in cells) / sum(c["wall_seconds"] for c in cells)


def pooled_over_tasks(drafter_cells, baseline_of):
    """{(drafter, batch size, temperature, k): summed throughput of the drafter's cells over
    tasks / summed throughput of baseline_of(cell) for those cells}."""
    groups = defaultdict(list)
    for c in drafter_cells:
        groups[pooled_key(c["drafter"], c["batch_size"], c["temperature"], c["k"])].append(c)
    return {key: throughput(cells) / throughput([baseline_of(c) for c in cells])
            for key, cells in groups.items()}


# ---- per-cell surfaces: {cell key: speedup} ---------------------------------------------

def api_speedups(client, protocol):
    """GET /api/results, one JSON page."""
    return {cell_key(r): r["speedup"] for r in api_rows(client, protocol) if r["k"] > 0}


def export_speedups(client, protocol, fmt):
    """GET /api/results?format=csv|json: the whole export, streamed."""
    response = client.get("/api/results", {"protocol": protocol_ref(protocol),
                                            "format": fmt})
    assert response.status_code == 200
    text = b"".join(response.streaming_content).decode()
    if fmt == "csv":
        rows = [{**r, "batch_size": int(r["batch_size"]), "k": int(r["k"]),
                 "speedup": float(r["speedup"]) if r["speedup"] else None}
                for r in csv.DictReader(io.StringIO(text))]
    else:
        rows = json.loads(text)
    return {cell_key(r): r["speedup"] for r in rows if r["k"] > 0}


def drafter_page_cell_speedups(client, slug):
    """The drafter page's table of all cells."""
    response = client.get(reverse("drafter", args=[slug]))
    assert response.status_code == 200
    return {cell_key({**c, "drafter": slug}): c["speedup"]
            for c in response.context["page"]["cells"]}


def leaderboard_rows(client, protocol, *, task=None, batch_size, temperature, k):
    params = {"protocol": protocol_ref(protocol), "batch_size": batch_size,
              "temperature": f"{temperature:g}", "k": k}
    if task is not None:
        params["task"] = task
    response = client.get(reverse("home"), params)
    assert response.status_code == 200
    rows = response.context["board"]["rows"]
    assert rows and all(r["batch_size"] == batch_size and r["k"] == k for r in rows)
    return rows


def leaderboard_cell_speedups(client, protocol):
    """The leaderboard at one task, batch size, temperature and k: one row per drafter,
    each one cell."""
    spec, out = protocol.spec, {}
    for task in spec.task_names:
        for b in spec.batch_sizes:
            for t in spec.temperatures:
                for k in spec.ks:
                    for r in leaderboard_rows(client, protocol, task=task, batch_size=b,
                                              temperature=t, k=k):
                        assert r["task"] == task
                        out[(r["drafter"]["slug"], task, b, float(t), k)] = r["speedup"]
    return out


# ---- pooled surfaces (all tasks): {(drafter, batch size, temperature, k): speedup} -------

def leaderboard_pooled_speedups(client, protocol):
    """The leaderboard over all tasks (no task chosen) at one batch size, temperature, k."""
    spec, out = protocol.spec, {}
    for b in spec.batch_sizes:
        for t in spec.temperatures:
            for k in spec.ks:
                for r in leaderboard_rows(client, protocol, batch_size=b, temperature=t, k=k):
                    assert r["task"] == "all"
                    out[pooled_key(r["drafter"]["slug"], b, t, k)] = r["speedup"]
    return out


def curves_speedups(curves, temperature):
    """{(drafter, b, temperature, k): measured_speedup} of "When does it pay?" curves."""
    return {pooled_key(c["drafter"]["slug"], x["batch_size"], temperature, c["k"]):
            x["measured_speedup"] for c in curves for x in c["by_batch"]}


def pays_page_speedups(client, protocol):
    """The protocol's "When does it pay?" page: speedup by batch size per (drafter, k)."""
    out = {}
    for t in protocol.spec.temperatures:
        response = client.get(reverse("protocol_pays", args=[protocol.slug, protocol.version]),
                              {"temperature": f"{t:g}"})
        assert response.status_code == 200
        data = response.context["data"]
        assert data["temperature"] == t
        out.update(curves_speedups(data["curves"], t))
    return out


def pays_api_speedups(client, protocol):
    """GET /api/protocols/{slug}/{version}/analysis: its curves."""
    out = {}
    for t in protocol.spec.temperatures:
        response = client.get(reverse("api:protocol_analysis",
                                      args=[protocol.slug, protocol.version]),
                              {"temperature": t})
        assert response.status_code == 200
        data = response.json()
        assert data["temperature"] == t
        out.update(curves_speedups(data["curves"], t))
    return out


def compare_speedups(client, protocol, slugs):
    """The compare page's summary: each drafter's speedup by batch size at one k."""
    spec, out = protocol.spec, {}
    for t in spec.temperatures:
        for k in spec.ks:
            response = client.get(reverse("compare"), {
                "protocol": protocol_ref(protocol), "d": slugs, "k": k,
                "temperature": f"{t:g}"})
            assert response.status_code == 200
            summary = response.context["summary"]
            assert {s["drafter"]["slug"] for s in summary} == set(slugs)
            for s in summary:
                assert s["k"] == k
                for b, v in s["speedup_by_batch"].items():
                    out[pooled_key(s["drafter"]["slug"], b, t, k)] = v
    return out


def drafter_pays_speedups(client, slug):
    """The drafter page's "When does it pay?" section: its curves per (k, temperature)."""
    response = client.get(reverse("drafter", args=[slug]))
    assert response.status_code == 200
    return {pooled_key(slug, x["batch_size"], c["temperature"], c["k"]): x["measured_speedup"]
            for c in response.context["pays"]["curves"] for x in c["by_batch"]}


def drafter_chart_speedups(client, protocol, slug):
    """The drafter page's speedup chart: its "all tasks" line, at each k."""
    spec, out = protocol.spec, {}
    for t in spec.temperatures:
        for k in spec.ks:
            response = client.get(reverse("drafter", args=[slug]),
                                  {"k": k, "temperature": f"{t:g}"})
            assert response.status_code == 200
            assert response.context["k"] == k
            fig = json.loads(response.context["figs"]["speedup"])
            line = next(tr for tr in fig["data"] if tr["name"] == "all tasks")
            for b, v in zip(line["x"], line["y"]):
                out[pooled_key(slug, b, t, k)] = v
    return out


# ---- the expected figures -------------------------------------------------------------

@pytest.fixture
def expected(client, seeded):
    """From the API's own rows: the stored cell speedups; the pooled figures over tasks
    against the pinned baseline cells (each cell's baseline_result_id), and the same against
    the newest baseline run's cells, which no surface may serve. Checks the seeding too: the
    pinned cells are the first baseline run's, the newest differs from them in every cell."""
    protocol = seeded["protocol"]
    rows = api_rows(client, protocol)
    drafter_cells = [r for r in rows if r["k"] > 0]
    baseline_cells = {r["id"]: r for r in rows if r["drafter"] is None}
    runs = client.get("/api/runs", {"protocol": protocol_ref(protocol), "baseline": True,
                                    "state": "succeeded"}).json()["items"]
    newest_run = runs[0]["id"]  # newest first
    assert [r["id"] for r in runs] == [seeded["newer_baseline"].pk,
                                       seeded["first_baseline"].pk]
    newest = {(c["task"], c["batch_size"], c["temperature"]): c
              for c in baseline_cells.values() if c["run_id"] == newest_run}

    def pinned(c):
        return baseline_cells[c["baseline_result_id"]]

    def newest_of(c):
        return newest[(c["task"], c["batch_size"], c["temperature"])]

    spec = protocol.spec
    assert len(drafter_cells) == len(seeded["drafters"]) * len(spec.task_names) * len(
        spec.batch_sizes) * len(spec.temperatures) * len(spec.ks)
    for c in drafter_cells:
        assert pinned(c)["run_id"] == seeded["first_baseline"].pk
        assert newest_of(c)["output_throughput"] != pytest.approx(
            pinned(c)["output_throughput"], rel=1e-3)
    stored = {(r.run.drafter.slug, r.task, r.batch_size, float(r.temperature), r.k): r.speedup
              for r in Result.objects.filter(run__protocol=protocol, k__gt=0)
              .select_related("run__drafter")}
    for c in drafter_cells:
        # the stored figure is the cell's throughput over its pinned cell's, not the newest's
        assert stored[cell_key(c)] == pytest.approx(
            c["output_throughput"] / pinned(c)["output_throughput"], rel=1e-9)
        assert stored[cell_key(c)] != pytest.approx(
            c["output_throughput"] / newest_of(c)["output_throughput"], rel=1e-3)
    return {"cells": stored,
            "pooled": pooled_over_tasks(drafter_cells, pinned),
            "pooled_newest": pooled_over_tasks(drafter_cells, newest_of)}


def assert_serves(served, want, surface):
    assert set(served) == set(want), f"{surface}: other cells than the API's"
    wrong = {key: (served[key], want[key]) for key in want
             if served[key] is None or served[key] != pytest.approx(want[key], rel=1e-9)}
    assert not wrong, f"{surface} serves (served, expected) {wrong}"


def assert_pooled(served, expected, surface):
    assert_serves(served, expected["pooled"], surface)
    newest = expected["pooled_newest"]
    assert all(served[key] != pytest.approx(newest[key], rel=1e-3) for key in newest), \
        f"{surface}: the figures against the newest baseline are not told apart"


# ---- the tests -----------------------------------------------------------------------

def test_the_results_api_csv_and_json_export_serve_the_stored_cell_speedups(
        client, seeded, expected):
    protocol = seeded["protocol"]
    assert_serves(api_speedups(client, protocol), expected["cells"], "API results")
    assert_serves(export_speedups(client, protocol, "csv"), expected["cells"], "CSV export")
    assert_serves(export_speedups(client, protocol, "json"), expected["cells"], "JSON export")


def test_the_leaderboard_at_one_task_serves_the_stored_cell_speedups(client, seeded, expected):
    assert_serves(leaderboard_cell_speedups(client, seeded["protocol"]), expected["cells"],
                  "leaderboard (one task)")


def test_the_drafter_page_serves_the_stored_cell_speedups(client, seeded, expected):
    served = {}
    for d in seeded["drafters"]:
        served.update(drafter_page_cell_speedups(client, d.slug))
    assert_serves(served, expected["cells"], "drafter page cells")


def test_the_leaderboard_over_all_tasks_serves_the_pooled_speedups(client, seeded, expected):
    assert_pooled(leaderboard_pooled_speedups(client, seeded["protocol"]), expected,
                  "leaderboard (all tasks)")


def test_when_does_it_pay_page_and_api_serve_the_pooled_speedups(client, seeded, expected):
    protocol = seeded["protocol"]
    assert_pooled(pays_page_speedups(client, protocol), expected, '"When does it pay?" page')
    assert_pooled(pays_api_speedups(client, protocol), expected, "analysis API")


def test_the_compare_page_serves_the_pooled_speedups(client, seeded, expected):
    slugs = [d.slug for d in seeded["drafters"]]
    assert_pooled(compare_speedups(client, seeded["protocol"], slugs), expected,
                  "compare page")


def test_the_drafter_page_chart_and_when_does_it_pay_serve_the_pooled_speedups(
        client, seeded, expected):
    chart, pays = {}, {}
    for d in seeded["drafters"]:
        chart.update(drafter_chart_speedups(client, seeded["protocol"], d.slug))
        pays.update(drafter_pays_speedups(client, d.slug))
    assert_pooled(chart, expected, "drafter page speedup chart")
    assert_pooled(pays, expected, 'drafter page "When does it pay?"')


# ---- plausible rank ranges (issue #33): the same on the page, in the API and the CSV -------

def widen_intervals(protocol):
    """Give every drafter cell a speedup interval around its stored speedup: narrow at
    batch size 1 (the two drafters apart), wide above (they overlap), so both kinds of
    range are served."""
    for r in Result.objects.filter(run__protocol=protocol, k__gt=0):
        rel = 0.01 if r.batch_size == 1 else 0.6
        r.speedup_low, r.speedup_high = r.speedup * (1 - rel), r.speedup * (1 + rel)
        r.save(update_fields=["speedup_low", "speedup_high"])


def ranges_by_definition(rows):
    """{drafter: (best, worst)} of API rows, from their speedup intervals, pair by pair."""
    ranked = [r for r in rows if r["speedup"] is not None and not r["measuring"]]
    return {r["drafter"]: (1 + sum(o["speedup_low"] > r["speedup_high"] for o in ranked),
                           sum(o["speedup_high"] >= r["speedup_low"] for o in ranked))
            for r in ranked}


def test_the_rank_ranges_are_the_same_on_the_page_in_the_api_and_the_csv(client, seeded):
    from .test_rank_ranges import page_cells, shown_range

    protocol = seeded["protocol"]
    widen_intervals(protocol)
    spec, kinds = protocol.spec, set()
    url = reverse("api:protocol_leaderboard", args=[protocol.slug, protocol.version])
    for task in (None, *spec.task_names):
        for b in spec.batch_sizes:
            for k in spec.ks:
                params = {"batch_size": b, "temperature": f"{spec.temperatures[0]:g}", "k": k,
                          **({"task": task} if task else {})}
                page = client.get(reverse("home"), {"protocol": protocol_ref(protocol),
                                                    **params})
                context = {r["drafter"]["slug"]: (r["rank_low"], r["rank_high"])
                           for r in page.context["board"]["rows"]}
                names = {r["drafter"]["name"]: r["drafter"]["slug"]
                         for r in page.context["board"]["rows"]}
                html = {names[n]: c[1] for n, c in page_cells(page.content.decode()).items()}
                api = client.get(url, params).json()["rows"]
                served = {r["drafter"]: (r["rank_low"], r["rank_high"]) for r in api}
                text = client.get(url, {**params, "format": "csv"}).content.decode()
                from_csv = {r["drafter"]: (int(r["rank_low"]), int(r["rank_high"]))
                            for r in csv.DictReader(io.StringIO(text))}
                assert len(served) == len(seeded["drafters"])
                assert served == context == from_csv == ranges_by_definition(api), params
                assert html == {s: shown_range(*rr) for s, rr in served.items()}, params
                kinds |= {lo == hi for lo, hi in served.values()}
    assert kinds == {True, False}  # both single ranks and ranges were compared
