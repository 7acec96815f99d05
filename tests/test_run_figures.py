"""The leaderboard's per-run figures (selectors.run_figures) kept in the cache give exactly
what a computation from scratch gives, on the real database, for succeeded runs and for a
run whose cells are still landing through the run service; a landing cell recomputes only
its own run; and while one request renders a page's new state, others get its previous
rendering."""
import pytest
from django.core.cache import cache
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from leaderboard import views
from leaderboard.models import Run
from leaderboard.selectors import board, run_figures
from leaderboard.services import runs

from . import factories as f

pytestmark = pytest.mark.django_db

FILTERS = [dict(), dict(task="code"), dict(batch_size=1, temperature=0.0),
           dict(batch_size=4, temperature=1.0, k=4), dict(task="chat", batch_size=4)]


@pytest.fixture
def site(settings, tmp_path):
    settings.SPECBOARD_PAGE_CACHE_SECONDS = 300
    settings.SPECBOARD_PAGE_CACHE_INCREMENTAL = True
    cache.clear()
    target = f.make_target()
    protocol = f.make_protocol(target, slug="figures", tasks=("chat", "code"),
                               batch_sizes=(1, 4), temperatures=(0.0, 1.0), ks=(2, 4))
    seeded = f.seed_board(protocol, 3)
    landing = f.make_run(protocol, f.make_drafter(target, "still landing"), state=Run.RUNNING)
    cells = [c for c in protocol.spec.run_cells("ngram") if c.k]
    yield {"protocol": protocol, "seeded": seeded, "landing": landing, "cells": cells}
    cache.clear()


def land(run, cell):
    """A cell as a worker writes it: the row, then the run's progress."""
    runs.record_cell(run, f.landing_cell(run, cell))
    runs.update_progress(run, 1, 0.0)


def run_ids(site):
    return [d.runs.get().pk for d in site["seeded"]["drafters"]] + [site["landing"].pk]


def from_scratch(ids, k=None, **filters):
    computed = run_figures.compute_groups(ids, **filters)
    if k is not None:
        computed = {i: [g for g in piece if g["k"] == k] for i, piece in computed.items()}
    return {i: piece for i, piece in computed.items() if piece}


def test_kept_figures_equal_a_computation_from_scratch_while_cells_land(site):
    ids = run_ids(site)
    landing = site["landing"]
    for cell in site["cells"][:5]:
        land(landing, cell)
    for filters in FILTERS:
        expected = from_scratch(ids, **filters)
        assert run_figures.groups(ids, **filters) == expected  # computed and kept
        assert run_figures.groups(ids, **filters) == expected  # read back
    assert landing.pk in run_figures.groups(ids)
    # Another cell lands: the kept pieces follow it at once.
    before = run_figures.groups(ids)
    land(landing, site["cells"][5])
    after = run_figures.groups(ids)
    assert after == from_scratch(ids) and after != before
    assert sum(g["cells"] for g in after[landing.pk]) == 6
    assert {i: after[i] for i in ids if i != landing.pk} == {
        i: before[i] for i in ids if i != landing.pk}


def test_a_landing_cell_recomputes_only_its_own_run(site):
    ids = run_ids(site)
    landing = site["landing"]
    land(landing, site["cells"][0])
    run_figures.groups(ids)
    with CaptureQueriesContext(connection) as kept:
        run_figures.groups(ids)
    # the runs' states (the runs, their baselines, their protocols' calibrations); nothing
    # read from the results
    assert len(kept) == 3
    land(landing, site["cells"][1])
    with CaptureQueriesContext(connection) as after:
        run_figures.groups(ids)
    cell_queries = [q["sql"] for q in after.captured_queries
                    if "leaderboard_result" in q["sql"] and "k\" > 0" in q["sql"]]
    assert len(cell_queries) == 1
    assert f"IN ({landing.pk})" in cell_queries[0]  # this run's cells, no other run's


def test_a_calibration_changes_the_runs_states(site):
    """A calibration re-divides the protocol's cells without changing any run: the kept
    figures must not outlive it."""
    from leaderboard.models import ProtocolCalibration

    ids = run_ids(site)
    before = run_figures.run_states(ids)
    ProtocolCalibration.objects.create(protocol=site["protocol"], between_run_variance=1e-4,
                                       cells=1, degrees_of_freedom=1)
    after = run_figures.run_states(ids)
    assert set(before) == set(after) and all(before[i] != after[i] for i in ids)


def test_a_shared_baseline_succeeding_refreshes_the_kept_speedups(site):
    """Cells measured before their shared baseline have no speedup; when the baseline
    succeeds and fills them in, the kept figures follow."""
    protocol = site["protocol"]
    Run.objects.filter(drafter__isnull=True).update(state=Run.RUNNING, finished_at=None)
    landing = site["landing"]
    land(landing, site["cells"][0])
    ids = [landing.pk]
    assert run_figures.groups(ids)[landing.pk][0]["speedup"] is None
    baseline = Run.objects.get(protocol=protocol, drafter__isnull=True)
    assert runs.finish(baseline, Run.SUCCEEDED)  # fills in the waiting speedups
    kept = run_figures.groups(ids)
    assert kept == from_scratch(ids) and kept[landing.pk][0]["speedup"] is not None


def test_the_leaderboard_is_the_same_with_kept_and_recomputed_figures(site, settings):
    protocol = site["protocol"]
    for cell in site["cells"][:3]:
        land(site["landing"], cell)
    Run.objects.filter(pk=site["landing"].pk).update(state=Run.SUCCEEDED)  # shown from now
    for filters in FILTERS:
        filters = {k: v for k, v in filters.items() if k != "batch_size" or v}
        settings.SPECBOARD_PAGE_CACHE_INCREMENTAL = True
        board.leaderboard(protocol, **filters)
        kept = board.leaderboard(protocol, **filters)
        settings.SPECBOARD_PAGE_CACHE_INCREMENTAL = False
        recomputed = board.leaderboard(protocol, **filters)
        assert kept == recomputed and kept["rows"]
    assert any(r["drafter"]["name"] == "still landing" for r in kept["rows"])


def test_while_a_page_renders_its_new_state_others_get_the_previous_rendering(settings):
    settings.SPECBOARD_PAGE_CACHE_SECONDS = 300
    cache.clear()
    page = ("test page", 1)
    first = views.cached_fragment(page, lambda: ("state 1", None), lambda: {"html": "one"})
    assert first["html"] == "one"

    def render_state_2():
        # a request that comes while this one renders state 2
        meanwhile.append(views.cached_fragment(page, lambda: ("state 2", None),
                                               lambda: {"html": "rendered twice"}))
        return {"html": "two"}

    meanwhile = []
    assert views.cached_fragment(page, lambda: ("state 2", None),
                                 render_state_2)["html"] == "two"
    assert meanwhile == [{"html": "one"}]
    assert views.cached_fragment(page, lambda: ("state 2", None),
                                 lambda: {"html": "x"})["html"] == "two"
    cache.clear()


def test_the_leaderboard_is_rendered_again_when_a_cell_lands_in_a_running_run(client, site,
                                                                             settings):
    """Pages show running runs' cells as they land, so the page key follows each cell."""
    settings.SPECBOARD_LANDING_REFRESH_S = 0
    protocol = site["protocol"]
    url = reverse("home") + f"?protocol={protocol.slug}@1"
    assert client.get(url).context["board"] is not None  # rendered
    assert client.get(url).context["board"] is None  # kept
    land(site["landing"], site["cells"][0])
    assert client.get(url).context["board"] is not None  # rendered again
    assert client.get(url).context["board"] is None


def test_while_cells_land_a_page_is_rendered_again_at_most_every_refresh_interval(
        client, site, settings):
    """Landing cells show within SPECBOARD_LANDING_REFRESH_S; a run that succeeds (or a
    drafter withdrawn) shows at once."""
    settings.SPECBOARD_LANDING_REFRESH_S = 60
    protocol = site["protocol"]
    url = reverse("home") + f"?protocol={protocol.slug}@1"
    assert client.get(url).context["board"] is not None
    land(site["landing"], site["cells"][0])
    assert client.get(url).context["board"] is None  # the rendering of a moment ago
    settings.SPECBOARD_LANDING_REFRESH_S = 0
    assert client.get(url).context["board"] is not None
    settings.SPECBOARD_LANDING_REFRESH_S = 60
    Run.objects.filter(pk=site["landing"].pk).update(state=Run.SUCCEEDED)
    rows = client.get(url).context["board"]["rows"]  # rendered at once
    assert any(r["drafter"]["name"] == "still landing" for r in rows)
