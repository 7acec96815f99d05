"""The production set-up as docs/deployment.md documents it: `check --deploy` is clean, and
gunicorn with DEBUG=0 serves pages with their CSS and plotly.js (WhiteNoise, after
collectstatic). Real processes, a throwaway SQLite database."""
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from worker.processes import stop_process_group

ROOT = Path(__file__).resolve().parent.parent


def production_env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "DEBUG", "SECRET_KEY", "SPECBOARD_DEPLOYMENT")}
    env.update(SPECBOARD_DEPLOYMENT="production", DEBUG="0", SECRET_KEY="x" * 60 + "-test",
               SPECBOARD_VAR_DIR=str(tmp_path / "var"),
               DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}",
               ALLOWED_HOSTS="127.0.0.1,localhost")
    env.update(extra)
    return env


def manage(env, *args):
    return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_check_deploy_is_clean_under_the_production_settings(tmp_path):
    done = manage(production_env(tmp_path), "check", "--deploy", "--fail-level", "WARNING")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no issues" in done.stdout


def test_production_refuses_to_start_without_a_secret_key(tmp_path):
    env = production_env(tmp_path)
    del env["SECRET_KEY"]
    done = manage(env, "check")
    assert done.returncode != 0 and "SECRET_KEY must be set" in done.stderr


def test_gunicorn_with_debug_off_serves_pages_with_their_css_and_plotly(tmp_path):
    # Plain HTTP on the loopback: this test is the TLS proxy's side of the connection.
    env = production_env(tmp_path, SPECBOARD_SSL_REDIRECT="0")
    for args in (("migrate", "--noinput"), ("collectstatic", "--noinput")):
        done = manage(env, *args)
        assert done.returncode == 0, done.stdout + done.stderr
    port = 18000 + os.getpid() % 1000
    server = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "leaderboard.wsgi", "-b", f"127.0.0.1:{port}",
         "-w", "1"], cwd=ROOT, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        base = f"http://127.0.0.1:{port}"
        page = None
        for _ in range(120):
            try:
                page = urllib.request.urlopen(base + "/", timeout=5).read().decode()
                break
            except OSError:
                time.sleep(0.5)
        assert page is not None, "gunicorn did not answer"
        css = re.search(r'href="(/static/leaderboard/site\.[0-9a-f]+\.css)"', page)
        assert css, "the page links no hashed site CSS"
        response = urllib.request.urlopen(base + css.group(1), timeout=5)
        assert response.status == 200 and "text/css" in response.headers["Content-Type"]
        plotly_url = manage(env, "shell", "-c",
                            "from django.templatetags.static import static;"
                            "print(static('vendor/plotly.min.js'))").stdout.strip().splitlines()[-1]
        assert re.fullmatch(r"/static/vendor/plotly\.min\.[0-9a-f]+\.js", plotly_url)
        js = urllib.request.urlopen(base + plotly_url, timeout=5)
        assert js.status == 200 and len(js.read()) > 1_000_000
    finally:
        stop_process_group(server)


@pytest.mark.django_db
def test_api_docs_load_swagger_ui_from_the_installed_package_not_a_cdn(client):
    page = client.get("/api/docs").content.decode()
    scripts = re.findall(r'<script[^>]+src="([^"]+)"', page)
    assert any(s.endswith("swagger-ui-bundle.js") for s in scripts), scripts
    assert all(s.startswith("/static/") for s in scripts), scripts
    assert "cdn" not in page.lower()


def test_debug_is_off_unless_asked_for(tmp_path):
    env = production_env(tmp_path, SPECBOARD_DEPLOYMENT="embedded")
    del env["DEBUG"], env["SECRET_KEY"]
    done = manage(env, "shell", "-c", "from django.conf import settings; print(settings.DEBUG)")
    assert done.stdout.strip().splitlines()[-1] == "False", done.stdout + done.stderr
