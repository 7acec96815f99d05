"""Pages: leaderboard, drafter, compare, protocol, queue, accounts and permissions, on the
real database with test data whose figures worker.metrics computes (tests/factories.py)."""
import gzip
import json
import re
from io import StringIO

import pytest
from django.contrib.auth.models import User
from django.contrib.staticfiles import finders
from django.core.files.base import ContentFile
from django.core.management import call_command
from django.urls import reverse

from leaderboard.selectors import protocols
from leaderboard.models import ApiToken, Drafter, Result, Run
from worker import metrics

from . import factories as f

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def no_page_cache(settings):
    """Pages are rendered from the database on every request here (the cache has its own
    test below)."""
    settings.SPECBOARD_PAGE_CACHE_SECONDS = 0


@pytest.fixture
def board():
    target = f.make_target()
    protocol = f.make_protocol(target)
    return {"protocol": protocol, **f.seed_board(protocol, 3)}


def figures(html):
    """The plotly figures embedded in a page, by id."""
    return {m.group(1): json.loads(m.group(2)) for m in re.finditer(
        r'<script type="application/json" id="fig-([\w-]+)">(.*?)</script>', html, re.S)}


def expected_aggregate(run, baseline_run, **filters):
    """AL, rate, throughput and speedup over cells, from the summed counts."""
    def sums(qs):
        rows = list(qs)
        c = metrics.SpecCounts(sum(r.drafts for r in rows), sum(r.draft_tokens for r in rows),
                               sum(r.accepted_tokens for r in rows))
        thr = metrics.output_throughput(sum(r.generated_tokens for r in rows),
                                        sum(r.wall_seconds for r in rows))
        return c, thr
    k = filters.pop("k")
    c, thr = sums(Result.objects.filter(run=run, k=k, **filters))
    _, base_thr = sums(Result.objects.filter(run=baseline_run, **filters))
    return (metrics.acceptance_length(c), metrics.acceptance_rate(c), thr,
            metrics.speedup(thr, base_thr))


# ---- leaderboard --------------------------------------------------------------------

def test_leaderboard_aggregates_over_tasks_from_summed_counts(client, board):
    protocol, baseline = board["protocol"], board["baseline"]
    response = client.get(reverse("home"))
    assert response.status_code == 200
    rows = response.context["board"]["rows"]
    assert len(rows) == 3 * 2  # 3 drafters x 2 ks at the default batch size 1
    assert {r["batch_size"] for r in rows} == {1}
    for row in rows:
        run = Run.objects.get(pk=row["run_id"])
        al, rate, thr, speedup = expected_aggregate(run, baseline, k=row["k"], batch_size=1)
        assert row["task"] == "all"
        assert row["acceptance_length"] == pytest.approx(al)
        assert row["acceptance_rate"] == pytest.approx(rate)
        assert row["output_throughput"] == pytest.approx(thr)
        assert row["speedup"] == pytest.approx(speedup)
    # The aggregate is not the mean of the per-task figures.
    one = rows[0]
    per_task = Result.objects.filter(run_id=one["run_id"], k=one["k"], batch_size=1)
    mean_al = sum(r.acceptance_length for r in per_task) / per_task.count()
    assert one["acceptance_length"] != pytest.approx(mean_al, rel=1e-9)
    # Sorted by speedup, best first; the baseline row and the provenance are shown.
    speedups = [r["speedup"] for r in rows]
    assert speedups == sorted(speedups, reverse=True)
    html = response.content.decode()
    assert "Baseline" in html and f"{protocol.slug} v{protocol.version}" in html
    assert "0.0.test" in html and "test data (not measured)" in html


def test_leaderboard_one_task_matches_the_stored_cell_figures(client, board):
    response = client.get(reverse("home"), {"task": "code", "k": 2, "batch_size": 4})
    rows = response.context["board"]["rows"]
    assert len(rows) == 3 and all(r["k"] == 2 and r["batch_size"] == 4 for r in rows)
    for row in rows:
        cell = Result.objects.get(run_id=row["run_id"], task="code", k=2, batch_size=4)
        assert row["acceptance_length"] == pytest.approx(cell.acceptance_length)
        assert row["output_throughput"] == pytest.approx(cell.output_throughput)
        assert row["speedup"] == pytest.approx(cell.speedup)


def shown_batch_size(html: str) -> str:
    """The option selected in the page's batch size menu."""
    menu = re.search(r'<select name="batch_size".*?</select>', html, re.S).group(0)
    (value,) = re.findall(r'<option value="([^"]+)" selected>', menu)
    return value


def test_leaderboard_shows_the_smallest_measured_batch_size_unless_one_is_chosen(client, board):
    sizes = board["protocol"].spec.batch_sizes
    assert len(sizes) > 1
    for query, shown in [({}, min(sizes)), ({"batch_size": max(sizes)}, max(sizes))]:
        response = client.get(reverse("home"), query)
        assert response.context["board"]["filters"]["batch_size"] == shown
        assert {r["batch_size"] for r in response.context["board"]["rows"]} == {shown}
        assert shown_batch_size(response.content.decode()) == str(shown)


def test_leaderboard_sorts_filters_and_hides_withdrawn(client, board):
    response = client.get(reverse("home"), {"sort": "acceptance_length", "dir": "asc", "k": 4})
    als = [r["acceptance_length"] for r in response.context["board"]["rows"]]
    assert als == sorted(als) and len(als) == 3
    response = client.get(reverse("home"), {"method": "eagle"})
    assert response.context["board"]["rows"] == []
    assert response.context["board"]["baseline_rows"]
    response = client.get(reverse("home"), {"batch_size": "all", "k": 2})
    assert len(response.context["board"]["rows"]) == 3 * 2
    withdrawn = board["drafters"][0]
    Drafter.objects.filter(pk=withdrawn.pk).update(review_state="withdrawn")
    rows = client.get(reverse("home")).context["board"]["rows"]
    assert withdrawn.name not in {r["drafter"]["name"] for r in rows}


def test_leaderboard_links_the_raw_data(client, board, media):
    run = board["drafters"][0].runs.get()
    run.artifact.save("requests.jsonl.gz", ContentFile(gzip.compress(b'{"prompt_id": "a"}\n')))
    html = client.get(reverse("home")).content.decode()
    url = reverse("run_artifact", args=[run.pk])
    assert url in html
    response = client.get(url)
    assert response.status_code == 200
    assert gzip.decompress(b"".join(response.streaming_content)) == b'{"prompt_id": "a"}\n'


def test_leaderboard_defaults_to_the_newest_protocol_with_results(client, board):
    newer = f.make_protocol(board["protocol"].target, slug="newer-empty")
    assert protocols.get_protocol() == board["protocol"]  # newer has no results
    response = client.get(reverse("home"), {"protocol": f"{newer.slug}@1"})
    assert response.status_code == 200 and response.context["board"]["rows"] == []
    assert client.get(reverse("home"), {"protocol": "nope@1"}).status_code == 404


def test_cached_fragments_follow_the_data(client, board, settings, django_assert_max_num_queries):
    from django.core.cache import cache

    settings.SPECBOARD_PAGE_CACHE_SECONDS = 60
    cache.clear()
    first = client.get(reverse("home")).content
    with django_assert_max_num_queries(3):  # protocol, signature, protocol list
        assert client.get(reverse("home")).content == first
    # a new succeeded run shows at once
    newcomer = f.make_drafter(board["protocol"].target, "newcomer")
    f.add_drafter_results(f.make_run(board["protocol"], newcomer), 0.9, board["baseline_results"])
    assert b"newcomer" in client.get(reverse("home")).content
    # a withdrawn drafter leaves at once
    Drafter.objects.filter(pk=newcomer.pk).update(review_state="withdrawn")
    assert b"newcomer" not in client.get(reverse("home")).content
    # the drafter page follows its run cell by cell (rendered again at once for a test)
    settings.SPECBOARD_LANDING_REFRESH_S = 0
    drafter = f.make_drafter(board["protocol"].target, "in progress")
    running = f.make_run(board["protocol"], drafter, state=Run.RUNNING, cells_done=0)
    url = reverse("drafter", args=[drafter.slug]) + f"?protocol={board['protocol'].slug}@1"
    assert b"No measured cells yet" in client.get(url).content
    client.get(url)
    cell = f.result_from_counts(running, "chat", 1, 0.0, 2, f.drafter_counts(0.5, 0, 1, 0.0, 2),
                                baseline=board["baseline_results"][0])
    cell.save()
    Run.objects.filter(pk=running.pk).update(cells_done=1)
    html = client.get(url).content.decode()
    assert "No measured cells yet" not in html and "fig-speedup" in html
    cache.clear()


def test_empty_site_renders(client):
    response = client.get(reverse("home"))
    assert response.status_code == 200 and b"No protocol has results yet" in response.content


def seed_size(n_drafters, tasks, batch_sizes, ks):
    target = f.make_target(slug=f"t{n_drafters}")
    protocol = f.make_protocol(target, slug=f"size-{n_drafters}", tasks=tasks,
                               batch_sizes=batch_sizes, ks=ks)
    return protocol, f.seed_board(protocol, n_drafters)


@pytest.mark.parametrize("size", [
    (2, ("chat",), (1,), (2,)),
    (12, ("chat", "code", "math"), (1, 2, 4, 8), (2, 3, 4)),
])
def test_leaderboard_and_drafter_pages_make_a_bounded_number_of_queries(
        client, django_assert_max_num_queries, size):
    protocol, seeded = seed_size(*size)
    ref = f"{protocol.slug}@{protocol.version}"
    with django_assert_max_num_queries(6):
        response = client.get(reverse("home"), {"protocol": ref, "batch_size": "all"})
    expected = size[0] * len(size[2]) * len(size[3])
    assert len(response.context["board"]["rows"]) == min(expected, 100)  # 100 rows a page
    if expected > 100:
        assert f"of {expected} (page 1 of 2)" in response.content.decode()
        with django_assert_max_num_queries(6):
            page2 = client.get(reverse("home"), {"protocol": ref, "batch_size": "all", "page": 2})
        assert len(page2.context["board"]["rows"]) == expected - 100
    with django_assert_max_num_queries(8):
        response = client.get(reverse("drafter", args=[seeded["drafters"][-1].slug]))
    assert len(response.context["page"]["cells"]) == len(size[1]) * len(size[2]) * len(size[3])
    with django_assert_max_num_queries(6):
        client.get(reverse("compare"), {"protocol": ref,
                                        "d": [d.slug for d in seeded["drafters"][:4]]})
    with django_assert_max_num_queries(5):
        client.get(reverse("queue"))


# ---- drafter page ---------------------------------------------------------------------

def test_drafter_page_charts_hold_the_cells(client, board):
    drafter = board["drafters"][1]
    run = drafter.runs.get()
    Run.objects.filter(pk=run.pk).update(log_tail="cell chat b=1 done\nall cells done")
    drafter.content_sha256 = "c" * 64
    drafter.save()
    response = client.get(reverse("drafter", args=[drafter.slug]), {"k": 4})
    assert response.status_code == 200
    html = response.content.decode()
    figs = figures(html)
    assert set(figs) == {"speedup", "positions", "acceptance_length", "claimed", "throughput",
                         "operating"}
    # speedup vs batch size: one trace per task whose points are the stored cells, an
    # all-tasks trace, and the 1.0 line.
    speedup = {t["name"]: t for t in figs["speedup"]["data"]}
    for task in ("chat", "code"):
        cells = Result.objects.filter(run=run, task=task, k=4).order_by("batch_size")
        assert speedup[task]["x"] == [c.batch_size for c in cells]
        assert speedup[task]["y"] == pytest.approx([c.speedup for c in cells])
    assert "all tasks" in speedup
    assert figs["speedup"]["layout"]["shapes"][0]["y0"] == 1.0
    # per-position acceptance per task: alpha_i from the summed accepted_at over batch sizes
    cells = Result.objects.filter(run=run, task="chat", k=4)
    summed = sum((metrics.SpecCounts(c.drafts, c.draft_tokens, c.accepted_tokens, c.accepted_at)
                  for c in cells), metrics.SpecCounts())
    chat = next(t for t in figs["positions"]["data"] if t["name"] == "chat")
    assert chat["y"] == pytest.approx(metrics.per_position_acceptance(summed))
    assert chat["x"] == [1, 2, 3, 4]
    # acceptance length per task, one bar group per k; throughput and TPOT with baseline
    assert [t["name"] for t in figs["acceptance_length"]["data"]] == ["k = 2", "k = 4"]
    assert any(t["name"] == "chat baseline" for t in figs["throughput"]["data"])
    assert any(t.get("yaxis") == "y2" for t in figs["throughput"]["data"])
    # throughput against per-user speed: per task the drafter's cells at k and the baseline
    # cells they divide by, x = 1 / mean TPOT of each stored row, labelled by batch size
    operating = {t["name"]: t for t in figs["operating"]["data"]}
    for task in ("chat", "code"):
        cells = Result.objects.filter(run=run, task=task, k=4).order_by("batch_size")
        base = Result.objects.filter(run=board["baseline"], task=task).order_by("batch_size")
        for name, rows in ((task, cells), (f"{task} baseline", base)):
            assert operating[name]["x"] == pytest.approx([1 / c.tpot_mean for c in rows])
            assert operating[name]["y"] == pytest.approx([c.output_throughput for c in rows])
            assert operating[name]["text"] == [f"b={c.batch_size}" for c in rows]
    claimed = {t["name"].split(" ")[0]: t["y"] for t in figs["claimed"]["data"]}
    assert claimed["claimed"] == [2.0, 1.8]
    # the table of all cells and the provenance
    assert len(response.context["page"]["cells"]) == 2 * 2 * 2
    assert "c" * 64 in html and drafter.runs.get().protocol.sha256 in html
    assert "all cells done" in html and "transformers" in html
    assert "/static/vendor/plotly.min.js" in html and "cdn" not in html.lower()


def test_pays_page_plots_per_user_speed_from_the_rows_and_no_map_without_records(client,
                                                                                  board):
    """Runs without raw records: the throughput against per-user speed comes from the
    result rows alone; the break-even map needs the records (draft cost, tokens per step)
    and is left out rather than drawn empty."""
    from leaderboard import charts

    protocol = board["protocol"]
    response = client.get(reverse("protocol_pays", args=[protocol.slug, protocol.version]))
    html = response.content.decode()
    data = response.context["data"]
    figs = figures(html)
    assert data["map"]["tasks"] == [] and 'id="map"' not in html
    assert 'id="operating"' in html
    best = charts._best_curves(data["curves"])
    for i, task in enumerate(("chat", "code")):
        lines = {t["name"]: t for t in figs[f"operating_{i}"]["data"]}
        assert len(lines) == len(board["drafters"]) + 1     # each at its best k, and the target
        for d in board["drafters"]:
            k = best[d.slug]["k"]
            rows = Result.objects.filter(run__drafter=d, task=task, k=k).order_by("batch_size")
            line = lines[f"{d.name} (k={k})"]
            assert line["x"] == pytest.approx([1 / r.tpot_mean for r in rows])
            assert line["y"] == pytest.approx([r.output_throughput for r in rows])
            assert line["text"] == ["b=1", "b=4"]
        base = Result.objects.filter(run=board["baseline"], task=task).order_by("batch_size")
        assert lines["target alone (no drafter)"]["y"] == pytest.approx(
            [r.output_throughput for r in base])


def test_drafter_page_without_results_says_so(client):
    target = f.make_target()
    protocol = f.make_protocol(target)
    drafter = f.make_drafter(target, "fresh one")
    f.make_run(protocol, drafter, state=Run.QUEUED)
    response = client.get(reverse("drafter", args=[drafter.slug]))
    assert response.status_code == 200
    assert b"No measured cells yet" in response.content and figures(response.content.decode()) == {}
    assert client.get(reverse("drafter", args=["missing"])).status_code == 404


def test_figure_json_cannot_close_its_script_tag(client, board):
    drafter = board["drafters"][0]
    Drafter.objects.filter(pk=drafter.pk).update(name="</script><script>alert(1)</script>")
    other = board["drafters"][1]
    response = client.get(reverse("compare"), {"d": [drafter.slug, other.slug]})
    html = response.content.decode()
    assert "<script>alert(1)" not in html
    names = [t["name"] for t in figures(html)["speedup"]["data"]]
    # the name is data, escaped into entities plotly shows as the characters (charts.plain)
    assert any(n.startswith("&lt;/script&gt;&lt;script&gt;alert(1)&lt;/script&gt;")
               for n in names)


# ---- compare, protocol ------------------------------------------------------------------

def test_compare_overlays_two_to_four_drafters(client, board):
    slugs = [d.slug for d in board["drafters"]]
    response = client.get(reverse("compare"), {"d": slugs[:3], "k": 2})
    assert response.status_code == 200
    figs = figures(response.content.decode())
    assert len([t for t in figs["speedup"]["data"]]) == 3
    assert len(figs["throughput"]["data"]) == 3 + 1  # and the baseline
    summary = response.context["summary"]
    run = board["drafters"][0].runs.get()
    al, *_ = expected_aggregate(run, board["baseline"], k=2)
    assert summary[0]["acceptance_length"] == pytest.approx(al)
    one = client.get(reverse("compare"), {"d": slugs[:1]})
    assert b"at least two" in one.content


def test_protocol_page_shows_the_spec_prompt_sets_policy_and_definitions(client, board):
    protocol = board["protocol"]
    response = client.get(reverse("protocol", args=[protocol.slug, protocol.version]))
    assert response.status_code == 200
    html = response.content.decode()
    assert protocol.sha256 in html
    from django.utils.html import escape
    assert escape(protocol.canonical_json) in html
    ps = f.make_prompt_set()
    assert ps.source_sha256 in html and ">10<" in html  # 2 categories x 5 prompts
    policy = protocols.multi_turn_policy()
    assert policy.startswith("How a prompt with several user turns is sent")
    assert escape(policy) in html
    for name, text in metrics.definitions():
        assert escape(text) in html, name
    listing = client.get(reverse("protocols")).content.decode()
    assert protocol.sha256[:12] in listing


def test_plotly_is_served_locally():
    path = finders.find("vendor/plotly.min.js")
    assert path and path.endswith("plotly/package_data/plotly.min.js")
    with open(path, "rb") as fh:
        assert b"plotly.js" in fh.read(4096)


# ---- queue -------------------------------------------------------------------------------

def test_queue_shows_positions_progress_and_failures(client):
    target = f.make_target()
    protocol = f.make_protocol(target, hardware="pages-a")
    other = f.make_protocol(target, slug="other-hw", hardware="pages-b")
    d = [f.make_drafter(target, f"queued {i}") for i in range(4)]
    running = f.make_run(protocol, d[0], state=Run.RUNNING, cells_done=3, eta_seconds=95)
    q1 = f.make_run(protocol, d[1], state=Run.QUEUED)
    q_other = f.make_run(other, d[2], state=Run.QUEUED)
    q2 = f.make_run(protocol, d[3], state=Run.QUEUED)
    failed = f.make_run(protocol, d[3], state=Run.FAILED, error="CUDA out of memory (test)",
                        log_tail="line 1\nTraceback: boom")
    response = client.get(reverse("queue"))
    html = response.content.decode()
    active = {r["id"]: r for r in response.context["q"]["active"]}
    assert active[q1.pk]["position"] == 1 and active[q2.pk]["position"] == 2
    assert active[q_other.pk]["position"] == 1  # its own hardware class
    assert active[running.pk]["position"] is None
    assert "3/8 cells" in html and "ETA 1m 35s" in html
    assert "CUDA out of memory (test)" in html and "Traceback: boom" in html
    assert failed.pk in {r["id"] for r in response.context["q"]["finished"]}
    progress = client.get(reverse("queue_progress"), {"ids": f"{running.pk},{q2.pk}"}).json()
    by_id = {r["id"]: r for r in progress["runs"]}
    assert by_id[running.pk]["cells_done"] == 3 and by_id[running.pk]["eta_seconds"] == 95
    assert by_id[q2.pk]["position"] == 2
    Run.objects.filter(pk=running.pk).update(cells_done=7)
    again = client.get(reverse("queue_progress"), {"ids": str(running.pk)}).json()
    assert again["runs"][0]["cells_done"] == 7
    assert again["runs"][0]["progress"] == pytest.approx(7 / 8)


# ---- accounts and permissions -------------------------------------------------------------

@pytest.fixture
def owner_and_other():
    return (User.objects.create_user("owner", password="pw-owner-123"),
            User.objects.create_user("other", password="pw-other-123"))


def test_only_the_owner_or_staff_may_cancel_withdraw_or_edit(client, owner_and_other):
    owner, other = owner_and_other
    target = f.make_target()
    protocol = f.make_protocol(target)
    drafter = f.make_drafter(target, "mine", owner=owner)
    run = f.make_run(protocol, drafter, state=Run.QUEUED)
    client.force_login(other)
    assert client.post(reverse("run_cancel", args=[run.pk])).status_code == 403
    assert client.post(reverse("drafter_withdraw", args=[drafter.slug])).status_code == 403
    assert client.get(reverse("drafter_edit", args=[drafter.slug])).status_code == 403
    assert client.post(reverse("drafter_edit", args=[drafter.slug]),
                       {"name": "stolen"}).status_code == 403
    run.refresh_from_db()
    drafter.refresh_from_db()
    assert run.state == Run.QUEUED and drafter.review_state == "approved"
    assert drafter.name == "mine"
    queue_html = client.get(reverse("queue")).content.decode()
    assert reverse("run_cancel", args=[run.pk]) not in queue_html
    # anonymous: sent to log in, nothing changes
    client.logout()
    response = client.post(reverse("run_cancel", args=[run.pk]))
    assert response.status_code == 302 and reverse("login") in response["Location"]
    # the owner can
    client.force_login(owner)
    assert reverse("run_cancel", args=[run.pk]) in client.get(reverse("queue")).content.decode()
    assert client.post(reverse("run_cancel", args=[run.pk])).status_code == 302
    run.refresh_from_db()
    assert run.state == Run.CANCELLED
    response = client.post(reverse("drafter_edit", args=[drafter.slug]), {
        "name": "mine, renamed", "description": "", "link": "", "licence": "MIT",
        "claimed_acceptance_length": "2.5", "claimed_speedup": "", "claimed_source": ""})
    assert response.status_code == 200 and b"Give the URL where these figures" in response.content
    response = client.post(reverse("drafter_edit", args=[drafter.slug]), {
        "name": "mine, renamed", "description": "", "link": "", "licence": "MIT",
        "claimed_acceptance_length": "", "claimed_speedup": "", "claimed_source": ""})
    assert response.status_code == 302
    second = f.make_run(protocol, drafter, state=Run.RUNNING)
    assert client.post(reverse("drafter_withdraw", args=[drafter.slug])).status_code == 302
    drafter.refresh_from_db()
    second.refresh_from_db()
    assert drafter.review_state == "withdrawn" and drafter.name == "mine, renamed"
    assert second.cancel_requested
    # staff may cancel anyone's run, including a baseline
    staff = User.objects.create_user("staff", password="pw-staff-123", is_staff=True)
    base = f.make_run(protocol, None, state=Run.QUEUED)
    client.force_login(other)
    assert client.post(reverse("run_cancel", args=[base.pk])).status_code == 403
    client.force_login(staff)
    assert client.post(reverse("run_cancel", args=[base.pk])).status_code == 302
    base.refresh_from_db()
    assert base.state == Run.CANCELLED


def test_sign_up_log_out_and_log_in(client):
    response = client.post(reverse("signup"), {"username": "ada", "email": "",
                                               "password1": "a-long-pass-9!", "password2": "a-long-pass-9!"})
    assert response.status_code == 302
    assert client.get(reverse("account_settings")).status_code == 200
    assert client.post(reverse("logout")).status_code == 302
    assert client.get(reverse("account_settings")).status_code == 302
    bad = client.post(reverse("signup"), {"username": "ada", "password1": "x", "password2": "y"})
    assert bad.status_code == 200 and b"errors" in bad.content
    response = client.post(reverse("login"), {"username": "ada", "password": "a-long-pass-9!"})
    assert response.status_code == 302
    assert client.get(reverse("submit")).status_code == 200


def test_api_tokens_are_shown_once_stored_hashed_and_revocable(client, owner_and_other):
    owner, other = owner_and_other
    client.force_login(owner)
    response = client.post(reverse("account_settings"), {"name": "laptop", "create": "1"})
    token = response.context["new_token"]
    assert token and token in response.content.decode()
    assert response["Cache-Control"] == "no-store"
    row = ApiToken.objects.get(user=owner)
    assert row.token_sha256 == ApiToken.hash(token) and token not in str(row.__dict__)
    assert token not in client.get(reverse("account_settings")).content.decode()
    client.force_login(other)
    client.post(reverse("account_settings"), {"revoke": row.pk})
    row.refresh_from_db()
    assert row.revoked_at is None  # not theirs
    client.force_login(owner)
    client.post(reverse("account_settings"), {"revoke": row.pk})
    row.refresh_from_db()
    assert row.revoked_at is not None
    from leaderboard.tokens import user_for_token
    assert user_for_token(token) is None


def test_api_token_command_prints_a_token_and_stores_its_hash(owner_and_other):
    owner, _ = owner_and_other
    out = StringIO()
    call_command("api_token", "owner", stdout=out)
    token = out.getvalue().strip()
    assert token.startswith("sb_") and len(token) > 30
    assert ApiToken.objects.filter(user=owner, token_sha256=ApiToken.hash(token)).exists()
    from leaderboard.tokens import user_for_token
    assert user_for_token(token) == owner
    from django.core.management.base import CommandError
    with pytest.raises(CommandError, match="no user"):
        call_command("api_token", "nobody", stdout=StringIO())
