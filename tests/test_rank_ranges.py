"""Plausible rank ranges on the leaderboard (issue #33, item 5): the pure rule
(worker.analysis.speedups.rank_ranges) on chosen rows and against its definition written
out pair by pair, then the same ranges on the page, in the API's JSON and in its CSV, on a
database seeded with the factories.

Definition: over the rows the leaderboard ranks (finished, with a speedup), a row with
speedup interval [lo, hi] has best rank 1 + #{rows with low > hi} and worst rank
#{rows with high >= lo}; a row without an interval is the point [speedup, speedup]."""
import csv
import io
import random
from html.parser import HTMLParser

import pytest
from django.urls import reverse

from leaderboard.models import Result, Run
from worker.analysis.speedups import mark_ties, rank_ranges

from . import factories as f
from .test_api import fuzz, wsgi_requests_keep_the_test_connection  # noqa: F401 (fixture)


def row(speedup, lo=None, hi=None, measuring=False, name="x"):
    return {"speedup": speedup, "speedup_low": lo, "speedup_high": hi, "name": name,
            "run": {"measuring": measuring}}


def ranges(rows):
    return [(r["rank_low"], r["rank_high"]) for r in rows]


def by_definition(rows):
    """The ranges written out pair by pair, O(n^2), for comparison."""
    ranked = [r for r in rows if r["speedup"] is not None and not r["run"]["measuring"]]

    def bounds(r):
        lo = r["speedup"] if r["speedup_low"] is None else r["speedup_low"]
        hi = r["speedup"] if r["speedup_high"] is None else r["speedup_high"]
        return lo, hi

    out = []
    for r in rows:
        if r not in ranked:
            out.append((None, None))
            continue
        lo, hi = bounds(r)
        above = sum(1 for o in ranked if bounds(o)[0] > hi)
        not_below = sum(1 for o in ranked if bounds(o)[1] >= lo)
        out.append((1 + above, not_below))
    return out


# ---- the pure rule ---------------------------------------------------------------------

def test_disjoint_intervals_give_single_ranks():
    rows = [row(1.7, 1.6, 1.8), row(1.3, 1.2, 1.4), row(1.05, 1.0, 1.1)]
    mark_ties(rows)
    rank_ranges(rows)
    assert ranges(rows) == [(1, 1), (2, 2), (3, 3)]
    assert [r["rank"] for r in rows] == [1, 2, 3]


def test_an_overlap_chain_widens_each_range_only_by_its_own_overlaps():
    # A overlaps B, B overlaps C, A and C do not overlap; D is apart.
    rows = [row(2.0, 1.9, 2.1, name="A"), row(1.8, 1.7, 1.95, name="B"),
            row(1.6, 1.5, 1.75, name="C"), row(1.1, 1.0, 1.2, name="D")]
    mark_ties(rows)
    rank_ranges(rows)
    assert ranges(rows) == [(1, 2), (1, 3), (2, 3), (4, 4)]
    # a rank is the first of its range: C cannot be first, so the chain through B does not
    # give it A's rank
    assert [(r["rank"], r["tied"]) for r in rows] == [(1, True), (1, True), (2, True),
                                                     (4, False)]
    for position, r in enumerate(rows, 1):
        assert r["rank_low"] <= position <= r["rank_high"]


def test_touching_intervals_overlap_as_in_ties():
    rows = [row(1.3, 1.2, 1.4), row(1.1, 1.0, 1.2)]
    mark_ties(rows)
    rank_ranges(rows)
    assert ranges(rows) == [(1, 2), (1, 2)]
    assert all(r["tied"] for r in rows)


def test_measuring_rows_and_rows_without_a_speedup_take_no_range_and_count_for_none():
    rows = [row(1.9, 1.0, 2.5, measuring=True), row(1.7, 1.6, 1.8), row(None),
            row(1.3, 1.2, 1.4)]
    mark_ties(rows)
    rank_ranges(rows)
    # the measuring row's wide interval would overlap both: it is not counted
    assert ranges(rows) == [(None, None), (1, 1), (None, None), (2, 2)]


def test_without_intervals_the_range_is_the_rank():
    rows = [row(2.0), row(1.5), row(1.2), row(1.2), row(0.9)]
    mark_ties(rows)
    rank_ranges(rows)
    assert ranges(rows) == [(1, 1), (2, 2), (3, 4), (3, 4), (5, 5)]
    assert [r["rank"] for r in rows] == [1, 2, 3, 3, 5]


def test_a_missing_bound_is_the_estimate():
    # the first row's interval is [1.25, 1.5], the last's [1.0, 1.26]: they overlap,
    # the middle one [1.28, 1.32] overlaps the first only
    rows = [row(1.5, 1.25, None), row(1.3, 1.28, 1.32), row(1.0, None, 1.26)]
    rank_ranges(rows)
    assert ranges(rows) == [(1, 3), (1, 2), (2, 3)]
    # a missing high bound is not "unbounded": nothing above 1.5 counts as overlapping
    rows = [row(1.6, 1.55, 1.7), row(1.5, 1.45, None)]
    rank_ranges(rows)
    assert ranges(rows) == [(1, 1), (2, 2)]


def test_random_rows_match_the_definition_and_do_not_depend_on_order():
    rng = random.Random(33)
    for _ in range(200):
        rows = []
        for i in range(rng.randint(0, 12)):
            s = rng.choice([None, round(rng.uniform(0.8, 2.0), 2)])
            lo = hi = None
            if s is not None and rng.random() < 0.8:
                lo, hi = s - round(rng.uniform(0, 0.3), 2), s + round(rng.uniform(0, 0.3), 2)
            rows.append(row(s, lo, hi, measuring=rng.random() < 0.15, name=str(i)))
        rank_ranges(rows)
        assert ranges(rows) == by_definition(rows)
        shuffled = rows[:]
        rng.shuffle(shuffled)
        before = {r["name"]: (r["rank_low"], r["rank_high"]) for r in rows}
        rank_ranges(shuffled)
        assert {r["name"]: (r["rank_low"], r["rank_high"]) for r in shuffled} == before
        # the position in speedup order lies in the range
        ranked = sorted((r for r in rows if r["rank_low"] is not None),
                        key=lambda r: -r["speedup"])
        for position, r in enumerate(ranked, 1):
            ties = [o for o in ranked if o["speedup"] == r["speedup"]]
            first = ranked.index(ties[0]) + 1
            assert r["rank_low"] <= first and first + len(ties) - 1 <= r["rank_high"]


# ---- through the site --------------------------------------------------------------------

class BoardTable(HTMLParser):
    """The drafter rows of the page's table: {drafter name: [cell texts]}."""

    def __init__(self):
        super().__init__()
        self.rows, self.cells, self.cell, self.in_row, self.in_cell = {}, None, None, 0, 0

    def handle_starttag(self, tag, attrs):
        cls = dict(attrs).get("class") or ""
        if tag == "tr" and "drafter-row" in cls.split():
            self.in_row, self.cells = 1, []
        elif tag == "td" and self.in_row:
            self.in_cell, self.cell = 1, ""

    def handle_endtag(self, tag):
        if tag == "td" and self.in_cell:
            self.cells.append(" ".join(self.cell.split()))
            self.in_cell = 0
        elif tag == "tr" and self.in_row:
            name = self.cells[2].split(" by ")[0].split(" measuring")[0]
            self.rows[name] = self.cells
            self.in_row = 0

    def handle_data(self, data):
        if self.in_cell:
            self.cell += data


def page_cells(html):
    table = BoardTable()
    table.feed(html)
    return table.rows


def shown_range(low, high):
    """What the page prints for a range."""
    if low is None:
        return "–"
    return str(low) if low == high else f"{low}–{high}"


def csv_rows(text):
    return list(csv.DictReader(io.StringIO(text)))


def optional_int(v):
    return int(v) if v not in ("", None) else None


# (low, speedup, high) of each drafter's every cell: at one task the row is that cell.
INTERVALS = {0: (1.62, 1.70, 1.78), 1: (1.55, 1.60, 1.66), 2: (1.48, 1.52, 1.56),
             3: (1.20, 1.25, 1.30)}


@pytest.fixture
def seeded(db):
    """Four drafters with chosen speedup intervals (0 overlaps 1, 1 overlaps 2, 0 and 2 do
    not, 3 is apart) and a fifth whose only run is still measuring, with a wide interval
    that overlaps every other."""
    protocol = f.make_protocol(f.make_target())
    board = f.seed_board(protocol, 4)
    for i, d in enumerate(board["drafters"]):
        lo, s, hi = INTERVALS[i]
        Result.objects.filter(run__drafter=d).update(speedup=s, speedup_low=lo,
                                                     speedup_high=hi)
    late = f.make_drafter(protocol.target, "late comer")
    run = f.make_run(protocol, late, state=Run.RUNNING, cells_done=3)
    f.add_drafter_results(run, 0.9, board["baseline_results"])
    Result.objects.filter(run=run).update(speedup=1.5, speedup_low=1.0, speedup_high=2.0)
    return {"protocol": protocol, "drafters": board["drafters"], "late": late}


EXPECTED = {0: (1, 2), 1: (1, 3), 2: (2, 3), 3: (4, 4)}


def page_and_api(client, protocol, **params):
    ref = f"{protocol.slug}@{protocol.version}"
    page = client.get(reverse("home"), {"protocol": ref, **params})
    assert page.status_code == 200
    url = reverse("api:protocol_leaderboard", args=[protocol.slug, protocol.version])
    api = client.get(url, params)
    assert api.status_code == 200, api.content
    csv_response = client.get(url, {**params, "format": "csv"})
    assert csv_response.status_code == 200
    assert csv_response["Content-Type"].startswith("text/csv")
    assert csv_response["Content-Disposition"].startswith(
        f'attachment; filename="specboard-leaderboard-{protocol.slug}-v{protocol.version}-')
    return page, api.json(), csv_rows(csv_response.content.decode())


def test_page_api_and_csv_show_the_rank_ranges(client, seeded, settings):
    settings.SPECBOARD_PAGE_CACHE_SECONDS = 0
    protocol, drafters = seeded["protocol"], seeded["drafters"]
    page, api, rows_csv = page_and_api(client, protocol, task="chat", k="2")
    want = {d.name: EXPECTED[i] for i, d in enumerate(drafters)}
    want[seeded["late"].name] = (None, None)

    context_rows = page.context["board"]["rows"]
    assert {r["drafter"]["name"]: (r["rank_low"], r["rank_high"])
            for r in context_rows} == want
    cells = page_cells(page.content.decode())
    assert {name: c[1] for name, c in cells.items()} == {
        name: shown_range(*rr) for name, rr in want.items()}
    assert "Plausible rank" in page.content.decode()

    assert api["filters"] == {"task": "chat", "batch_size": 1, "temperature": 0.0, "k": 2,
                              "method": None}
    assert {r["drafter_name"]: (r["rank_low"], r["rank_high"]) for r in api["rows"]} == want
    assert [r["drafter_name"] for r in api["rows"]] == [r["drafter"]["name"]
                                                        for r in context_rows]
    late = next(r for r in api["rows"] if r["drafter_name"] == seeded["late"].name)
    assert late["measuring"] and late["rank"] is None

    assert {r["drafter_name"]: (optional_int(r["rank_low"]), optional_int(r["rank_high"]))
            for r in rows_csv} == want
    assert list(rows_csv[0]) == list(api["rows"][0])  # the same columns, in order
    for j, c in zip(api["rows"], rows_csv):  # and the same values
        assert float(c["speedup"]) == j["speedup"]
        assert c["tied"] == str(j["tied"]) and optional_int(c["rank"]) == j["rank"]


def test_the_page_links_its_table_in_the_api(client, seeded, settings):
    settings.SPECBOARD_PAGE_CACHE_SECONDS = 0
    protocol = seeded["protocol"]
    page = client.get(reverse("home"), {"protocol": f"{protocol.slug}@{protocol.version}",
                                        "task": "chat", "k": "2"})
    board = page.context["board"]
    html = page.content.decode()
    for fmt in ("csv", "json"):
        url = board["export"][fmt]
        assert url.replace("&", "&amp;") in html
        response = client.get(url)
        assert response.status_code == 200
        if fmt == "csv":
            names = [r["drafter_name"] for r in csv_rows(response.content.decode())]
        else:
            names = [r["drafter_name"] for r in response.json()["rows"]]
        assert names == [r["drafter"]["name"] for r in board["rows"]]


def test_ranges_are_over_the_rows_the_table_ranks_together(client, seeded, settings):
    """Every batch size and k at once (the page's "all"): the ranges are over every row
    shown, as the ranks are; the API with the same filters serves the same."""
    settings.SPECBOARD_PAGE_CACHE_SECONDS = 0
    protocol = seeded["protocol"]
    page, api, rows_csv = page_and_api(client, protocol, task="chat", batch_size="all")
    context_rows = page.context["board"]["rows"]
    ranked = [r for r in context_rows if r["rank"] is not None]
    spec = protocol.spec
    assert len(ranked) == 4 * len(spec.batch_sizes) * len(spec.ks)
    # every drafter's cells share its chosen interval: 4 groups of equal rows
    per = len(spec.batch_sizes) * len(spec.ks)
    for i, d in enumerate(seeded["drafters"]):
        mine = {(r["rank_low"], r["rank_high"]) for r in ranked
                if r["drafter"]["name"] == d.name}
        low, high = EXPECTED[i]
        assert mine == {((low - 1) * per + 1, high * per)}
    key = lambda r: (r["drafter_name"], r["batch_size"], r["k"])  # noqa: E731
    served = {key(r): (r["rank_low"], r["rank_high"]) for r in api["rows"]}
    assert served == {(r["drafter"]["name"], r["batch_size"], r["k"]):
                      (r["rank_low"], r["rank_high"]) for r in context_rows}
    assert {key({**r, "batch_size": int(r["batch_size"]), "k": int(r["k"])}):
            (optional_int(r["rank_low"]), optional_int(r["rank_high"]))
            for r in rows_csv} == served


def test_the_api_defaults_are_the_pages(client, seeded, settings):
    settings.SPECBOARD_PAGE_CACHE_SECONDS = 0
    protocol = seeded["protocol"]
    page, api, _ = page_and_api(client, protocol)
    assert [(r["drafter"]["name"], r["batch_size"], r["k"], r["rank_low"], r["rank_high"])
            for r in page.context["board"]["rows"]] == [
        (r["drafter_name"], r["batch_size"], r["k"], r["rank_low"], r["rank_high"])
        for r in api["rows"]]
    assert api["filters"]["batch_size"] == 1 and api["filters"]["temperature"] == 0.0


@pytest.mark.parametrize("params, field", [({"temperature": "0.7"}, "temperature"),
                                           ({"batch_size": "3"}, "batch_size"),
                                           ({"task": "nope"}, "task"), ({"k": "3"}, "k")])
def test_values_the_protocol_does_not_measure_are_a_422(client, seeded, params, field):
    protocol = seeded["protocol"]
    url = reverse("api:protocol_leaderboard", args=[protocol.slug, protocol.version])
    response = client.get(url, params)
    assert response.status_code == 422
    assert response.json()["detail"][0]["field"] == field


def test_an_unknown_protocol_is_a_404(client, db):
    response = client.get(reverse("api:protocol_leaderboard", args=["nope", 1]))
    assert response.status_code == 404


def test_generated_requests_against_an_existing_protocol_answer_as_documented(
        seeded, wsgi_requests_keep_the_test_connection):
    """Schemathesis requests to the endpoint with the seeded protocol in the path (the
    suite-wide fuzz in test_api.py draws random slugs, which hit no protocol): no 5xx,
    every valid request's answer matches its documented status, content type and schema,
    and some are real tables."""
    import schemathesis
    from schemathesis.specs.openapi import checks

    from leaderboard.wsgi import application

    protocol = seeded["protocol"]
    schema = schemathesis.openapi.from_wsgi("/api/openapi.json", application)
    operation = next(r.ok() for r in schema.get_all_operations()
                     if r.ok().label == "GET /api/protocols/{slug}/{version}/leaderboard")

    def existing(case):
        case.path_parameters = {"slug": protocol.slug, "version": protocol.version}

    made, failures = fuzz(operation, schemathesis.GenerationMode.POSITIVE, None,
                          [checks.status_code_conformance, checks.content_type_conformance,
                           checks.response_schema_conformance], existing)
    assert failures == [], failures[:3]
    assert len(made) >= 10 and 200 in made
