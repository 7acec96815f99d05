"""Concurrent writes through a real threaded server: twenty identical n-gram submissions
sent at once give one 201 and nineteen 409s in the API's error shape, never a 500 (on
SQLite: WAL, a busy timeout and IMMEDIATE transactions, leaderboard/env.py)."""
import json
import threading
import urllib.error
import urllib.parse
import urllib.request

import pytest
from django.contrib.auth.models import User
from django.db import connection

from leaderboard import tokens
from leaderboard.models import Drafter, Run

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


def test_twenty_identical_submissions_at_once_give_one_201_and_nineteen_409(
        live_server, settings, tmp_path):
    settings.SPECBOARD_SUBMISSIONS_PER_DAY = 0
    target = f.make_target()
    f.make_protocol(target, slug="pages", tasks=("chat",), batch_sizes=(1,), ks=(2,))
    user = User.objects.create_user("owner")
    token = tokens.create_token(user, "test")[1]
    data = {"protocol": "pages@1", "method": "ngram", "name": "same ngram",
            "prompt_lookup_min": "1", "prompt_lookup_max": "3"}
    url = live_server.url + "/api/drafters"
    start = threading.Barrier(N)
    answers = [None] * N

    def send(i):
        start.wait()
        answers[i] = post(url, data, token)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    codes = sorted(code for code, _ in answers)
    assert codes == [201] + [409] * (N - 1), answers
    for code, body in answers:
        if code == 409:
            assert set(body) == {"detail"} and body["detail"][0]["message"], body
    assert Drafter.objects.filter(method="ngram").count() == 1
    assert Run.objects.filter(drafter__isnull=False).count() == 1
