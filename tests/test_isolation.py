"""The test session owns its world (tests/isolation.py): its var/ (data, broker, host lock,
secret key, media, the SQLite test database) is a temporary folder, never the checkout's
var/; a message it sends lands in its own queue folder or under its own Redis key prefix;
the processes it starts inherit all of it; and the fast tests are collected first."""
import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from .conftest import ROOT, subprocess_env

CHECKOUT_VAR = ROOT / "var"


def _outside_checkout_var(path) -> bool:
    return not Path(path).resolve().is_relative_to(CHECKOUT_VAR.resolve())


def test_the_sessions_paths_are_its_own_var_not_the_checkouts(settings):
    from leaderboard import settings as defaults   # before the per-test overrides

    var = Path(settings.VAR_DIR)
    assert _outside_checkout_var(var) and not var.resolve().is_relative_to(ROOT.resolve())
    broker_folders = [settings.CELERY_BROKER_TRANSPORT_OPTIONS.get(key) for key in
                      ("data_folder_in", "data_folder_out", "processed_folder", "control_folder")]
    paths = {"DATA_DIR": settings.DATA_DIR, "HOST_LOCK": settings.HOST_LOCK,
             "MEDIA_ROOT (default)": defaults.MEDIA_ROOT, "MEDIA_ROOT": settings.MEDIA_ROOT,
             "BROKER_DIR": settings.BROKER_DIR, "STATIC_ROOT": settings.STATIC_ROOT,
             **{f"broker folder {i}": p for i, p in enumerate(broker_folders) if p}}
    assert {name: str(p) for name, p in paths.items() if not _outside_checkout_var(p)} == {}
    # The embedded deployment's key is the one kept in the session's var/.
    key_file = var / "secret_key"
    assert key_file.is_file() and key_file.read_text().strip() == settings.SECRET_KEY
    for name in ("DATA_DIR", "HOST_LOCK", "BROKER_DIR"):
        assert Path(getattr(settings, name)).is_relative_to(var), name


@pytest.mark.django_db
def test_the_test_database_is_not_the_checkouts():
    from django.db import connection

    if connection.vendor == "sqlite":
        assert _outside_checkout_var(connection.settings_dict["NAME"])
    else:   # a server's database: pytest-django's test_ copy, never the site's own
        assert connection.settings_dict["NAME"].startswith("test_")


def test_a_message_sent_by_the_session_lands_in_its_own_queue(settings):
    """Sent to a queue as the site sends runs (send_task with queue=): with the filesystem
    broker the message file is in the session's queue folder, with Redis the list is under
    the session's key prefix, never a bare queue name that a `make run` worker reads."""
    from leaderboard.celery import MEASURE_RUN, app, ensure_broker_folders

    from .conftest import purge_queue

    queue = f"isolation-{uuid.uuid4().hex[:8]}"
    ensure_broker_folders()
    app.send_task(MEASURE_RUN, args=[0], queue=queue)
    try:
        if settings.CELERY_BROKER_URL.startswith("filesystem://"):
            folder = Path(settings.CELERY_BROKER_TRANSPORT_OPTIONS["data_folder_out"])
            assert folder.is_relative_to(Path(settings.VAR_DIR))
            # kombu names each message file TIME_UUID.QUEUE.msg
            assert len([p for p in folder.iterdir() if p.name.endswith(f".{queue}.msg")]) == 1
        else:
            import redis

            prefix = settings.CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"]
            assert prefix.startswith("specboard-test-")
            client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
            assert client.llen(prefix + queue) == 1 and client.llen(queue) == 0
    finally:
        purge_queue(queue)


def test_a_process_started_by_a_test_uses_the_same_var(settings):
    probe = ("import django, json; django.setup(); from django.conf import settings as s; "
             "print(json.dumps([str(s.VAR_DIR), str(s.DATA_DIR), str(s.HOST_LOCK), "
             "str(s.MEDIA_ROOT), s.BROKER_KEY_PREFIX]))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=120,
                          env=subprocess_env(DJANGO_SETTINGS_MODULE="leaderboard.settings"))
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == [str(settings.VAR_DIR), str(settings.DATA_DIR), str(settings.HOST_LOCK),
                    str(settings.MEDIA_ROOT), settings.BROKER_KEY_PREFIX]


def test_fast_tests_are_collected_first_then_browser_then_vllm_modules_whole(tmp_path):
    # A module moves whole, in the group of its slowest test (its module fixtures are built
    # once); within a group the collection order stays.
    (tmp_path / "test_engine.py").write_text(textwrap.dedent("""\
        import pytest

        @pytest.mark.vllm
        def test_engine_a(): pass

        def test_engine_fast(): pass
    """))
    (tmp_path / "test_mixed.py").write_text(textwrap.dedent("""\
        import pytest

        def test_fast_a(): pass

        @pytest.mark.browser
        def test_browser_a(): pass
    """))
    (tmp_path / "test_plain.py").write_text("def test_fast_b(): pass\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tests.isolation",
         "-p", "no:django", "-p", "no:cacheprovider", "test_engine.py", "test_mixed.py",
         "test_plain.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env=subprocess_env(PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    order = [line.split("::")[-1] for line in done.stdout.splitlines() if "::" in line]
    assert order == ["test_fast_b", "test_fast_a", "test_browser_a", "test_engine_a",
                     "test_engine_fast"]


def test_in_parallel_each_engine_lane_has_a_worker_and_its_core_and_a_quiet_test_runs_alone(
        tmp_path):
    # make test runs pytest -n 3: each engine lane (the modules marked vllm, core 0; those
    # marked vllm(core=1)) is one unit of work, handed out first, its engines pinned to its
    # core; the other tests go to the third worker meanwhile. A quiet test (engine_core)
    # runs last in the core-0 lane with no other test beside it. Each test records its
    # worker, the binding it saw and when it ran.
    record = ("import os, time\n"
              "def run(name, seconds=0.0):\n"
              "    start = time.time(); time.sleep(seconds)\n"
              f"    with open({str(tmp_path / 'ran.txt')!r}, 'a') as f:\n"
              "        f.write(f\"{name} {os.environ['PYTEST_XDIST_WORKER']} \"\n"
              "                f\"{os.environ.get('VLLM_CPU_OMP_THREADS_BIND', '-')} \"\n"
              "                f\"{start} {time.time()}\\n\")\n")
    (tmp_path / "record.py").write_text(record)
    (tmp_path / "test_engine_a.py").write_text(textwrap.dedent("""\
        import pytest
        from record import run

        @pytest.mark.vllm
        def test_engine_1(): run("engine_1", 1.5)

        def test_engine_module_fast(): run("engine_module_fast")
    """))
    (tmp_path / "test_engine_b.py").write_text(textwrap.dedent("""\
        import pytest
        from record import run

        pytestmark = pytest.mark.vllm

        def test_engine_2(): run("engine_2")
    """))
    (tmp_path / "test_lane_1.py").write_text(textwrap.dedent("""\
        import pytest
        from record import run

        pytestmark = [pytest.mark.vllm(core=1)]

        def test_lane_1_a(): run("lane_1_a", 1.5)

        def test_lane_1_b(): run("lane_1_b", 1.5)
    """))
    # a test that needs the engine's core (or the machine) to itself joins the core-0 lane
    (tmp_path / "test_core.py").write_text(textwrap.dedent("""\
        import pytest
        from record import run

        @pytest.mark.engine_core
        def test_pinned_hog(): run("pinned_hog", 0.5)
    """))
    (tmp_path / "test_fast.py").write_text(
        "from record import run\n"
        + "".join(f"def test_fast_{i}(): run('fast_{i}', 0.3)\n" for i in range(6)))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "3", "-q", "-p", "tests.isolation",
         "-p", "no:django", "-p", "no:cacheprovider", "."],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={k: v for k, v in subprocess_env(PYTHONPATH=f"{ROOT}:{tmp_path}").items()
             if k != "VLLM_CPU_OMP_THREADS_BIND"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    ran = {}
    for line in (tmp_path / "ran.txt").read_text().splitlines():
        name, worker, bind, start, end = line.split()
        ran[name] = (worker, bind, float(start), float(end))
    lane_0 = {ran[t][0] for t in ("engine_1", "engine_module_fast", "engine_2", "pinned_hog")}
    lane_1 = {ran[t][0] for t in ("lane_1_a", "lane_1_b")}
    fast = {ran[f"fast_{i}"][0] for i in range(6)}
    assert len(lane_0) == len(lane_1) == 1 and lane_0 != lane_1, ran
    assert fast - lane_0 - lane_1, ran   # the third worker ran fast tests beside the lanes
    # core 1's lane pins its engines there (vLLM's setting); core 0's leaves vLLM's choice
    two_cores = 1 in os.sched_getaffinity(0)
    assert {ran[t][1] for t in ("lane_1_a", "lane_1_b")} == {"1" if two_cores else "-"}
    assert {ran[t][1] for t in ("engine_1", "engine_2", "fast_0")} == {"-"}
    # the quiet test came last in its lane and overlapped no other test
    _, _, hog_start, hog_end = ran["pinned_hog"]
    assert all(end <= hog_start for name, (w, _, _, end) in ran.items()
               if w == ran["pinned_hog"][0] and name != "pinned_hog"), ran
    assert not [name for name, (_, _, start, end) in ran.items()
                if name != "pinned_hog" and start < hog_end and end > hog_start], ran
    # a module whose markers the scheduler's rule cannot see is named
    (tmp_path / "test_hidden.py").write_text(textwrap.dedent("""\
        import pytest

        class TestHidden:
            @pytest.mark.vllm
            def test_engine_in_a_class(self): pass
    """))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "3", "-q", "-p", "tests.isolation",
         "-p", "no:django", "-p", "no:cacheprovider", "."],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env=subprocess_env(PYTHONPATH=f"{ROOT}:{tmp_path}"))
    assert done.returncode == 0 and "test_hidden.py: the parallel scheduler" in done.stdout
