"""Concurrent writes: twenty identical n-gram submissions sent at once through a real
threaded server are all received (202, never a 500), and twenty intake checks of them run
at once (as twenty intake workers would) accept exactly one and refuse nineteen as
duplicates (on SQLite: WAL, a busy timeout and IMMEDIATE transactions, leaderboard/env.py)."""
import json
import threading
import urllib.error
import urllib.parse
import urllib.request

import pytest
from django.contrib.auth.models import User
from django.db import connection, connections

from leaderboard import tokens
from leaderboard.models import Drafter, Run, Submission
from leaderboard.services import intake

from . import factories as f

pytestmark = pytest.mark.django_db(transaction=True)

N = 20


def post(url, data, token):
    body = urllib.parse.urlencode(data).encode()
    request = urllib.request.Request(url, data=body, method="POST", headers={
        "Authorization": f"Bearer {token}",
        "Content-Type": "application/x-www-form-urlencoded"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, raw.decode(errors="replace")[:300]


def test_the_embedded_database_is_in_wal_mode_with_immediate_transactions():
    if connection.vendor != "sqlite":
        pytest.skip("the embedded default is SQLite; this run uses " + connection.vendor)
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA journal_mode")
        assert cursor.fetchone()[0] == "wal"
    assert connection.settings_dict["OPTIONS"]["transaction_mode"] == "IMMEDIATE"


def at_once(work, n):
    """Run work(i) for i < n in n threads released together; each closes its connection."""
    start = threading.Barrier(n)

    def run(i):
        start.wait()
        try:
            work(i)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)


def test_twenty_identical_submissions_at_once_give_one_drafter_and_nineteen_refusals(
        live_server, settings, tmp_path):
    settings.SPECBOARD_SUBMISSIONS_PER_DAY = 0
    target = f.make_target()
    f.make_protocol(target, slug="pages", tasks=("chat",), batch_sizes=(1,), ks=(2,))
    user = User.objects.create_user("owner")
    token = tokens.create_token(user, "test")[1]
    data = {"protocol": "pages@1", "method": "ngram", "name": "same ngram",
            "prompt_lookup_min": "1", "prompt_lookup_max": "3"}
    url = live_server.url + "/api/drafters"
    answers = [None] * N

    def send(i):
        answers[i] = post(url, data, token)

    at_once(send, N)
    assert sorted(code for code, _ in answers) == [202] * N, answers
    ids = [body["id"] for _, body in answers]
    assert len(set(ids)) == N and all(b["state"] == "checking" for _, b in answers)

    at_once(lambda i: intake.check(ids[i], send=False), N)
    states = sorted(Submission.objects.filter(pk__in=ids).values_list("state", flat=True))
    assert states == ["accepted"] + ["refused"] * (N - 1)
    for s in Submission.objects.filter(state="refused"):
        assert s.drafter_id is None and s.problems[0]["field"] == "content_sha256", s.problems
    assert Drafter.objects.filter(method="ngram").count() == 1
    assert Run.objects.filter(drafter__isnull=False).count() == 1
