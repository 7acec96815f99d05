"""Small helpers that read settings from the environment (unset means the embedded default)."""
import os
import secrets
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit


def env_str(name, default=""):
    return os.environ.get(name, default)


def env_bool(name, default=False):
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def env_int(name, default):
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def env_list(name, default=()):
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return list(default)
    return [item.strip() for item in value.split(",") if item.strip()]


# SQLite as a concurrent server database (the embedded default takes the site, a worker and
# API clients at once): WAL lets readers run beside the one writer, IMMEDIATE transactions
# take the write lock when a transaction begins (a deferred one that later needs it fails
# with "database is locked" instead of waiting), and the busy timeout makes writers queue.
SQLITE_OPTIONS = {
    "timeout": 30,
    "transaction_mode": "IMMEDIATE",
    "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
}


def sqlite_database(name) -> dict:
    return {"ENGINE": "django.db.backends.sqlite3", "NAME": str(name),
            "OPTIONS": dict(SQLITE_OPTIONS)}


def database_from_url(url, sqlite_default):
    """Django DATABASES entry from a DATABASE_URL (sqlite:///path or postgres://...)."""
    if not url:
        return sqlite_database(sqlite_default)
    parts = urlsplit(url)
    if parts.scheme == "sqlite":
        path = unquote(parts.path)
        # sqlite:////abs/path keeps its leading slash; sqlite:///rel/path is relative.
        name = path[1:] if path.startswith("/") and not path.startswith("//") else path[1:]
        return sqlite_database(name or sqlite_default)
    if parts.scheme in ("postgres", "postgresql", "pgsql"):
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": unquote(parts.path.lstrip("/")),
            "USER": unquote(parts.username or ""),
            "PASSWORD": unquote(parts.password or ""),
            "HOST": parts.hostname or "",
            "PORT": str(parts.port or ""),
            "OPTIONS": dict(parse_qsl(parts.query)),
            "CONN_MAX_AGE": 60,
            "CONN_HEALTH_CHECKS": True,
        }
    raise ValueError(
        f"DATABASE_URL scheme {parts.scheme!r} is not supported: use sqlite:///PATH or "
        "postgres://USER:PASSWORD@HOST:PORT/NAME"
    )


def persistent_secret_key(path: Path):
    """The embedded default keeps a generated key in the data folder across restarts."""
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(50)
    path.write_text(key)
    path.chmod(0o600)
    return key
