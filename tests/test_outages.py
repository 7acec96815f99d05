"""Outages mid-run, on real services (the two that measure are marked vllm, in the engine
lane of core 1): a PostgreSQL of the test's own (initdb, pg_ctl in a
temporary folder) stopped in the middle of a real vLLM measurement and started again. The run
finishes once with every cell once, nothing restarted; while the database is away the pages
answer 503 with a short page and the API 503 in its error shape."""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from worker.processes import stop_process_group

from .conftest import LOADED_PASSES_KEPT

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pg_bin(name) -> str:
    """initdb or pg_ctl: on PATH, else Debian's (the `postgresql` package that `make test`
    installs keeps them in /usr/lib/postgresql/VERSION/bin), the newest version."""
    versions = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"),
                      key=lambda p: [int(n) for n in p.parts[-3].split(".") if n.isdigit()])
    found = shutil.which(name) or (versions[-1] if versions else None)
    if not found:
        pytest.fail(f"{name} is missing: `make test` installs it (as root), or run "
                    "apt-get install postgresql")
    return str(found)


class OwnPostgres:
    """A PostgreSQL cluster in a folder of its own, on its own port. PostgreSQL refuses to
    run as root, so as root it runs as the `postgres` user."""

    def __init__(self):
        import tempfile

        # A folder of its own under /tmp: pytest's tmp_path is not reachable by `postgres`.
        self.folder, self.port = Path(tempfile.mkdtemp(prefix="specboard-pg-")), _free_port()
        self.data = self.folder / "data"
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            shutil.chown(self.folder, "postgres")
        self._run(_pg_bin("initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres")
        self.url = f"postgres://postgres@127.0.0.1:{self.port}/specboard"

    def _run(self, *args):
        done = subprocess.run([*self.as_user, *args], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    def start(self):
        self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.folder / "log"),
                  "-o", f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1",
                  "-w", "start")

    def stop(self):
        self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def query(self, sql, dbname="specboard"):
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=self.port, user="postgres",
                             dbname=dbname, autocommit=True) as conn:
            return conn.execute(sql).fetchall() if sql.lstrip().upper().startswith(
                "SELECT") else conn.execute(sql)


SETUP = """
from pathlib import Path
from worker.protocol import ProtocolSpec, TaskSpec
from leaderboard.services import setup
target, _ = setup.ensure_target("smollm2", "SmolLM2-135M-Instruct", Path({target!r}))
qa, _ = setup.import_prompt_set({prompts!r}, "mt-bench", slug="qa")
spec = ProtocolSpec(slug="outage", version=1, target=target.slug,
                    target_sha256=target.weights_sha256, engine="vllm", hardware="cpu",
                    tasks=(TaskSpec("qa", "qa", qa.source_sha256, 4),), temperatures=(0.0,),
                    max_new_tokens=48, seed=0, batch_sizes=(1, 2, 4), ks=(2,),
                    warmup_requests=1, repetitions=2, baseline="shared",
                    **{loaded_passes_kept!r})
setup.ensure_protocol(spec, target)
"""

PROBE = """
from django.test import Client
client = Client(raise_request_exception=False)
out = {}
for url in ("/", "/queue/", "/api/runs"):
    r = client.get(url)
    out[url] = [r.status_code, r["Content-Type"], r.content.decode()[:2000]]
import json; print("PROBE" + json.dumps(out))
"""


@pytest.mark.vllm(core=1)
def test_a_database_outage_mid_run_loses_and_doubles_no_cell(tmp_path, demo_target_dir,
                                                            prompt_files):
    pg = OwnPostgres()
    pg.start()
    measuring = None
    try:
        pg.query("CREATE DATABASE specboard", dbname="postgres")
        env = {**os.environ, "DATABASE_URL": pg.url, "SPECBOARD_VAR_DIR": str(tmp_path / "var"),
               "SPECBOARD_DB_OUTAGE_WAIT_S": "300", "SPECBOARD_RUN_STALE_AFTER_S": "600"}

        def manage(*args, timeout=600):
            done = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=timeout)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            return done.stdout

        manage("migrate", "--noinput")
        manage("shell", "-c", SETUP.format(target=str(demo_target_dir),
                                           prompts=str(prompt_files / "mt_bench.jsonl"),
                                           loaded_passes_kept=LOADED_PASSES_KEPT))
        log = open(tmp_path / "measure.log", "w")
        measuring = subprocess.Popen(
            [sys.executable, "manage.py", "measure", "baseline", "--protocol", "outage", "--sync"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if pg.query("SELECT count(*) FROM leaderboard_result")[0][0] >= 1:
                break
            assert measuring.poll() is None, (tmp_path / "measure.log").read_text()[-3000:]
            time.sleep(0.5)
        else:
            pytest.fail("no cell was measured")
        total = pg.query("SELECT cells_total FROM leaderboard_run")[0][0]
        assert total == 3

        pg.stop()
        outage_started = time.monotonic()
        probe = manage("shell", "-c", PROBE, timeout=120)
        answers = json.loads(probe.split("PROBE", 1)[1])
        for url in ("/", "/queue/"):
            status, kind, body = answers[url]
            assert status == 503 and kind.startswith("text/html"), (url, answers[url])
            assert "database does not answer" in body and "Traceback" not in body
        status, kind, body = answers["/api/runs"]
        assert status == 503 and kind.startswith("application/json")
        detail = json.loads(body)["detail"]
        assert detail[0]["field"] == "database" and "unavailable" in detail[0]["message"]
        # Keep the database away until the measurement has reached it (a cell takes 10-50 s,
        # more on a loaded machine; a fixed outage could end before the next write), and a
        # while longer: the measurement waits for it instead of failing.
        measure_log = tmp_path / "measure.log"
        deadline = time.monotonic() + 600
        while "database unavailable" not in measure_log.read_text():
            assert measuring.poll() is None, measure_log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the measurement never reached the database"
            time.sleep(0.5)
        time.sleep(max(5.0, 20 - (time.monotonic() - outage_started)))
        assert measuring.poll() is None, "the measurement gave up during the outage"
        pg.start()

        assert measuring.wait(timeout=900) == 0, (tmp_path / "measure.log").read_text()[-3000:]
        state, attempts, done = pg.query(
            "SELECT state, attempts, cells_done FROM leaderboard_run")[0]
        assert (state, attempts, done) == ("succeeded", 1, total)
        keys = pg.query("SELECT task, batch_size, temperature, k FROM leaderboard_result")
        assert len(keys) == len(set(keys)) == total  # none lost, none doubled
        assert "database unavailable" in (tmp_path / "measure.log").read_text()
    finally:
        if measuring is not None and measuring.poll() is None:
            stop_process_group(measuring)
        try:
            pg.stop()
        except AssertionError:
            pass  # already stopped
        shutil.rmtree(pg.folder, ignore_errors=True)


class OwnRedis:
    """A redis-server of the test's own, with an append-only file, as a production broker
    is configured: what was queued survives a restart."""

    def __init__(self, folder: Path):
        self.folder, self.port = folder, _free_port()
        folder.mkdir(parents=True, exist_ok=True)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None

    def start(self):
        server = shutil.which("redis-server")
        if not server:
            pytest.fail("redis-server is missing: `make test` installs it (as root), or run "
                        "apt-get install redis-server")
        self.proc = subprocess.Popen(
            [server, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
             "--appendonly", "yes", "--save", ""], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        pytest.fail("redis-server did not start")

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            subprocess.run(["redis-cli", "-p", str(self.port), "shutdown"],
                           capture_output=True, timeout=30)
            self.proc.wait(timeout=30)


@pytest.mark.vllm(core=1)
@pytest.mark.django_db(transaction=True)
def test_a_broker_restart_mid_run_loses_no_message_and_finishes_each_run_once(
        tmp_path, demo_target_dir, prompt_files, celery_worker_factory):
    from leaderboard.models import Result, Run
    from leaderboard.services import runs

    from .conftest import subprocess_env
    from .test_celery_runs import tiny_protocol, wait_for_cells, wait_for_state

    redis = OwnRedis(tmp_path / "redis")
    redis.start()
    try:
        protocol, ngram = tiny_protocol(demo_target_dir, prompt_files, batch_sizes=(1, 2, 4),
                                        prompts=4, max_new_tokens=48)
        first = runs.queue_run(protocol, None, send=False)
        second = runs.queue_run(protocol, ngram, send=False)
        env = subprocess_env(CELERY_BROKER_URL=redis.url)
        # Both messages go to this broker; one worker (concurrency 1) takes the first.
        sent = subprocess.run(
            [sys.executable, "manage.py", "shell", "-c",
             "from leaderboard.models import Run; from leaderboard.services import runs; "
             f"[runs.enqueue(Run.objects.get(pk=pk)) for pk in ({first.pk}, {second.pk})]"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert sent.returncode == 0, sent.stderr[-2000:]
        worker = celery_worker_factory(CELERY_BROKER_URL=redis.url)
        wait_for_cells(first, 1, poll_s=0.1, worker=worker)
        redis.stop()  # mid-run; the second run's message waits in the stopped broker
        first.refresh_from_db()
        assert first.state == Run.RUNNING and first.cells_done < first.cells_total
        time.sleep(10)
        redis.start()
        for run in (first, second):
            wait_for_state(run, Run.FINISHED, seconds=900, worker=worker)
            assert run.state == Run.SUCCEEDED, (run.error, run.log_tail, worker.output()[-3000:])
            assert run.attempts == 1
            keys = list(Result.objects.filter(run=run).values_list(
                "task", "batch_size", "temperature", "k"))
            assert len(keys) == len(set(keys)) == run.cells_total
    finally:
        redis.stop()


@pytest.mark.django_db
def test_a_full_disk_during_an_upload_is_a_clear_507_that_stores_nothing(client, settings,
                                                                          tmp_path):
    """The storage (MEDIA_ROOT) on a 1 MiB tmpfs, an upload of 2 MiB: refused with a clear
    message, no file left in the storage, no row."""
    from django.contrib.auth.models import User

    from leaderboard import tokens
    from leaderboard.models import Drafter, DrafterFile, Run

    from . import factories as f
    from .test_submission import HIDDEN, LAYERS, VOCAB, tiny_config

    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a small tmpfs needs root")
    media = tmp_path / "media"
    media.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(media)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        settings.MEDIA_ROOT = media
        settings.SPECBOARD_SUBMISSIONS_PER_DAY = 0
        target = f.make_target(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS)
        f.make_protocol(target, slug="pages", tasks=("chat",), batch_sizes=(1,), ks=(2,))
        token = tokens.create_token(User.objects.create_user("owner"), "t")[1]
        from django.core.files.uploadedfile import SimpleUploadedFile
        import numpy as np
        from safetensors.numpy import save as st_save

        # a one-layer draft model whose MLP is wide enough for 2 MiB of weights
        width = 11000
        z = lambda *shape: np.zeros(shape, dtype=np.float32)  # noqa: E731
        p = "model.layers.0."
        weights = st_save({
            "model.embed_tokens.weight": z(VOCAB, HIDDEN), "model.norm.weight": z(HIDDEN),
            p + "input_layernorm.weight": z(HIDDEN), p + "post_attention_layernorm.weight": z(HIDDEN),
            p + "self_attn.q_proj.weight": z(HIDDEN, HIDDEN), p + "self_attn.k_proj.weight": z(8, HIDDEN),
            p + "self_attn.v_proj.weight": z(8, HIDDEN), p + "self_attn.o_proj.weight": z(HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": z(width, HIDDEN), p + "mlp.up_proj.weight": z(width, HIDDEN),
            p + "mlp.down_proj.weight": z(HIDDEN, width)})
        assert len(weights) > 2 << 20
        response = client.post("/api/drafters", {
            "protocol": "pages@1", "method": "draft_model", "name": "too big for the disk",
            "files": [SimpleUploadedFile("config.json", tiny_config(intermediate_size=width)),
                      SimpleUploadedFile("model.safetensors", weights)]},
            headers={"Authorization": f"Bearer {token}"})
        assert response.status_code in (507, 422), response.content
        if response.status_code == 422:
            pytest.fail(f"refused before the storage was reached: {response.content[:300]}")
        assert "storage is full" in response.json()["detail"][0]["message"]
        assert list(media.rglob("*.*")) == []
        assert (Drafter.objects.count(), DrafterFile.objects.count(), Run.objects.count()) == (
            0, 0, 0)
    finally:
        subprocess.run(["umount", str(media)], capture_output=True)
