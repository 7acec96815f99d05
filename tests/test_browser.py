"""Headless Chromium against a live server: sign up, submit an n-gram configuration (its
submission page follows the intake check), see
the run in the queue with live progress, then (a worker's results simulated with test data
from tests/factories.py) the leaderboard and the drafter page with charts that hold data."""
import os
import shutil

import pytest

from leaderboard.models import Drafter, Run

from . import factories as f
from .conftest import purge_queue

QUEUE = "browser-test"

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def fresh_cache():
    from django.core.cache import cache

    cache.clear()  # the page cache is on here, as in production
    yield
    cache.clear()


@pytest.fixture
def broker_queue():
    from leaderboard.celery import ensure_broker_folders

    ensure_broker_folders()
    purge_queue(QUEUE)
    yield QUEUE
    purge_queue(QUEUE)  # leave no message behind


CHARTS_HOLD_DATA = """() => {
  const plots = Array.from(document.querySelectorAll('.js-plotly-plot'));
  if (plots.length === 0) return null;
  return plots.map(p => ({
    id: p.id,
    traces: p.data.length,
    points: p.data.reduce((n, t) => n + (t.y || []).filter(v => typeof v === 'number').length, 0),
  }));
}"""


def test_sign_up_submit_follow_the_queue_and_see_the_charts(
        live_server, browser_page, broker_queue, settings, tmp_path, artifacts_dir):
    target = f.make_target(slug="browser-target", name="Browser test target")
    protocol = f.make_protocol(target, slug="browser", hardware=QUEUE,
                               tasks=("chat", "code"), batch_sizes=(1, 2, 4), ks=(2, 4))
    seeded = f.seed_board(protocol, 2)  # a measured baseline and two other entries
    page, url = browser_page, live_server.url

    # sign up
    page.goto(f"{url}/accounts/signup/")
    page.fill("#id_username", "grace")
    page.fill("#id_password1", "a-long-pass-9!")
    page.fill("#id_password2", "a-long-pass-9!")
    page.click("#signup-form button[type=submit]")
    page.wait_for_url(f"{url}/")
    assert "grace" in page.inner_text("nav")

    # submit an n-gram configuration
    page.goto(f"{url}/submit/")
    page.select_option("#id_target", str(target.pk))
    page.select_option("#id_protocol", str(protocol.pk))
    page.select_option("#id_method", "ngram")
    page.fill("#id_name", "Browser n-gram 2-4")
    page.fill("#id_prompt_lookup_min", "2")
    page.fill("#id_prompt_lookup_max", "4")
    page.click("#submit-form button[type=submit]")
    # answered at once: the submission's page, checking, follows the intake worker
    page.wait_for_url("**/submissions/*/")
    assert page.inner_text("#submission-state") == "checking"
    assert not Drafter.objects.filter(name="Browser n-gram 2-4").exists()
    f.check_submissions()   # the intake task's body (tests/test_intake.py: a real worker)
    page.wait_for_selector("#accepted", timeout=15000)   # the page reloads itself
    page.screenshot(path=str(artifacts_dir / "submission.png"), full_page=True)
    drafter = Drafter.objects.get(name="Browser n-gram 2-4")
    run = Run.objects.get(drafter=drafter)
    page.click("#accepted a:has-text('queue')")
    page.wait_for_url("**/queue/**")
    assert drafter.owner.username == "grace" and run.hardware == QUEUE
    row = page.locator(f"#run-{run.pk}")
    assert "queued" in row.inner_text() and "Browser n-gram 2-4" in row.inner_text()
    assert row.locator("[data-field=position]").inner_text() == "1"
    assert row.locator("button", has_text="Cancel").count() == 1  # the owner may cancel

    # a worker takes it: the progress bar moves without a reload
    Run.objects.filter(pk=run.pk).update(state=Run.RUNNING, cells_done=3, eta_seconds=75)
    page.wait_for_function(
        f"document.querySelector('#run-{run.pk} [data-field=progress]').textContent"
        f".includes('3/{run.cells_total} cells')", timeout=10000)
    assert "ETA 1m 15s" in row.inner_text()
    width = page.eval_on_selector(f"#run-{run.pk} .bar span", "e => parseFloat(e.style.width)")
    assert width == pytest.approx(3 / run.cells_total * 100, abs=0.1)
    page.screenshot(path=str(artifacts_dir / "queue.png"), full_page=True)

    # ... and finishes (its cells are test data computed by worker.metrics)
    f.add_drafter_results(run, 0.7, seeded["baseline_results"])
    Run.objects.filter(pk=run.pk).update(state=Run.SUCCEEDED, cells_done=run.cells_total)
    page.wait_for_function(
        f"document.querySelector('#run-{run.pk} [data-field=state]').textContent === 'succeeded'",
        timeout=10000)

    # the leaderboard lists it with the baseline row
    page.goto(f"{url}/?protocol={protocol.slug}@{protocol.version}")
    board = page.inner_text("#leaderboard")
    assert "Browser n-gram 2-4" in board and "Baseline" in board
    page.screenshot(path=str(artifacts_dir / "submitted-leaderboard.png"), full_page=True)

    # the drafter page: every chart holds data
    page.click("text=Browser n-gram 2-4")
    page.wait_for_url(f"**/drafters/{drafter.slug}/")
    # speedup, acceptance per position, acceptance length, throughput/TPOT, per-user speed,
    # claimed against remeasured
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length === 6")
    charts = page.evaluate(CHARTS_HOLD_DATA)
    assert charts and len(charts) == 6
    for chart in charts:
        assert chart["traces"] > 0 and chart["points"] > 0, chart
    assert page.evaluate("document.querySelector('.js-plotly-plot').data.length > 0")
    assert page.locator("table.cells tbody tr").count() == 2 * 3 * 2
    page.screenshot(path=str(artifacts_dir / "drafter-page.png"), full_page=True)
    assert (artifacts_dir / "drafter-page.png").stat().st_size > 10000

    # compare overlays it with another entry
    page.goto(f"{url}/compare/?protocol={protocol.slug}@1&d={drafter.slug}"
              f"&d={seeded['drafters'][0].slug}")
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length === 4")
    names = page.evaluate(
        "Array.from(document.querySelector('#chart-speedup').data).map(t => t.name)")
    assert len(names) == 2 and any("Browser n-gram" in n for n in names)


def test_a_running_runs_cell_shows_on_the_leaderboard_marked_measuring(
        live_server, browser_page, settings, tmp_path, artifacts_dir):
    settings.SPECBOARD_LANDING_REFRESH_S = 0   # the page as each cell lands, not per interval
    target = f.make_target(slug="measuring-target", name="Measuring test target")
    protocol = f.make_protocol(target, slug="measuring-browser", hardware=QUEUE,
                               tasks=("chat", "code"), batch_sizes=(1, 4), ks=(2,),
                               baseline="paired", repetitions=3)
    drafter = f.make_drafter(target, "Measuring n-gram")
    run = f.make_run(protocol, drafter, state=Run.RUNNING, cells_done=0)
    page, url = browser_page, live_server.url

    # nothing measured yet: the board says what is measuring, with the queue's live progress
    page.goto(f"{url}/?protocol={protocol.slug}@{protocol.version}")
    panel = page.locator("#measuring-now")
    assert "Measuring n-gram" in panel.inner_text() and "baseline, k=2" in panel.inner_text()
    Run.objects.filter(pk=run.pk).update(cells_done=1, eta_seconds=125)
    page.wait_for_function(
        f"document.querySelector('#run-{run.pk} [data-field=progress]').textContent"
        f".includes('1/{run.cells_total} cells')", timeout=10000)
    assert "ETA 2m 05s" in panel.inner_text()

    # its first comparison lands (test data computed by worker.metrics): one row, marked
    base = f.result_from_counts(run, "chat", 4, 0.0, 0, f.baseline_counts(0, 4, 0.0))
    base.save()
    f.result_from_counts(run, "chat", 4, 0.0, 2, f.drafter_counts(0.7, 0, 4, 0.0, 2),
                         baseline=base).save()
    Run.objects.filter(pk=run.pk).update(cells_done=2)
    page.goto(f"{url}/?protocol={protocol.slug}@{protocol.version}")
    row = page.locator("#leaderboard tr.drafter-row.measuring")
    assert row.count() == 1
    text = row.inner_text()
    assert "Measuring n-gram" in text and f"measuring: 2 of {run.cells_total} cells" in text
    assert "×" in text and row.locator("td.rank").inner_text().strip() == "–"
    assert page.locator("#measuring-now").count() == 0
    page.screenshot(path=str(artifacts_dir / "leaderboard-measuring.png"), full_page=True)
    row.locator("a.badge.measuring").click()
    page.wait_for_url(f"**/runs/{run.pk}/")


def test_the_readme_screenshot_of_the_leaderboard(live_server, browser_page, screenshots_dir,
                                                  settings, tmp_path):
    """The README's leaderboard: a protocol like the demo's with a drafter of each method,
    their rows written by the factories (figures by worker.metrics) and one run's cells
    landed through the run service as a worker writes them."""
    from leaderboard.services import runs

    target = f.make_target(slug="smollm2-135m-instruct", name="SmolLM2-135M-Instruct")
    protocol = f.make_protocol(target, slug="demo-cpu", hardware="cpu",
                               tasks=("chat", "code"), batch_sizes=(1, 2, 4, 8),
                               ks=(2, 4))
    baseline = f.make_run(protocol)
    base_results = f.add_baseline_results(baseline)
    entries = [("n-gram 2-4", "ngram", 0.55), ("EAGLE head", "eagle", 0.8),
               ("Medusa heads", "medusa", 0.62), ("2-layer draft model", "draft_model", 0.7)]
    for name, method, quality in entries:
        drafter = f.make_drafter(target, name, method=method, params={} if method != "ngram"
                                 else {"prompt_lookup_min": 2, "prompt_lookup_max": 4})
        f.add_drafter_results(f.make_run(protocol, drafter), quality, base_results)
    landed = f.make_drafter(target, "n-gram 1-3",
                            params={"prompt_lookup_min": 1, "prompt_lookup_max": 3})
    run = f.make_run(protocol, landed, state=Run.RUNNING)
    for cell in protocol.spec.run_cells("ngram"):
        runs.record_cell(run, f.landing_cell(run, cell, quality=0.45))
    runs.update_progress(run, len(protocol.spec.run_cells("ngram")), 0.0)
    Run.objects.filter(pk=run.pk).update(state=Run.SUCCEEDED)

    page = browser_page
    page.set_viewport_size({"width": 1600, "height": 880})
    page.goto(f"{live_server.url}/?protocol={protocol.slug}@{protocol.version}&batch_size=4&k=4")
    board = page.inner_text("#leaderboard")
    for name, *_ in entries:
        assert name in board
    assert "n-gram 1-3" in board and "Baseline" in board
    assert "×" in board  # speedups with their intervals
    page.screenshot(path=str(screenshots_dir / "leaderboard.png"))
    assert (screenshots_dir / "leaderboard.png").stat().st_size > 20_000


def test_the_recipe_page_draws_its_learning_curves(live_server, browser_page):
    """Two data sizes of one recipe, measured (rows by tests/factories.py): the learning-curve
    charts draw one line of two points per task, and the table sets the training top-1
    beside the measured position-1 acceptance."""
    target = f.make_target(slug="recipe-target", name="Recipe test target")
    protocol = f.make_protocol(target, slug="recipes-browser", tasks=("chat", "code"),
                               batch_sizes=(1, 8), ks=(2, 4))
    base = f.add_baseline_results(f.make_run(protocol))
    for n, quality, top1 in ((128, 0.35, 0.61), (1024, 0.5, 0.74)):
        data = f.make_training_dataset(target, f"chat-{n}", n, 150 * n, 2.0 * n)
        drafter = f.make_trained_drafter(target, f"eagle {n}", "eagle", "eagle", data,
                                         seconds=0.6 * n, details={"steps": 600, "final_top1": top1})
        f.add_drafter_results(f.make_run(protocol, drafter), quality, base)

    page = browser_page
    page.goto(f"{live_server.url}/recipes/?protocol={protocol.slug}@{protocol.version}")
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length === 3")
    charts = {c["id"]: c for c in page.evaluate(CHARTS_HOLD_DATA)}
    for task_chart in ("chart-al_task_0", "chart-al_task_1"):
        assert charts[task_chart]["traces"] == 1 and charts[task_chart]["points"] == 2, charts
    assert charts["chart-al_time"]["points"] == 2
    table = page.inner_text("#recipe-table")
    assert "eagle 1024" in table and "0.74" in table and "0.61" in table
    assert "Position-1 acceptance" in page.inner_text("#recipe-table thead")
    page.click("text=eagle 1024")
    page.wait_for_url("**/drafters/**")


def test_every_page_keeps_its_content_security_policy_and_still_works(live_server,
                                                                      browser_page):
    """#32 item 8: a Content-Security-Policy with no inline script; Chromium reports every
    violation on the console, and there is none on any page, while the charts draw, the
    filters submit themselves and the API docs load."""
    protocol = f.make_protocol(f.make_target(slug="csp-target"), slug="csp", tasks=("chat",),
                               batch_sizes=(1, 4), ks=(2, 4))
    seeded = f.seed_board(protocol, 2)
    drafter = seeded["drafters"][0]
    page = browser_page.context.browser.new_page(viewport={"width": 1280, "height": 900})
    url = live_server.url
    problems = []
    page.on("console", lambda m: problems.append(m.text)
            if "Content Security Policy" in m.text else None)
    page.on("pageerror", lambda e: problems.append(str(e)))   # a script that broke
    ref = f"{protocol.slug}@{protocol.version}"
    for path in ("/", f"/drafters/{drafter.slug}/", "/queue/", f"/compare/?protocol={ref}",
                 f"/protocols/{protocol.slug}/v{protocol.version}/",
                 f"/protocols/{protocol.slug}/v{protocol.version}/pays/", "/recipes/",
                 "/accounts/login/", "/admin/login/", "/demo/", "/api/docs"):
        response = page.goto(url + path)
        policy = response.headers.get("content-security-policy", "")
        assert "script-src 'self'" in policy and "'unsafe-inline'" not in policy.split(
            "script-src")[1].split(";")[0], (path, policy)
        page.wait_for_load_state("networkidle")
    page.goto(f"{url}/drafters/{drafter.slug}/")
    page.locator(".js-plotly-plot").first.wait_for()   # the charts drew (no eval needed)
    page.goto(f"{url}/?protocol={ref}")
    with page.expect_navigation():
        page.select_option("select[name=batch_size]", "4")
    assert "batch_size=4" in page.url
    assert problems == [], problems
