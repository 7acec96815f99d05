"""Request-body caps (issue #31, build item 4): every request body is refused over its limit
before anything reads it, the CSRF check included; uploads (POST /submit/, POST
/api/drafters) by SPECBOARD_MAX_UPLOAD_BYTES, everything else by SPECBOARD_MAX_REQUEST_BYTES;
a body without a Content-Length (chunked) is a 411. The rule through Django's test client;
what a client really gets (413, 411, 429: never a 500, never a wait) from a real runserver
(`make run`) and a real gunicorn (the Docker image), spoken to in raw HTTP."""
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlencode

import pytest
from django.test import Client
from django.urls import reverse

from leaderboard.middleware import FORM_OVERHEAD_BYTES
from worker.processes import stop_process_group

ROOT = Path(__file__).resolve().parent.parent
GIB = 1024 ** 3
MIB = 1024 ** 2
HUGE = 100 * GIB


# ---- the rule (Django's test client) -------------------------------------------------------

def csrf_client():
    """A client whose requests go through the CSRF check (the test client skips it
    otherwise), with a valid CSRF cookie: the check reads request.POST."""
    client = Client(enforce_csrf_checks=True)
    client.get(reverse("login"))
    return client, client.cookies["csrftoken"].value


def announced(client, path, length, token="", **extra):
    """A POST that announces `length` bytes of multipart body and carries none: reading it
    fails (the test client's payload asserts), so any answer but a 413 means it was read."""
    return client.generic("POST", path, b"", CONTENT_LENGTH=str(length),
                          CONTENT_TYPE="multipart/form-data; boundary=x",
                          HTTP_X_CSRFTOKEN=token, **extra)


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/accounts/login/", "/accounts/signup/", "/"])
def test_a_body_over_the_general_cap_is_a_413_before_the_csrf_check_reads_it(path, settings):
    client, token = csrf_client()
    response = announced(client, path, HUGE, token)
    assert response.status_code == 413, response.content[:300]
    assert response["Content-Type"].startswith("text/plain")
    assert "SPECBOARD_MAX_REQUEST_BYTES" in response.content.decode()
    assert "Connection" not in response  # hop-by-hop: a WSGI application may not set it


@pytest.mark.django_db
def test_the_general_cap_is_the_setting_and_a_body_at_it_is_read(settings):
    settings.SPECBOARD_MAX_REQUEST_BYTES = 4000
    client, token = csrf_client()
    body = b"username=nobody&password=" + b"x" * (4000 - 25)
    assert len(body) == 4000
    at_cap = client.generic("POST", reverse("login"), body, HTTP_X_CSRFTOKEN=token,
                            CONTENT_TYPE="application/x-www-form-urlencoded")
    assert at_cap.status_code == 200  # read: the form again, with its error
    over = client.generic("POST", reverse("login"), body + b"x", HTTP_X_CSRFTOKEN=token,
                          CONTENT_TYPE="application/x-www-form-urlencoded")
    assert over.status_code == 413 and "4000" in over.content.decode()


@pytest.mark.django_db
def test_an_api_body_over_the_general_cap_is_a_413_in_the_api_error_shape():
    response = announced(Client(), "/api/drafters/some-drafter/withdraw", HUGE)
    assert response.status_code == 413
    assert response.json()["detail"][0]["field"] == "size"
    assert "SPECBOARD_MAX_REQUEST_BYTES" in response.json()["detail"][0]["message"]


@pytest.mark.django_db
def test_uploads_have_the_upload_limit_not_the_general_cap(settings):
    """Over the general cap but under the upload limit: the submit page and the API's upload
    read the body (anonymous: a redirect to log in, a 401); over the upload limit: 413, on
    the API in its error shape, before the token is even looked at."""
    settings.SPECBOARD_MAX_REQUEST_BYTES = 1000
    settings.SPECBOARD_MAX_UPLOAD_BYTES = 10 * MIB
    body = {"name": "x", "files": [_file("model.safetensors", 2 * MIB)]}
    page = Client().post(reverse("submit"), body)
    assert page.status_code == 302 and reverse("login") in page["Location"]
    api = Client().post("/api/drafters", body)
    assert api.status_code == 401
    over = 10 * MIB + FORM_OVERHEAD_BYTES + 1
    page = announced(Client(), reverse("submit"), over)
    assert page.status_code == 413 and "SPECBOARD_MAX_UPLOAD_BYTES" in page.content.decode()
    api = announced(Client(), "/api/drafters", over)
    assert api.status_code == 413
    assert api.json()["detail"][0] | {"message": ""} == {
        "file": "(upload)", "member": None, "field": "size", "message": ""}
    # only POST is an upload: any other method there has the general cap
    assert Client().generic("PUT", "/api/drafters", b"x" * 1001).status_code == 413


def _file(name, size):
    from django.core.files.uploadedfile import SimpleUploadedFile

    return SimpleUploadedFile(name, b"\0" * size)


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/accounts/login/", "/api/drafters"])
def test_a_chunked_body_is_a_411_unread(path):
    client, token = csrf_client()
    response = client.generic("POST", path, b"", HTTP_TRANSFER_ENCODING="chunked",
                              CONTENT_TYPE="multipart/form-data; boundary=x",
                              HTTP_X_CSRFTOKEN=token)
    assert response.status_code == 411
    assert "Content-Length" in response.content.decode()


def test_the_general_cap_is_read_from_the_environment():
    done = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c",
         "from django.conf import settings; print(settings.SPECBOARD_MAX_REQUEST_BYTES)"],
        cwd=ROOT, env=dict(os.environ, SPECBOARD_MAX_REQUEST_BYTES="12345"),
        capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "12345", done.stdout + done.stderr


# ---- real servers, raw HTTP ----------------------------------------------------------------

PASSWORD = "a long enough password 31"
# Each live test speaks from its own loopback address (Linux answers on all of 127/8): the
# log-in throttle counts per client address (and per user name), so no test's attempts count
# against another's.
ADDRESSES = iter(f"127.0.0.{n}" for n in range(2, 250))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dir_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


class Server:
    """`manage.py runserver` (what `make run` starts) or gunicorn (the Docker image's web
    server) on a free port, with its own SQLite database and its own temporary folder
    (TMPDIR: where Django spools a multipart body's files)."""

    def __init__(self, kind, folder: Path, env):
        self.port = free_port()
        self.tmp = folder / f"tmp-{kind}"
        self.tmp.mkdir()
        self.log = open(folder / f"{kind}.log", "wb")
        cmd = {"runserver": ["manage.py", "runserver", "--noreload", f"127.0.0.1:{self.port}"],
               "gunicorn": ["-m", "gunicorn", "leaderboard.wsgi", "-b",
                            f"127.0.0.1:{self.port}", "-w", "1"]}[kind]
        self.proc = subprocess.Popen([sys.executable, *cmd], cwd=ROOT,
                                     env=dict(env, TMPDIR=str(self.tmp)),
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        for _ in range(120):
            try:
                if request(self, "GET", "/accounts/login/", timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            assert self.proc.poll() is None, self.output()
            time.sleep(0.5)
        raise AssertionError(f"{kind} did not answer: {self.output()}")

    def output(self):
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    def stop(self):
        stop_process_group(self.proc)
        self.log.close()


def connect(server, source="127.0.0.1", timeout=10):
    return socket.create_connection(("127.0.0.1", server.port), timeout=timeout,
                                    source_address=(source, 0))


def head(method, path, port, headers: dict):
    lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}",
             *(f"{k}: {v}" for k, v in headers.items()), "", ""]
    return "\r\n".join(lines).encode()


def read_response(sock):
    """(status, headers, body) of one response; the body by its Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a full response head: {data!r}")
        data += chunk
    top, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = top.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        k, _, v = line.partition(":")
        headers.setdefault(k.strip().lower(), []).append(v.strip())
    length = int(headers.get("content-length", ["0"])[0])
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(status_line.split()[1]), headers, body


def request(server, method, path, headers=None, body=b"", source="127.0.0.1", timeout=10):
    headers = dict(headers or {})
    if body:
        headers["Content-Length"] = str(len(body))
    with connect(server, source, timeout) as sock:
        sock.sendall(head(method, path, server.port, headers) + body)
        return read_response(sock)


def cookies(headers) -> dict:
    out = {}
    for line in headers.get("set-cookie", []):
        name, _, rest = line.partition("=")
        out[name] = rest.split(";")[0]
    return out


def login_form(server, source):
    """The CSRF cookie and the form's token, as a browser gets them."""
    status, headers, body = request(server, "GET", "/accounts/login/", source=source)
    assert status == 200
    token = re.search(rb'name="csrfmiddlewaretoken" value="([^"]+)"', body).group(1).decode()
    return cookies(headers)["csrftoken"], token


def post_login(server, source, username, password):
    csrf_cookie, token = login_form(server, source)
    body = urlencode({"csrfmiddlewaretoken": token, "username": username,
                      "password": password}).encode()
    return request(server, "POST", "/accounts/login/", {
        "Cookie": f"csrftoken={csrf_cookie}",
        "Content-Type": "application/x-www-form-urlencoded"}, body, source=source)


def answer_before_body(server, path, headers, body_chunk, source, wait_s=5,
                       meanwhile=lambda: None):
    """Send a request head that announces a body, and wait for the answer before sending
    any of it (a server that refuses an unread body answers at once). If no answer comes,
    send `body_chunk` (what an attacker sends next) and report what the server did with it:
    (status or None, seconds to answer, bytes in the server's temporary folder).
    `meanwhile` runs after the answer, the connection still open."""
    sock = connect(server, source, timeout=wait_s)
    started = time.monotonic()
    try:
        sock.sendall(head("POST", path, server.port, headers))
        try:
            status = read_response(sock)[0]
            meanwhile()
        except TimeoutError:
            try:
                sock.sendall(body_chunk)
            except OSError:
                pass
            time.sleep(2)
            return None, time.monotonic() - started, dir_bytes(server.tmp)
        return status, time.monotonic() - started, dir_bytes(server.tmp)
    finally:
        sock.close()


@pytest.fixture(scope="module")
def site_env(tmp_path_factory):
    """The environment of the live servers: a migrated SQLite database of their own with one
    user, alice, who has submitted one drafter today (SPECBOARD_SUBMISSIONS_PER_DAY=1)."""
    folder = tmp_path_factory.mktemp("request-limits")
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "DEBUG", "SECRET_KEY", "SPECBOARD_DEPLOYMENT",
                        "SPECBOARD_CACHE_URL", "MEDIA_ROOT")}
    env.update(SPECBOARD_VAR_DIR=str(folder / "var"),
               DATABASE_URL=f"sqlite:///{folder / 'db.sqlite3'}",
               ALLOWED_HOSTS="127.0.0.1", SPECBOARD_LOGIN_FAILURES="3",
               SPECBOARD_SUBMISSIONS_PER_DAY="1", PYTHONUNBUFFERED="1")
    for args in (["migrate", "--noinput"],
                 ["shell", "-c",
                  "from django.contrib.auth.models import User;"
                  "from tests.factories import make_target, make_drafter;"
                  f"alice = User.objects.create_user('alice', password={PASSWORD!r});"
                  "make_drafter(make_target(), 'alice one', owner=alice)"]):
        done = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
    return folder, env


@pytest.fixture(scope="module", params=["runserver", "gunicorn"])
def server(request, site_env):
    folder, env = site_env
    server = Server(request.param, folder, env)
    yield server
    server.stop()


def test_a_huge_anonymous_login_post_is_a_413_at_once_and_nothing_is_spooled(server):
    source = next(ADDRESSES)
    csrf_cookie, _ = login_form(server, source)
    others = []

    def another_client():  # while the refused connection is still open
        others.append(request(server, "GET", "/", timeout=5)[0])

    part = (b"--b\r\nContent-Disposition: form-data; name=\"f\"; filename=\"f.bin\"\r\n"
            b"Content-Type: application/octet-stream\r\n\r\n" + b"\0" * (8 * MIB))
    status, seconds, spooled = answer_before_body(server, "/accounts/login/", {
        "Cookie": f"csrftoken={csrf_cookie}", "X-CSRFToken": csrf_cookie,
        "Content-Type": "multipart/form-data; boundary=b", "Content-Length": str(HUGE)},
        part, source, meanwhile=another_client)
    assert (status, spooled) == (413, 0), (
        f"answer {status} after {seconds:.1f} s; {spooled} bytes in the temporary folder "
        f"after 8 MiB of the body were sent\n{server.output()}")
    assert seconds < 3
    # the server does not hang on the unread body (runserver reads what the client still
    # sends, in its own thread; gunicorn's sync worker closes the connection)
    assert others == [200]


def test_a_huge_upload_is_a_413_not_a_500(server):
    """POST /submit/ (the submit page's own limit): the refusal that used to set
    `Connection: close`, which wsgiref turns into a 500."""
    status, seconds, spooled = answer_before_body(server, "/submit/", {
        "Content-Type": "multipart/form-data; boundary=b", "Content-Length": str(HUGE)},
        b"\0" * MIB, next(ADDRESSES))
    assert (status, spooled) == (413, 0), f"answer {status} after {seconds:.1f} s"


def test_a_chunked_body_over_the_cap_is_refused_unread(server):
    source = next(ADDRESSES)
    csrf_cookie, _ = login_form(server, source)
    chunk = b"\0" * (2 * MIB)
    status, seconds, spooled = answer_before_body(server, "/accounts/login/", {
        "Cookie": f"csrftoken={csrf_cookie}", "X-CSRFToken": csrf_cookie,
        "Content-Type": "multipart/form-data; boundary=b", "Transfer-Encoding": "chunked"},
        b"%x\r\n" % len(chunk) + chunk + b"\r\n", source)
    assert (status, spooled) == (411, 0), (
        f"answer {status} after {seconds:.1f} s; {spooled} bytes spooled\n{server.output()}")


def test_a_normal_login_still_works(server):
    status, headers, _ = post_login(server, next(ADDRESSES), "alice", PASSWORD)
    assert status == 302 and headers["location"] == ["/"]
    assert "sessionid" in cookies(headers)


def test_a_throttled_login_is_a_429(server):
    # django-axes locks the client out at its third failure (SPECBOARD_LOGIN_FAILURES=3).
    source = next(ADDRESSES)
    statuses = [post_login(server, source, f"bob-{source}", "wrong")[0] for _ in range(4)]
    assert statuses == [200, 200, 429, 429], server.output()


def test_a_submission_over_the_daily_limit_is_a_429_unread(server):
    source = next(ADDRESSES)
    _, headers, _ = post_login(server, source, "alice", PASSWORD)
    session = cookies(headers)["sessionid"]
    status, seconds, spooled = answer_before_body(server, "/submit/", {
        "Cookie": f"sessionid={session}", "Content-Type": "multipart/form-data; boundary=b",
        "Content-Length": str(GIB)}, b"\0" * MIB, source)
    assert (status, spooled) == (429, 0), (
        f"answer {status} after {seconds:.1f} s\n{server.output()}")
