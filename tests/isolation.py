"""pytest plugin (loaded with ``-p tests.isolation`` from pyproject.toml's addopts): the test
session owns its world, and the fast tests run first.

- Its own var/: a fresh temporary folder (data, broker, host lock, secret key, logs, the
  SQLite test database, media) set as SPECBOARD_VAR_DIR before pytest-django imports the
  settings, so nothing in the suite reads or writes the checkout's var/ or waits behind the
  site's measurement (host lock), and the processes tests start inherit it. A caller's
  SPECBOARD_VAR_DIR, SPECBOARD_DATA_DIR, SPECBOARD_HOST_LOCK and MEDIA_ROOT are overridden
  on purpose: in a shell set up for `make run` they name the site's own files. The folder is
  removed at the end of the session (kept with SPECBOARD_TEST_KEEP_VAR=1, to look into).
- Its own broker messages: with the filesystem broker the temporary var/ holds the queue
  folders; with a Redis broker (CELERY_BROKER_URL) every key the session writes carries
  SPECBOARD_BROKER_KEY_PREFIX, so a `make run` worker on the same Redis database never sees
  or loses a test message and purging a test queue never empties the site's.
- The converted demo target (about 270 MB, ~30 s to convert) is cached outside the checkout,
  in SPECBOARD_TEST_CACHE_DIR (default $XDG_CACHE_HOME/specboard, else ~/.cache/specboard),
  so that repeated runs convert it once.
- Order: tests neither marked ``vllm`` nor ``browser`` first, then ``browser``, then
  ``vllm`` (real engine starts, minutes each), each group in collection order, so a
  failure in the fast tests shows within a minute.
- In parallel (``make test`` runs ``pytest -n 2``, pytest-xdist): every module with an
  engine test is one unit of work, handed out first, so that one worker runs the engine
  tests in order (vLLM pins its engine to core 0; two engines at once would share that
  core) while the other runs the fast and browser tests beside it
  (``pytest_xdist_make_scheduler``). Modules marked ``engine_core`` (tests that pin a busy
  loop to core 0 and need it to get that core) join the engine unit: beside an engine they
  would measure the engine, not themselves. Each worker is a session of its own: its own var/,
  test database (``_gw0``, ``_gw1``) and broker key prefix.
"""
import os
import re
import shutil
import tempfile
import uuid
import warnings
from pathlib import Path

import pytest

# The order of the groups: a test's first matching marker decides; unmarked tests come first.
SLOW_MARKERS = ("browser", "vllm")
VAR_KEY = pytest.StashKey[Path]()


def cache_dir() -> Path:
    """Where the suite keeps what is worth keeping between sessions (the demo target)."""
    if os.environ.get("SPECBOARD_TEST_CACHE_DIR"):
        return Path(os.environ["SPECBOARD_TEST_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "specboard"


def _isolate():
    """Point every per-site path of leaderboard/settings.py at a fresh folder."""
    var = Path(tempfile.mkdtemp(prefix="specboard-test-var-"))
    os.environ["SPECBOARD_VAR_DIR"] = str(var)
    # Unset means "under VAR_DIR" in settings.py; a caller's value would be the site's.
    for name in ("SPECBOARD_DATA_DIR", "SPECBOARD_HOST_LOCK", "MEDIA_ROOT"):
        os.environ.pop(name, None)
    # Only a Redis broker reads it (settings.py); unique per session.
    os.environ["SPECBOARD_BROKER_KEY_PREFIX"] = f"specboard-test-{uuid.uuid4().hex[:12]}:"
    return var


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    # A wrapper runs before every implementation, pytest-django's (which imports the
    # settings) included.
    early_config.stash[VAR_KEY] = _isolate()
    return (yield)


def pytest_report_header(config):
    var = config.stash.get(VAR_KEY, None)
    return [f"specboard: var {var} (its own), demo-target cache {cache_dir()}"]


ENGINE_GROUP = "engine"
# The markers that put a module in the engine unit: engine tests, and tests that need the
# engine's core to themselves.
ENGINE_UNIT_MARKERS = ("vllm", "engine_core")
# A top-level test decorated with one, or a module-wide pytestmark naming one.
ENGINE_MARK = re.compile(r"^(@pytest\.mark\.(vllm|engine_core)\b"
                         r"|pytestmark\b.*\bmark\.(vllm|engine_core)\b)", re.M)


def _group(item):
    for i, marker in enumerate(SLOW_MARKERS, start=1):
        if item.get_closest_marker(marker):
            return i
    return 0


def _module(item):
    return item.nodeid.split("::")[0]


def _slowest(items):
    """Each module's group: that of its slowest test. A module moves whole: split over
    two groups (or two workers), its module-scoped fixtures (a vLLM engine's events,
    minutes) would be built twice."""
    slowest = {}
    for item in items:
        slowest[_module(item)] = max(slowest.get(_module(item), 0), _group(item))
    return slowest


def is_engine_module(path: Path) -> bool:
    """Whether a test module belongs to the engine unit, read from its source: under xdist
    the controller, which schedules, collects nothing. The project marks them with
    ``pytest.mark.vllm`` or ``pytest.mark.engine_core`` (a decorator or ``pytestmark``);
    each worker checks that this rule agrees with the markers it collected."""
    try:
        return ENGINE_MARK.search(path.read_text()) is not None
    except OSError:
        return False


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Every engine module is one unit of work, the largest, so it is handed out first
    (xdist's loadscope reordering): one worker runs the engine tests in order while the
    other takes every other test, one by one, beside it."""
    from xdist.scheduler import LoadScopeScheduling

    class EngineFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            module = config.rootpath / nodeid.split("::", 1)[0]
            return ENGINE_GROUP if is_engine_module(module) else nodeid

    return EngineFirst(config, log)


class _EngineModulesAgree:
    """In an xdist worker: the scheduler's rule (is_engine_module) agrees with the markers
    of every module collected, checked before -k or -m deselect any test; a module where
    it does not is named in a warning (its engine tests may run beside another engine,
    slower, not wrong)."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, config, items):
        engine_unit = {}
        for item in items:
            engine_unit[_module(item)] = engine_unit.get(_module(item), False) or any(
                item.get_closest_marker(m) for m in ENGINE_UNIT_MARKERS)
        wrong = sorted(m for m, marked in engine_unit.items()
                       if marked != is_engine_module(config.rootpath / m))
        if wrong:
            warnings.warn(pytest.PytestWarning(
                f"{', '.join(wrong)}: the parallel scheduler reads engine modules from "
                "their source (a top-level @pytest.mark.vllm, or pytestmark), which "
                "disagrees with their markers: mark them so"))


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        config.pluginmanager.register(_EngineModulesAgree(), "specboard-engine-modules")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    # trylast: after pytest's own reordering by fixture scope; sorted() is stable.
    slowest = _slowest(items)
    items[:] = sorted(items, key=lambda item: slowest[_module(item)])


def pytest_unconfigure(config):
    var = config.stash.get(VAR_KEY, None)
    if var is not None and os.environ.get("SPECBOARD_TEST_KEEP_VAR") != "1":
        shutil.rmtree(var, ignore_errors=True)
