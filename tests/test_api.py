"""REST API (/api/): the schema, every read and filter, the CSV and JSON export, writes by
token with their permissions and refusals (401/403/404/409/413/422/429), and a
property-based fuzz of every endpoint with schemathesis. Real database; result figures are
computed by worker.metrics from chosen counts (tests/factories.py)."""
import csv
import gzip
import hashlib
import io
import json
from collections import Counter

import pytest
from django.contrib.auth.models import User
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone

from leaderboard import tokens
from leaderboard.selectors import results
from leaderboard.api import API_VERSION
from leaderboard.api import auth as api_auth
from leaderboard.api import results as api_results
from leaderboard.middleware import FORM_OVERHEAD_BYTES
from leaderboard.models import ApiToken, Drafter, DrafterFile, Result, Run, Submission
from worker import metrics
from worker.protocol import canonical_json

from . import factories as f
from .test_submission import HIDDEN, LAYERS, VOCAB, tiny_config, tiny_weights

pytestmark = pytest.mark.django_db


# ---- data ---------------------------------------------------------------------------

@pytest.fixture
def users():
    # no passwords: hashing one takes a second or more; the API only sees tokens
    owner = User.objects.create_user("owner")
    other = User.objects.create_user("other")
    staff = User.objects.create_user("staff", is_staff=True)
    return {name: (u, tokens.create_token(u, "test")[1])
            for name, u in (("owner", owner), ("other", other), ("staff", staff))}


@pytest.fixture
def board(users):
    """Two protocols of one target (different grids) and one of a second target, n-gram
    drafters, an EAGLE head and a withdrawn drafter, each with a succeeded run; a queued
    and a failed run."""
    owner = users["owner"][0]
    target = f.make_target(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS)
    main = f.make_protocol(target, slug="pages", tasks=("chat", "code"), batch_sizes=(1, 4),
                           temperatures=(0.0,), ks=(2, 4))
    other = f.make_protocol(target, slug="other", hardware="other-hw", tasks=("chat",),
                            batch_sizes=(2,), temperatures=(0.0, 0.7), ks=(3,))
    seeded = f.seed_board(main, 2, owner=owner)
    seeded_other = f.seed_board(other, 1, prefix="second")
    second_target = f.make_target("tiny-b", vocab_size=VOCAB, hidden_size=HIDDEN,
                                  num_layers=LAYERS)
    f.seed_board(f.make_protocol(second_target, slug="b-protocol", hardware="b-hw",
                                 tasks=("chat",), batch_sizes=(1,), ks=(2,)), 1, prefix="b")
    eagle = f.make_drafter(target, "eagle head", method="eagle", owner=owner)
    eagle_run = f.make_run(main, eagle)
    f.add_drafter_results(eagle_run, 0.8, seeded["baseline_results"])
    hidden = f.make_drafter(target, "hidden one", owner=owner, review_state="withdrawn")
    f.add_drafter_results(f.make_run(main, hidden), 0.5, seeded["baseline_results"])
    queued = f.make_run(main, seeded["drafters"][0], state=Run.QUEUED)
    failed = f.make_run(other, seeded_other["drafters"][0], state=Run.FAILED,
                        error="CUDA out of memory (test)", log_tail="Traceback: boom")
    return {"target": target, "main": main, "other": other, "seeded": seeded,
            "seeded_other": seeded_other, "eagle": eagle, "eagle_run": eagle_run,
            "hidden": hidden, "queued": queued, "failed": failed}


def bearer(token):
    return {"Authorization": f"Bearer {token}"}


def problems(response):
    body = response.json()
    assert set(body) == {"detail"}, body
    for p in body["detail"]:
        assert set(p) == {"file", "member", "field", "message"}, p
        assert p["message"]
    return body["detail"]


def all_pages(client, **params):
    items, offset = [], 0
    while True:
        page = client.get("/api/results", {**params, "limit": 7, "offset": offset}).json()
        items += page["items"]
        offset += 7
        if offset >= page["count"]:
            return page["count"], items


# ---- schema -------------------------------------------------------------------------

def test_the_schema_is_valid_openapi_with_a_version_and_described_fields(client):
    from openapi_spec_validator import validate

    response = client.get("/api/openapi.json")
    assert response.status_code == 200
    schema = response.json()
    validate(schema)
    assert schema["info"]["title"] == "SpecBoard API"
    assert schema["info"]["version"] == API_VERSION == "1.0.0"
    assert schema["components"]["securitySchemes"]["TokenAuth"] == {"type": "http",
                                                                    "scheme": "bearer"}
    undescribed = [f"{name}.{prop}"
                   for name, comp in schema["components"]["schemas"].items()
                   for prop, spec in comp.get("properties", {}).items()
                   if not spec.get("description")]
    assert undescribed == []
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            params = [p["name"] for p in op.get("parameters", []) if not p.get("description")]
            assert params == [], (method, path)
    # the result columns are documented in export order
    assert list(schema["components"]["schemas"]["ResultOut"]["properties"]) == list(
        results.RESULT_COLUMNS)
    docs = client.get("/api/docs")
    assert docs.status_code == 200 and b"openapi.json" in docs.content


# ---- reads --------------------------------------------------------------------------

def test_targets_and_protocols_carry_the_canonical_spec_and_its_sha256(client, board):
    targets = client.get("/api/targets").json()
    assert [t["slug"] for t in targets] == [board["target"].slug, "tiny-b"]
    assert targets[0]["vocab_size"] == VOCAB
    protocols = {p["slug"]: p for p in client.get("/api/protocols").json()}
    assert set(protocols) == {"pages", "other", "b-protocol"}
    for slug, p in protocols.items():
        assert p["canonical_json"] == canonical_json(p["spec"])
        assert hashlib.sha256(p["canonical_json"].encode()).hexdigest() == p["sha256"]
    assert protocols["pages"]["sha256"] == board["main"].sha256
    assert protocols["other"]["temperatures"] == [0.0, 0.7]
    detail = client.get("/api/protocols/pages/1").json()
    assert detail["sha256"] == board["main"].sha256
    assert detail["canonical_json"] == board["main"].canonical_json
    assert [t["task"] for t in detail["tasks"]] == ["chat", "code"]
    assert any(name == "acceptance_length" for name, _ in detail["metrics"])
    missing = client.get("/api/protocols/pages/9")
    assert missing.status_code == 404
    assert problems(missing)[0]["message"].startswith("no protocol pages v9")


def test_drafters_list_and_detail_hide_withdrawn_ones_unless_asked(client, board):
    page = client.get("/api/drafters").json()
    slugs = {d["slug"] for d in page["items"]}
    assert page["count"] == 5 and board["hidden"].slug not in slugs
    assert board["eagle"].slug in slugs
    eagles = client.get("/api/drafters", {"method": "eagle"}).json()["items"]
    assert [d["slug"] for d in eagles] == ["eagle-head"]
    withdrawn = client.get("/api/drafters", {"review_state": "withdrawn"}).json()["items"]
    assert [d["slug"] for d in withdrawn] == [board["hidden"].slug]
    mine = client.get("/api/drafters", {"owner": "owner"}).json()
    assert mine["count"] == 3
    detail = client.get("/api/drafters/eagle-head").json()
    assert set(detail["drafter"]) == set(eagles[0])  # one shape, list or detail
    assert detail["drafter"]["target"] == {"slug": board["target"].slug,
                                           "name": board["target"].name}
    assert [r["id"] for r in detail["runs"]] == [board["eagle_run"].pk]
    assert client.get("/api/drafters/nobody").status_code == 404


def test_runs_show_state_progress_queue_position_and_error(client, board, media):
    queued_later = f.make_run(board["main"], board["eagle"], state=Run.QUEUED)
    running = f.make_run(board["main"], board["seeded"]["drafters"][1], state=Run.RUNNING,
                         cells_done=3, eta_seconds=95)
    one = client.get(f"/api/runs/{board['queued'].pk}").json()
    assert one["state"] == "queued" and one["position"] == 1
    later = client.get(f"/api/runs/{queued_later.pk}").json()
    assert later["position"] == 2 and later["drafter"]["slug"] == "eagle-head"
    r = client.get(f"/api/runs/{running.pk}").json()
    assert (r["cells_done"], r["cells_total"], r["eta_seconds"]) == (3, 8, 95)
    assert r["progress"] == pytest.approx(3 / 8) and r["position"] is None
    failed = client.get(f"/api/runs/{board['failed'].pk}").json()
    assert failed["error"] == "CUDA out of memory (test)"
    assert failed["log_tail"] == "Traceback: boom"
    page = client.get("/api/runs", {"state": "queued"}).json()
    assert page["count"] == 2
    assert {x["id"]: x["position"] for x in page["items"]} == {board["queued"].pk: 1,
                                                               queued_later.pk: 2}
    baselines = client.get("/api/runs", {"baseline": "true"}).json()
    assert {x["protocol"]["slug"] for x in baselines["items"]} == {"pages", "other",
                                                                    "b-protocol"}
    assert all(x["is_baseline"] for x in baselines["items"])
    other = client.get("/api/runs", {"protocol": "other@1"}).json()
    assert other["count"] == 3  # its baseline, its drafter and the failed run
    assert client.get("/api/runs/999999").status_code == 404


def test_a_run_artifact_downloads_through_the_storage_or_404s_with_a_reason(client, board,
                                                                             media):
    run = board["eagle_run"]
    response = client.get(f"/api/runs/{run.pk}/artifact")
    assert response.status_code == 404
    assert "no raw data yet" in problems(response)[0]["message"]
    raw = gzip.compress(b'{"prompt_id": "a", "output_token_ids": [1, 2]}\n')
    run.artifact = default_storage.save(f"runs/{run.pk}/requests.jsonl.gz", ContentFile(raw))
    run.save(update_fields=["artifact"])
    response = client.get(f"/api/runs/{run.pk}/artifact")
    assert response.status_code == 200
    assert b"".join(response.streaming_content) == raw
    assert f"specboard-run-{run.pk}-requests.jsonl.gz" in response["Content-Disposition"]
    listed = client.get(f"/api/runs/{run.pk}").json()
    assert listed["artifact_url"] == f"/api/runs/{run.pk}/artifact"
    assert client.get("/api/runs/999999/artifact").status_code == 404


def expected_ids(**lookups):
    """Result ids by a plain ORM query (not the API's selector)."""
    return set(Result.objects.exclude(run__drafter__review_state="withdrawn")
               .filter(**lookups).values_list("id", flat=True))


FILTERS = {
    "protocol slug": ({"protocol": "other"}, {"run__protocol__slug": "other"}),
    "protocol slug@version": ({"protocol": "pages@1"}, {"run__protocol__slug": "pages"}),
    "protocol and version": ({"protocol": "other", "version": 1},
                             {"run__protocol__slug": "other"}),
    "target": ({"target": "tiny"}, {"run__protocol__target__slug": "tiny"}),
    "drafter": ({"drafter": "eagle-head"}, {"run__drafter__slug": "eagle-head"}),
    "method": ({"method": "eagle"}, {"run__drafter__method": "eagle"}),
    "method baseline": ({"method": "baseline"}, {"run__drafter__isnull": True}),
    "task": ({"task": "code"}, {"task": "code"}),
    "batch size": ({"batch_size": 4}, {"batch_size": 4}),
    "temperature": ({"temperature": 0.7}, {"temperature": 0.7}),
    "k": ({"k": 4}, {"k": 4}),
    "several": ({"protocol": "pages", "task": "chat", "batch_size": 1, "k": 2},
                {"run__protocol__slug": "pages", "task": "chat", "batch_size": 1, "k": 2}),
}


@pytest.mark.parametrize("name", list(FILTERS))
def test_each_results_filter_selects_exactly_the_matching_cells(client, board, name):
    params, lookups = FILTERS[name]
    everything = expected_ids()
    want = expected_ids(**lookups)
    assert want and want != everything  # the filter has something to leave out
    count, items = all_pages(client, **params)
    assert count == len(items) == len(want)
    assert {r["id"] for r in items} == want


def test_results_filter_by_run_state_and_unknown_values(client, board):
    Run.objects.filter(pk=board["eagle_run"].pk).update(state=Run.RUNNING)
    running = client.get("/api/results", {"run_state": "running", "limit": 1000}).json()
    assert {r["run_id"] for r in running["items"]} == {board["eagle_run"].pk}
    assert client.get("/api/results", {"run": board["eagle_run"].pk}).json()["count"] == 8
    assert client.get("/api/results", {"protocol": "nope"}).json()["count"] == 0
    assert client.get("/api/results", {"version": 2}).json()["count"] == 0
    for bad in ({"batch_size": 0}, {"batch_size": 2 ** 40}, {"limit": 5000},
                {"temperature": "nan"}, {"method": "magic"}, {"protocol": "x@y"},
                {"task": "a\x00b"}, {"format": "xml"}):
        response = client.get("/api/results", bad)
        assert response.status_code == 422, bad
        (p,) = problems(response)
        assert p["file"] == "(query)" and p["field"] == next(iter(bad))


def test_result_rows_carry_provenance_and_the_metrics_figures(client, board):
    rows = client.get("/api/results", {"limit": 1000}).json()["items"]
    hidden_runs = set(Run.objects.filter(drafter=board["hidden"]).values_list("pk", flat=True))
    assert rows and not {r["run_id"] for r in rows} & hidden_runs
    keys = [(r["run_id"], r["task"], r["batch_size"], r["temperature"], r["k"]) for r in rows]
    assert keys == sorted(keys)  # grid order
    for row in rows:
        run = Run.objects.select_related("protocol", "drafter").get(pk=row["run_id"])
        assert (row["protocol"], row["protocol_version"], row["protocol_sha256"]) == (
            run.protocol.slug, run.protocol.version, run.protocol.sha256)
        assert (row["engine_version"], row["hardware"]) == (run.engine_version, run.hardware)
        assert row["method"] == (run.drafter.method if run.drafter else "baseline")
        counts = metrics.SpecCounts(row["drafts"], row["draft_tokens"],
                                    row["accepted_tokens"], row["accepted_at"])
        assert row["acceptance_length"] == metrics.acceptance_length(counts)
        assert row["acceptance_rate"] == metrics.acceptance_rate(counts)
        assert row["per_position_acceptance"] == pytest.approx(
            metrics.per_position_acceptance(counts))
        assert row["output_throughput"] == pytest.approx(
            metrics.output_throughput(row["generated_tokens"], row["wall_seconds"]))
        if row["baseline_result_id"]:
            base = Result.objects.get(pk=row["baseline_result_id"])
            assert row["speedup"] == pytest.approx(
                metrics.speedup(row["output_throughput"], base.output_throughput))


# ---- export -------------------------------------------------------------------------

def csv_rows(response):
    text = b"".join(response.streaming_content).decode()
    reader = csv.reader(io.StringIO(text))
    header = next(reader)
    return header, list(reader)


def same_value(text, value):
    """A CSV cell holds the JSON value: empty for null, JSON for lists, else its text."""
    if value is None:
        return text == ""
    if isinstance(value, list):
        return json.loads(text) == value
    if isinstance(value, bool):
        return text == str(value)
    if isinstance(value, (int, float)):
        return type(value)(text) == value
    return text == value


@pytest.mark.parametrize("csv_by_copy", [True, False], ids=["copy", "csv.writer"])
@pytest.mark.parametrize("params", [{}, {"protocol": "pages@1"}, {"protocol": "other",
                                                                   "temperature": 0.7}])
def test_csv_and_json_exports_hold_the_same_rows_as_the_pages(client, board, params,
                                                              csv_by_copy, monkeypatch):
    """On PostgreSQL the database writes the CSV (COPY), unless turned off; elsewhere
    csv.writer does. Either way the CSV holds the JSON's values."""
    monkeypatch.setattr(api_results, "CSV_BY_COPY", csv_by_copy)
    count, paged = all_pages(client, **params)
    as_csv = client.get("/api/results", {**params, "format": "csv"})
    as_json = client.get("/api/results", {**params, "format": "json"})
    assert as_csv.status_code == as_json.status_code == 200
    assert as_csv.streaming and as_json.streaming
    assert as_csv["Content-Type"].startswith("text/csv")
    header, rows = csv_rows(as_csv)
    exported = json.loads(b"".join(as_json.streaming_content))
    assert exported == paged and len(rows) == count > 0
    assert header == list(results.RESULT_COLUMNS)
    for row, obj in zip(rows, exported):
        assert list(obj) == header
        bad = [c for c, text in zip(header, row) if not same_value(text, obj[c])]
        assert bad == [], (bad, row, obj)


def test_export_file_names_name_the_protocol_and_the_date(client, board):
    today = timezone.now().date().isoformat()
    cases = {(("protocol", "pages@1"),): f"specboard-results-pages-v1-{today}.csv",
             (("protocol", "other"), ("version", 1)): f"specboard-results-other-v1-{today}.csv",
             (("protocol", "pages"),): f"specboard-results-pages-{today}.csv",
             (): f"specboard-results-all-protocols-{today}.csv"}
    for params, name in cases.items():
        response = client.get("/api/results", {**dict(params), "format": "csv"})
        assert response["Content-Disposition"] == f'attachment; filename="{name}"'
    response = client.get("/api/results", {"protocol": "pages@1", "format": "json"})
    assert response["Content-Disposition"].endswith(f'specboard-results-pages-v1-{today}.json"')


def test_the_export_is_written_in_chunks_not_all_at_once(client, board, monkeypatch):
    monkeypatch.setattr(api_results, "ROWS_PER_WRITE", 5)
    monkeypatch.setattr(api_results, "COPY_BLOCK_BYTES", 5 * 500)  # rows are ~600 bytes
    total = client.get("/api/results").json()["count"]
    for fmt in ("csv", "json"):
        chunks = list(client.get("/api/results", {"format": fmt}).streaming_content)
        assert len(chunks) >= total // 5, fmt


# ---- writes: auth and permissions ------------------------------------------------------

def test_writes_need_a_valid_unrevoked_token(client, users, board):
    run = board["queued"]
    url = f"/api/runs/{run.pk}/cancel"
    no_token = client.post(url)
    assert no_token.status_code == 401 and no_token["WWW-Authenticate"].startswith("Bearer")
    assert problems(no_token)[0]["field"] == "Authorization"
    assert client.post(url, headers={"Authorization": "Basic b3duZXI6cHc="}).status_code == 401
    assert client.post(url, headers=bearer("sb_not-a-token")).status_code == 401
    owner, token = users["owner"]
    assert client.get("/api/me", headers=bearer(token)).json() == {"username": "owner",
                                                                  "is_staff": False}
    row = ApiToken.objects.get(token_sha256=ApiToken.hash(token))
    assert tokens.revoke_token(owner, row.pk)
    revoked = client.post(url, headers=bearer(token))
    assert revoked.status_code == 401 and "revoked" in problems(revoked)[0]["message"]
    _, staff_token = users["staff"]
    User.objects.filter(username="staff").update(is_active=False)
    assert client.get("/api/me", headers=bearer(staff_token)).status_code == 401
    run.refresh_from_db()
    assert run.state == Run.QUEUED


def test_only_the_owner_or_staff_may_cancel_a_run(client, users, board):
    queued = board["queued"]  # owned by "owner"
    other = client.post(f"/api/runs/{queued.pk}/cancel", headers=bearer(users["other"][1]))
    assert other.status_code == 403 and problems(other)[0]["field"] == "owner"
    queued.refresh_from_db()
    assert queued.state == Run.QUEUED
    mine = client.post(f"/api/runs/{queued.pk}/cancel", headers=bearer(users["owner"][1]))
    assert mine.status_code == 200 and mine.json()["state"] == "cancelled"
    again = client.post(f"/api/runs/{queued.pk}/cancel", headers=bearer(users["owner"][1]))
    assert again.status_code == 409
    running = f.make_run(board["main"], board["eagle"], state=Run.RUNNING)
    response = client.post(f"/api/runs/{running.pk}/cancel", headers=bearer(users["owner"][1]))
    assert response.json()["state"] == "running" and response.json()["cancel_requested"]
    base = f.make_run(board["main"], None, state=Run.QUEUED)
    assert client.post(f"/api/runs/{base.pk}/cancel",
                       headers=bearer(users["owner"][1])).status_code == 403
    staff = client.post(f"/api/runs/{base.pk}/cancel", headers=bearer(users["staff"][1]))
    assert staff.status_code == 200 and staff.json()["state"] == "cancelled"
    assert client.post("/api/runs/999999/cancel",
                       headers=bearer(users["owner"][1])).status_code == 404


def test_only_the_owner_or_staff_may_withdraw_a_drafter(client, users, board):
    eagle = board["eagle"]
    pending = f.make_run(board["main"], eagle, state=Run.QUEUED)
    before = client.get("/api/results", {"drafter": "eagle-head"}).json()["count"]
    assert before > 0
    url = f"/api/drafters/{eagle.slug}/withdraw"
    assert client.post(url, headers=bearer(users["other"][1])).status_code == 403
    assert Drafter.objects.get(pk=eagle.pk).review_state == "approved"
    response = client.post(url, headers=bearer(users["owner"][1]))
    assert response.status_code == 200
    assert response.json()["drafter"]["review_state"] == "withdrawn"
    assert response.json()["runs_cancelled"] == 1
    pending.refresh_from_db()
    assert pending.state == Run.CANCELLED
    assert client.get("/api/results", {"drafter": "eagle-head"}).json()["count"] == 0
    staff = client.post(f"/api/drafters/{board['seeded']['drafters'][0].slug}/withdraw",
                        headers=bearer(users["staff"][1]))
    assert staff.status_code == 200
    assert client.post("/api/drafters/nope/withdraw",
                       headers=bearer(users["owner"][1])).status_code == 404


# ---- writes: submission ---------------------------------------------------------------

def upload(name, data):
    return SimpleUploadedFile(name, data, content_type="application/octet-stream")


def submission(method="ngram", name="cli ngram", **extra):
    data = {"protocol": "pages@1", "method": method, "name": name}
    if method == "ngram":
        data.update(prompt_lookup_min="1", prompt_lookup_max="3")
    data.update(extra)
    return data


def stored(media):
    return [p for p in media.rglob("*") if p.is_file()] if media.exists() else []


def checked(client, response, token):
    """The 202's submission after the intake task's body has checked it, read back through
    GET /api/submissions/{id} as a client polls it."""
    assert response.status_code == 202, response.content
    body = response.json()
    assert body["state"] == "checking" and body["position"] >= 1
    f.submitted(response)
    return client.get(f"/api/submissions/{body['id']}", headers=bearer(token)).json()


def test_submit_an_ngram_drafter_and_follow_its_run(users, board, media):
    from django.test import Client

    client = Client(enforce_csrf_checks=True)  # a token client sends no CSRF cookie
    token = users["owner"][1]
    response = client.post("/api/drafters", submission(), headers=bearer(token))
    assert response.status_code == 202 and not Drafter.objects.filter(name="cli ngram").exists()
    body = checked(client, response, token)
    assert body["state"] == "accepted" and body["problems"] == [] and body["position"] is None
    drafter = Drafter.objects.get(slug=body["drafter"]["slug"])
    assert drafter.owner.username == "owner" and drafter.params == {
        "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    run = client.get(f"/api/runs/{body['run']['id']}").json()
    assert run["state"] == "queued" and run["drafter"]["slug"] == drafter.slug
    assert run["position"] == 2  # after the board's queued run
    # another user (not staff) cannot read it, and the list is one's own
    other = client.get(f"/api/submissions/{body['id']}", headers=bearer(users["other"][1]))
    assert other.status_code == 404
    mine = client.get("/api/submissions", headers=bearer(token)).json()
    assert [s["id"] for s in mine["items"]] == [body["id"]] and mine["checking"] == 0
    assert client.get("/api/submissions", headers=bearer(users["other"][1])).json()["items"] == []


def test_submit_a_draft_model_checkpoint(client, users, board, media):
    token = users["other"][1]
    files = [upload("config.json", tiny_config()), upload("model.safetensors", tiny_weights())]
    response = client.post("/api/drafters", {**submission("draft_model", "tiny draft"),
                                             "files": files}, headers=bearer(token))
    assert [f["name"] for f in response.json()["files"]] == ["config.json", "model.safetensors"]
    body = checked(client, response, token)
    assert body["state"] == "accepted", body
    drafter = Drafter.objects.get(slug=body["drafter"]["slug"])
    assert sorted(drafter.files.values_list("name", flat=True)) == ["config.json",
                                                                    "model.safetensors"]
    page = client.get(f"/api/drafters/{drafter.slug}").json()
    assert page["drafter"]["total_bytes"] == sum(drafter.files.values_list("size", flat=True))
    # the same content again under the same protocol: refused, naming the first one
    again = client.post("/api/drafters", {
        **submission("draft_model", "copy"),
        "files": [upload("config.json", tiny_config()),
                  upload("model.safetensors", tiny_weights())]}, headers=bearer(token))
    refused = checked(client, again, token)
    assert refused["state"] == "refused" and refused["drafter"] is None
    assert drafter.slug in refused["problems"][0]["message"]


@pytest.mark.parametrize("case", ["form", "protocol", "method", "ngram files", "hub"])
def test_what_is_refused_at_once_is_a_422_naming_the_field(client, users, board, media, case):
    data = {
        "form": submission(claimed_speedup="2.0"),
        "protocol": submission(protocol="nope@3"),
        "method": submission(method="magic"),
        "ngram files": {**submission(), "files": [upload("config.json", tiny_config())]},
        "hub": submission("draft_model", hub_reference="not a repo"),
    }[case]
    want = {"form": ("(form)", "claimed_source"),
            "protocol": ("(form)", "protocol"),
            "method": ("(form)", "method"),
            "ngram files": ("config.json", "method"),
            "hub": ("(hub)", "hub_reference")}[case]
    response = client.post("/api/drafters", data, headers=bearer(users["owner"][1]))
    assert response.status_code == 422, response.content
    assert want in {(p["file"], p["field"]) for p in problems(response)}
    assert not Submission.objects.exists() and stored(media) == []


@pytest.mark.parametrize("case", ["pickle", "wrong vocab"])
def test_a_refused_checkpoint_is_a_refused_submission_naming_the_file_and_field(
        client, users, board, media, case):
    files = {
        "pickle": [upload("config.json", tiny_config()), upload("model.pt", b"\x80\x04")],
        "wrong vocab": [upload("config.json", tiny_config(vocab_size=32)),
                        upload("model.safetensors", tiny_weights(vocab=32))],
    }[case]
    want = {"pickle": ("model.pt", "extension"), "wrong vocab": ("config.json", "vocab_size")}
    token = users["owner"][1]
    response = client.post("/api/drafters", {**submission("draft_model"), "files": files},
                           headers=bearer(token))
    body = checked(client, response, token)
    assert body["state"] == "refused"
    assert want[case] in {(p["file"], p["field"]) for p in body["problems"]}
    assert Drafter.objects.filter(name="cli ngram").count() == 0
    assert not DrafterFile.objects.exists() and stored(media) == []


def test_an_upload_over_the_size_limit_is_a_413(client, users, board, media, settings):
    settings.SPECBOARD_MAX_UPLOAD_BYTES = 2000
    token = users["owner"][1]
    # over the limit by its declared length: refused before the body is read
    big = upload("model.safetensors", b"\0" * (FORM_OVERHEAD_BYTES + 4000))
    response = client.post("/api/drafters", {**submission("draft_model"),
                                              "files": [upload("config.json", tiny_config()),
                                                        big]},
                           headers=bearer(token))
    assert response.status_code == 413
    assert problems(response)[0]["field"] == "size"
    # under the declared-length check, over the limit once read: the checkpoint's own check
    response = client.post("/api/drafters", {**submission("draft_model"),
                                              "files": [upload("config.json", tiny_config()),
                                                        upload("model.safetensors",
                                                               tiny_weights())]},
                           headers=bearer(token))
    body = checked(client, response, token)
    assert body["state"] == "refused"
    assert ("model.safetensors", "size") in {(p["file"], p["field"]) for p in body["problems"]}
    assert not DrafterFile.objects.exists() and stored(media) == []


def test_submissions_over_the_daily_limit_are_a_429(client, users, board, media, settings):
    settings.SPECBOARD_SUBMISSIONS_PER_DAY = 1  # "other" owns no drafter yet
    ok = client.post("/api/drafters", submission(name="one"), headers=bearer(users["other"][1]))
    assert ok.status_code == 202
    refused = client.post("/api/drafters", submission(name="two", prompt_lookup_min="2"),
                          headers=bearer(users["other"][1]))
    assert refused.status_code == 429
    (p,) = problems(refused)
    assert p["field"] == "rate limit" and "SPECBOARD_SUBMISSIONS_PER_DAY" in p["message"]
    assert not Submission.objects.filter(name="two").exists()
    staff = client.post("/api/drafters", submission(name="staff two", prompt_lookup_min="2"),
                        headers=bearer(users["staff"][1]))
    assert staff.status_code == 202  # staff are not limited


# ---- fuzz ---------------------------------------------------------------------------

FUZZ_EXAMPLES = 25


def fuzz(operation, mode, headers, checks, fix=None):
    """Run FUZZ_EXAMPLES generated requests (each changed by `fix` first, if given);
    returns (requests made, failures)."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings as hsettings
    from hypothesis.errors import Unsatisfiable

    made, failures = [], []  # made: the status of each answer

    @hsettings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
               suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    @given(case=operation.as_strategy(generation_mode=mode, headers=headers))
    def run(case):
        if fix is not None:
            fix(case)
        response = case.call()
        made.append(response.status_code)
        if response.status_code >= 500:
            failures.append((case.as_curl_command(), response.status_code, response.text[:3000]))
        elif mode == schemathesis.GenerationMode.POSITIVE:
            try:
                case.validate_response(response, checks=checks)
            except Exception as e:  # noqa: BLE001 - collected and shown by the test
                failures.append((case.as_curl_command(), response.status_code, str(e)[:3000]))

    try:
        run()
    except Unsatisfiable:  # nothing to make invalid (an operation without parameters)
        assert mode == schemathesis.GenerationMode.NEGATIVE and not made
    return made, failures


@pytest.fixture
def wsgi_requests_keep_the_test_connection():
    """Django closes the database connection at the end of each request; the test client
    turns that off (the test's transaction lives on the connection), and so does this for
    requests sent straight to the WSGI application."""
    from django.core import signals
    from django.db import close_old_connections

    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    yield
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)


def real_values(board, artifact_run):
    """Per operation, a change that points a generated request at existing objects (random
    slugs and ids hardly ever hit one), so that real answers are checked too."""
    def path(**values):
        def fix(case):
            case.path_parameters = {**(case.path_parameters or {}), **values}
        return fix

    def fewer_filters(case):  # random filter values match nothing: keep the harmless ones
        case.query = {k: v for k, v in (case.query or {}).items()
                      if k in ("limit", "offset", "format", "run_state", "state")}

    def valid_ngram(case):  # generated name, description and licence; the rest valid
        body = case.body if isinstance(case.body, dict) else {}
        case.body = {k: body[k] for k in ("name", "description", "licence") if k in body}
        case.body.update(protocol="pages@1", method="ngram", prompt_lookup_min=1,
                         prompt_lookup_max=1 + len(case.body.get("name", "")) % 16)

    def recommend_pages(case):  # the existing protocol and a valid mix; generated b, T
        query = case.query or {}
        case.query = {"protocol": "pages@1", "mix": "chat:1,code:2",
                      **{k: query[k] for k in ("batch_size",) if k in query}}
        case.query.setdefault("batch_size", 1)

    return {
        "GET /api/protocols/{slug}/{version}": path(slug="pages", version=1),
        "GET /api/protocols/{slug}/{version}/analysis": path(slug="pages", version=1),
        "GET /api/recommend": recommend_pages,
        "GET /api/drafters/{slug}": path(slug=board["eagle"].slug),
        "GET /api/runs/{run_id}": path(run_id=board["queued"].pk),
        "GET /api/runs/{run_id}/artifact": path(run_id=artifact_run.pk),
        "POST /api/runs/{run_id}/cancel": path(run_id=board["queued"].pk),
        "POST /api/drafters/{slug}/withdraw": path(slug=board["eagle"].slug),
        "POST /api/drafters": valid_ngram,
        "GET /api/results": fewer_filters,
        "GET /api/runs": fewer_filters,
        "GET /api/drafters": fewer_filters,
    }


def test_no_generated_request_makes_any_endpoint_fail(board, users, media, settings,
                                                     wsgi_requests_keep_the_test_connection):
    """Schemathesis generates valid and invalid requests for every operation of
    /api/openapi.json (with and without a token): none may answer 5xx, and every answer to
    a valid request matches its documented status, content type and schema."""
    import schemathesis
    from schemathesis.specs.openapi import checks

    from leaderboard.wsgi import application

    settings.SPECBOARD_MAX_UPLOAD_BYTES = 64 * 1024
    settings.SPECBOARD_SUBMISSIONS_PER_DAY = 0  # no limit: submissions go deep
    schema = schemathesis.openapi.from_wsgi("/api/openapi.json", application)
    token = users["owner"][1]
    conformance = [checks.status_code_conformance, checks.content_type_conformance,
                   checks.response_schema_conformance]
    artifact_run = board["seeded"]["baseline"]
    artifact_run.artifact = default_storage.save("runs/fuzz.jsonl.gz", ContentFile(b"x"))
    artifact_run.save(update_fields=["artifact"])
    fixes = real_values(board, artifact_run)
    tried, failures = {}, []
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.label in fixes:  # generated data around existing objects
            key = f"{operation.label} [positive, existing objects]"
            tried[key], found = fuzz(operation, schemathesis.GenerationMode.POSITIVE,
                                     bearer(token), conformance, fixes[operation.label])
            failures += [(key, *x) for x in found]
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            for headers in (bearer(token), None):
                if headers is None and not operation.definition.raw.get("security"):
                    continue
                key = f"{operation.label} [{mode.value}{'' if headers else ', no token'}]"
                tried[key], found = fuzz(operation, mode, headers, conformance)
                failures += [(key, *x) for x in found]
    tried = {k: made for k, made in tried.items() if made}
    total = sum(map(len, tried.values()))
    print(f"\nschemathesis: {total} requests over {len(tried)} operation/mode pairs, "
          f"{len(failures)} failures")
    for key, made in tried.items():
        print(f"  {key}: {len(made)} requests, statuses {dict(sorted(Counter(made).items()))}")
    assert total >= 10 * len(tried)
    for key, made in tried.items():  # the existing objects were found
        if "existing" in key and "artifact" not in key:
            assert any(200 <= code < 300 for code in made), key
    assert failures == [], "\n\n".join(map(str, failures[:5]))
