import pytest
from django.conf import settings
from django.db import connection

from leaderboard.env import database_from_url


def test_sqlite_is_the_default_database(tmp_path):
    db = database_from_url("", tmp_path / "db.sqlite3")
    assert db["ENGINE"] == "django.db.backends.sqlite3"
    assert db["NAME"] == str(tmp_path / "db.sqlite3")


def test_postgres_url_is_parsed_for_psycopg():
    db = database_from_url("postgres://alice:s%40cret@db.example:5433/board?sslmode=require", "x")
    assert db["ENGINE"] == "django.db.backends.postgresql"
    assert (db["USER"], db["PASSWORD"], db["HOST"], db["PORT"], db["NAME"]) == (
        "alice", "s@cret", "db.example", "5433", "board")
    assert db["OPTIONS"] == {"sslmode": "require"}


def test_unknown_database_scheme_says_what_is_supported():
    with pytest.raises(ValueError, match="sqlite:///PATH or postgres://"):
        database_from_url("mysql://root@localhost/x", "x")


@pytest.mark.django_db
def test_the_database_in_use_is_the_one_the_environment_names():
    import os

    url = os.environ.get("DATABASE_URL", "")
    expected = "postgresql" if url.startswith("postgres") else "sqlite"
    assert connection.vendor == expected
    if expected == "postgresql":
        import psycopg

        assert psycopg.__version__.startswith("3.")


def test_celery_is_configured_for_long_accelerator_jobs():
    from leaderboard.celery import app

    conf = app.conf
    assert conf.task_acks_late and conf.worker_prefetch_multiplier == 1
    assert conf.worker_concurrency == 1
    assert conf.task_soft_time_limit < conf.task_time_limit
    assert conf.broker_transport_options["visibility_timeout"] > conf.task_time_limit
    assert conf.result_backend is None and conf.task_ignore_result
    assert conf.broker_url == settings.CELERY_BROKER_URL
