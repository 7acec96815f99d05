"""Shared fixtures. Tests use the real services that the environment names
(DATABASE_URL, CELERY_BROKER_URL) and the real demo target, converted once into
SPECBOARD_DATA_DIR (default var/data) and reused across runs."""
import os
from pathlib import Path

import pytest

from worker.processes import stop_process_group

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = Path(os.environ.get("SPECBOARD_SHARED_DATA", ROOT.parent / "shared" / "data"))
ARTIFACTS = Path(os.environ.get("SPECBOARD_TEST_ARTIFACTS", ROOT / "test-artifacts"))


def data_dir() -> Path:
    return Path(os.environ.get("SPECBOARD_DATA_DIR", ROOT / "var" / "data"))


@pytest.fixture(scope="session")
def demo_target_dir() -> Path:
    """The real demo target (SmolLM2-135M-Instruct) as a safetensors checkpoint."""
    from worker.demo_assets import demo_target

    return demo_target(data_dir(), progress=print)


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
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.fail(f"the shared prompt files are missing: expected {SHARED_DATA} "
                    "(set SPECBOARD_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


def database_url_for_subprocess():
    """The URL of the database this test process uses (pytest-django's test database),
    for a Celery worker started by a test."""
    from django.db import connection

    s = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{s['NAME']}"
    auth = s["USER"] + (f":{s['PASSWORD']}" if s["PASSWORD"] else "")
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


class WorkerProcess:
    """A real `celery -A leaderboard worker` in its own process group."""

    def __init__(self, queue, log_path, **env):
        import subprocess
        import sys

        self.log_path = log_path
        full_env = dict(os.environ, DATABASE_URL=database_url_for_subprocess(),
                        PYTHONUNBUFFERED="1", **{k: str(v) for k, v in env.items()})
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
