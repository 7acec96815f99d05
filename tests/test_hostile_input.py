"""Hostile input, closed (issue: faults and attacks): every finding of the security review
with a test that failed before its fix. Real database rows, real pages and API."""
import json
import re

import pytest
from django.contrib.auth.models import User
from django.core.cache import cache
from django.urls import reverse

from leaderboard import tokens
from leaderboard.models import Drafter, Run

from . import factories as f

pytestmark = pytest.mark.django_db

MARKUP = '<a href="https://evil.example/">x</a><script>alert(1)</script>'


def figures(html):
    return {m.group(1): json.loads(m.group(2)) for m in re.finditer(
        r'<script type="application/json" id="fig-([\w-]+)">(.*?)</script>', html, re.S)}


# ---- redirects ------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["https://evil.example/", "//evil.example/x",
                                    "javascript:alert(1)", "https:///evil.example"])
def test_sign_up_never_redirects_off_the_site(client, target):
    response = client.post(reverse("signup") + "?next=" + target, {
        "username": "newcomer", "password1": "a long pass phrase 123",
        "password2": "a long pass phrase 123"})
    assert response.status_code == 302
    assert response["Location"] == reverse("home")


def test_sign_up_keeps_a_local_next(client):
    response = client.post(reverse("signup") + "?next=/queue/", {
        "username": "newcomer", "password1": "a long pass phrase 123",
        "password2": "a long pass phrase 123"})
    assert response.status_code == 302 and response["Location"] == "/queue/"


# ---- malformed query values --------------------------------------------------------------

@pytest.mark.parametrize("url", [
    "/queue/progress.json?ids=99999999999999999999999",
    "/queue/progress.json?ids=-1,abc,1e9,%00",
    "/runs/99999999999999999999999/",
    "/runs/99999999999999999999999/artifact/",
    "/protocols/pages/v99999999999999999999999/",
    "/?page=99999999999999999999999&k=99999999999999999999&batch_size=-5&temperature=nan",
    "/compare/?protocol=pages@99999999999999999999&d=x",
    "/api/runs/99999999999999999999999",
])
def test_malformed_values_are_never_a_500(client, url):
    target = f.make_target()
    f.seed_board(f.make_protocol(target), 1)
    # 400: a NUL byte in a page's address (leaderboard/middleware.py)
    assert client.get(url).status_code in (200, 400, 404, 422)


# ---- user text is plain text everywhere ----------------------------------------------------

@pytest.fixture
def hostile_board():
    target = f.make_target()
    protocol = f.make_protocol(target)
    seeded = f.seed_board(protocol, 2)
    d = seeded["drafters"][0]
    d.name = MARKUP
    d.description = MARKUP
    d.link = "javascript:alert(1)"
    d.claimed_source = "javascript:alert(2)"
    d.claimed_speedup = 1.5
    d.save()
    return {"protocol": protocol, "drafter": d, **seeded}


def chart_texts(figs):
    """Every string a chart shows that comes from the data: names, labels, point text."""
    for fig in figs.values():
        for trace in fig["data"]:
            for key in ("name", "text", "hovertext", "x", "y"):
                value = trace.get(key)
                values = value if isinstance(value, list) else [value]
                for v in values:
                    for item in (v if isinstance(v, list) else [v]):
                        if isinstance(item, str):
                            yield item


def test_markup_in_user_text_is_escaped_on_every_page_and_chart(client, hostile_board):
    d, protocol = hostile_board["drafter"], hostile_board["protocol"]
    ref = f"{protocol.slug}@{protocol.version}"
    other = hostile_board["drafters"][1]
    pages = [
        reverse("home"),
        reverse("drafter", args=[d.slug]),
        reverse("compare") + f"?protocol={ref}&d={d.slug}&d={other.slug}",
        reverse("protocol_pays", args=[protocol.slug, protocol.version]),
        reverse("queue"),
    ]
    for url in pages:
        response = client.get(url)
        assert response.status_code == 200, url
        html = response.content.decode()
        assert MARKUP not in html and "<script>alert(1)" not in html, url
        assert 'href="javascript:' not in html, url
        texts = list(chart_texts(figures(html)))
        for text in texts:
            assert "<a " not in text and "<script" not in text, (url, text)
    compare_figs = figures(client.get(pages[2]).content.decode())
    names = [t for t in chart_texts(compare_figs) if "evil.example" in t]
    assert names and all(t.startswith("&lt;a href=") for t in names), names


def test_markup_in_user_text_comes_back_as_data_from_the_api(client, hostile_board):
    d = hostile_board["drafter"]
    body = client.get(f"/api/drafters/{d.slug}").json()
    assert body["drafter"]["name"] == MARKUP  # JSON data, not markup: the client renders it
    assert client.get(f"/api/drafters/{d.slug}")["Content-Type"].startswith("application/json")


# ---- the page cache --------------------------------------------------------------------------

def test_cached_leaderboard_links_never_carry_foreign_parameters(client, settings):
    settings.SPECBOARD_PAGE_CACHE_SECONDS = 300
    cache.clear()
    target = f.make_target()
    f.seed_board(f.make_protocol(target), 2)
    poisoned = client.get("/?utm=1&next=https://evil.example/").content.decode()
    assert "evil.example" not in poisoned
    clean = client.get("/").content.decode()
    assert "evil.example" not in clean and "utm=" not in clean
    sorted_page = client.get("/?sort=name&dir=asc").content.decode()
    assert "sort=name" in sorted_page


# ---- moderation ---------------------------------------------------------------------------

@pytest.fixture
def rejected(settings, tmp_path):
    owner = User.objects.create_user("owner")
    target = f.make_target()
    protocol = f.make_protocol(target, slug="pages")
    seeded = f.seed_board(protocol, 1)
    d = f.make_drafter(target, "bad one", owner=owner, content_sha256="ab" * 32,
                       params={"prompt_lookup_min": 1, "prompt_lookup_max": 3})
    run = f.make_run(protocol, d)
    f.add_drafter_results(run, 0.5, seeded["baseline_results"])
    d.review_state = "rejected"
    d.save()
    return {"owner": owner, "drafter": d, "run": run, "protocol": protocol,
            "token": tokens.create_token(owner, "t")[1]}


def test_a_rejected_drafter_is_hidden_from_everyone_but_staff(client, rejected):
    d, run = rejected["drafter"], rejected["run"]
    client.force_login(rejected["owner"])
    for url in (reverse("drafter", args=[d.slug]), reverse("run", args=[run.pk]),
                reverse("run_artifact", args=[run.pk]), f"/api/drafters/{d.slug}",
                f"/api/runs/{run.pk}", f"/api/runs/{run.pk}/artifact"):
        assert client.get(url).status_code == 404, url
    listed = client.get("/api/drafters", {"review_state": "rejected"}).json()
    assert listed["count"] == 0
    # Nor do its runs appear in any list: the runs API, the queue page, its progress.
    run.state, run.error = "failed", "secret traceback of bad one"
    run.save()
    client.logout()
    assert client.get("/api/runs", {"drafter": d.slug}).json()["count"] == 0
    assert run.pk not in [r["id"] for r in client.get("/api/runs").json()["items"]]
    queue_html = client.get(reverse("queue")).content.decode()
    assert "bad one" not in queue_html and "secret traceback" not in queue_html
    progress = client.get(reverse("queue_progress"), {"ids": str(run.pk)}).json()
    assert progress["runs"] == []
    staff = User.objects.create_user("staff", is_staff=True)
    client.force_login(staff)
    assert client.get(reverse("drafter", args=[d.slug])).status_code == 200
    assert client.get(f"/api/drafters/{d.slug}").status_code == 200
    assert client.get("/api/runs", {"drafter": d.slug}).json()["count"] == 1
    assert "bad one" in client.get(reverse("queue")).content.decode()
    assert len(client.get(reverse("queue_progress"), {"ids": str(run.pk)}).json()["runs"]) == 1


def test_a_rejection_is_final_for_the_owner(client, rejected):
    # Not found, not forbidden: a 403 would confirm that the drafter exists.
    d = rejected["drafter"]
    response = client.post(f"/api/drafters/{d.slug}/withdraw",
                           headers={"Authorization": f"Bearer {rejected['token']}"})
    assert response.status_code == 404
    client.force_login(rejected["owner"])
    assert client.post(reverse("drafter_withdraw", args=[d.slug])).status_code == 404
    assert client.get(reverse("drafter_edit", args=[d.slug])).status_code == 404
    assert client.post(reverse("drafter_edit", args=[d.slug]), {"name": "renamed"}).status_code == 404
    d.refresh_from_db()
    assert d.review_state == "rejected" and d.name == "bad one"


def test_rejected_content_cannot_come_back_under_a_new_name(client, rejected, settings):
    settings.SPECBOARD_SUBMISSIONS_PER_DAY = 0
    from leaderboard.services import submissions

    d = rejected["drafter"]
    params = submissions.check_params("ngram", {"prompt_lookup_min": 1, "prompt_lookup_max": 3},
                                      rejected["protocol"])
    content = submissions.params_sha256("ngram", params)
    Drafter.objects.filter(pk=d.pk).update(content_sha256=content)
    before = (Drafter.objects.count(), Run.objects.count())
    response = client.post("/api/drafters", {
        "protocol": "pages@1", "method": "ngram", "name": "a fresh name",
        "prompt_lookup_min": "1", "prompt_lookup_max": "3"},
        headers={"Authorization": f"Bearer {rejected['token']}"})
    assert response.status_code == 202
    f.submitted(response)
    checked = client.get(f"/api/submissions/{response.json()['id']}",
                         headers={"Authorization": f"Bearer {rejected['token']}"})
    assert checked.json()["state"] == "refused"
    assert "rejected" in checked.json()["problems"][0]["message"]
    assert d.slug not in checked.content.decode()
    assert (Drafter.objects.count(), Run.objects.count()) == before


# ---- throttling -----------------------------------------------------------------------------

def test_sign_ups_from_one_address_are_throttled(client, settings):
    settings.SPECBOARD_SIGNUP_RATE = "3/h"
    codes = []
    for i in range(5):
        client.logout()
        codes.append(client.post(reverse("signup"), {
            "username": f"user{i}", "password1": "a long pass phrase 123",
            "password2": "a long pass phrase 123"}).status_code)
    assert codes == [302, 302, 302, 429, 429]
    assert User.objects.count() == 3


def test_log_in_attempts_are_throttled_per_user_name(client, settings):
    settings.AXES_FAILURE_LIMIT = 4
    User.objects.create_user("victim", password="the right pass phrase 1")
    codes = [client.post(reverse("login"), {"username": "victim", "password": f"guess {i}"},
                         REMOTE_ADDR=f"10.0.0.{i}").status_code for i in range(6)]
    # other addresses, same name: locked out at the fourth failure (django-axes)
    assert codes == [200, 200, 200, 429, 429, 429]
    # the right password is refused too while throttled: guessing gains nothing
    right = client.post(reverse("login"), {"username": "victim",
                                           "password": "the right pass phrase 1"},
                        REMOTE_ADDR="10.0.0.99")
    assert right.status_code == 429 and "_auth_user_id" not in client.session


def test_the_admin_log_in_is_locked_out_like_the_site_s(client, settings):
    settings.AXES_FAILURE_LIMIT = 5
    User.objects.create_user("boss", password="the right pass phrase 1", is_staff=True,
                             is_superuser=True)
    codes = [client.post("/admin/login/?next=/admin/", {
        "username": "boss", "password": f"guess {i}"}).status_code for i in range(13)]
    assert codes[:4] == [200] * 4 and set(codes[4:]) == {429}
    right = client.post("/admin/login/?next=/admin/", {"username": "boss",
                                                        "password": "the right pass phrase 1"})
    assert right.status_code == 429 and "_auth_user_id" not in client.session


def test_behind_trusted_proxies_each_client_has_its_own_budget(client, settings):
    """Every request comes from the proxy (one REMOTE_ADDR); SPECBOARD_TRUSTED_PROXIES says
    how many proxies appended to X-Forwarded-For, so the client is found there, and what a
    client writes into the header itself is never believed."""
    settings.AXES_FAILURE_LIMIT = 3
    settings.SPECBOARD_SIGNUP_RATE = "2/h"
    settings.SPECBOARD_TRUSTED_PROXIES = 1
    proxy = {"REMOTE_ADDR": "10.9.9.9"}

    def login(forwarded, name):
        return client.post(reverse("login"), {"username": name, "password": "wrong"},
                           HTTP_X_FORWARDED_FOR=forwarded, **proxy).status_code

    # One client fails until locked out (spoofing a first hop changes nothing) ...
    codes = [login(f"6.6.6.{i}, 203.0.113.7", f"name{i}") for i in range(4)]
    assert codes == [200, 200, 429, 429]
    # ... and another client behind the same proxy is not locked out by it.
    assert login("198.51.100.2", "someone") == 200
    # Sign-ups, too, are counted per client, not per proxy.
    codes = []
    for i, addr in enumerate(["198.51.100.3"] * 3 + ["198.51.100.4"]):
        client.logout()
        codes.append(client.post(reverse("signup"), {
            "username": f"new{i}", "password1": "a long pass phrase 123",
            "password2": "a long pass phrase 123"}, HTTP_X_FORWARDED_FOR=addr,
            **proxy).status_code)
    assert codes == [302, 302, 429, 302]
    # Without trusted proxies the header is ignored: every client is the proxy, and three
    # failures under three "different" forwarded addresses lock it out.
    settings.SPECBOARD_TRUSTED_PROXIES = 0
    assert [login(f"192.0.2.{i}", f"fresh-{i}") for i in range(3)] == [200, 200, 429]


def test_api_token_creation_is_throttled_per_user(client, settings):
    from leaderboard.models import ApiToken

    settings.SPECBOARD_TOKEN_RATE = "2/h"
    user = User.objects.create_user("maker")
    client.force_login(user)
    codes = [client.post(reverse("account_settings"), {"name": f"t{i}"}).status_code
             for i in range(4)]
    assert codes == [200, 200, 429, 429]
    assert ApiToken.objects.filter(user=user).count() == 2


def test_a_withdrawal_never_overwrites_a_rejection_made_meanwhile(rejected):
    """The owner's page was loaded while the drafter was approved; staff reject it before
    the owner's withdrawal reaches the database (#32 item 7)."""
    from leaderboard.services import submissions

    d = rejected["drafter"]
    Drafter.objects.filter(pk=d.pk).update(review_state="approved")
    stale = Drafter.objects.get(pk=d.pk)                                # the owner's view
    Drafter.objects.filter(pk=d.pk).update(review_state="rejected")    # staff, meanwhile
    queued = f.make_run(rejected["protocol"], d, state=Run.QUEUED)
    assert submissions.withdraw_drafter(stale) is None
    assert Drafter.objects.get(pk=d.pk).review_state == "rejected"
    queued.refresh_from_db()
    assert queued.state == Run.QUEUED            # nothing cancelled on its behalf either
    # A withdrawal from a withdrawable state happens once; again is a no-op.
    Drafter.objects.filter(pk=d.pk).update(review_state="approved")
    assert submissions.withdraw_drafter(stale) == 1
    assert submissions.withdraw_drafter(stale) == 0
    assert Drafter.objects.get(pk=d.pk).review_state == "withdrawn"
