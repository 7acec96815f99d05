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
- In parallel (``make test`` runs ``pytest -n 3``, pytest-xdist): the engine tests run in two
  *engine lanes*, each a unit of work handed out first, each with its own core: the modules
  marked ``vllm`` run on core 0 (vLLM's own choice on this machine), those marked
  ``vllm(core=1)`` with ``VLLM_CPU_OMP_THREADS_BIND=1``, so their engines (and the engines
  of the Celery workers and commands they start) compute on core 1 and the two lanes never
  share an engine core. The third worker runs the fast and browser tests beside them
  (``pytest_xdist_make_scheduler``). An engine start is mostly Python imports in three
  processes (about 30 s on the 2-core machine) and a lane is mostly engine starts, so two
  lanes fill both cores where one left the second core idle. Modules marked ``engine_core``
  join the core-0 lane. Each worker is a session of its own: its own var/, test database
  (``_gw0`` ... ``_gw2``) and broker key prefix.
- Tests marked ``engine_core`` (a busy loop pinned to the engine's core, or a run that must
  come out unloaded) are *quiet*: such a test waits until no other test of the session
  runs and holds the others back while it runs. Every test holds a lock shared, a quiet one
  exclusively, with a gate that lets it in ahead of the tests still queued (``QuietLock``;
  its files in ``SPECBOARD_TEST_LOCK_DIR``, a folder the controller makes for its workers).
  Quiet tests run last in their lane, those that start engines first, so that the others
  find the lane's idle engines shut down (tests/conftest.py ``no_engine_in_this_tree``).
"""
import contextlib
import fcntl
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


# The engine lanes: a module's engine tests run in the lane of the core its marker names
# (``pytest.mark.vllm``: core 0; ``pytest.mark.vllm(core=1)``: core 1).
ENGINE_UNIT = "engine-core{}"
# A module is in an engine lane when a top-level test is decorated with ``vllm`` or
# ``engine_core`` (the latter join the core-0 lane), or a module-wide pytestmark names one.
ENGINE_MARK = re.compile(r"^(@pytest\.mark\.(vllm|engine_core)\b"
                         r"|pytestmark\b.*\bmark\.(vllm|engine_core)\b)", re.M)
ENGINE_CORE_ARG = re.compile(r"\bmark\.vllm\(\s*core\s*=\s*(\d+)\s*\)")
# The engine pins its compute threads to the lane's core through vLLM's own setting.
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
# A test that needs the machine to itself: the engine_core tests (a busy loop pinned to the
# engine's core, or a run that must come out unloaded once it stops).
QUIET_MARKER = "engine_core"
LOCK_DIR_ENV = "SPECBOARD_TEST_LOCK_DIR"
LOCK_KEY = pytest.StashKey["QuietLock"]()
OWN_LOCK_DIR_KEY = pytest.StashKey[Path]()


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


def engine_lane(path: Path) -> int | None:
    """The core of the engine lane a test module runs in (None: not an engine module), read
    from its source: under xdist the controller, which schedules, collects nothing. The
    project marks them with ``pytest.mark.vllm`` (core 0), ``pytest.mark.vllm(core=N)``
    or ``pytest.mark.engine_core`` (core 0), as a decorator or in ``pytestmark``; each
    worker checks that this rule agrees with the markers it collected."""
    try:
        source = path.read_text()
    except OSError:
        return None
    if ENGINE_MARK.search(source) is None:
        return None
    found = ENGINE_CORE_ARG.search(source)
    return int(found.group(1)) if found else 0


def _marked_lane(item) -> int | None:
    """The engine lane an item's own markers name (None: none)."""
    vllm = item.get_closest_marker("vllm")
    if vllm is not None:
        return int(vllm.kwargs.get("core", 0))
    return 0 if item.get_closest_marker("engine_core") else None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Each engine lane is one unit of work, larger than any other, so the lanes are handed
    out first (xdist's loadscope reordering), one to a worker: those workers run their
    engine tests in order while the last takes every other test, one by one, beside them."""
    from xdist.scheduler import LoadScopeScheduling

    class EngineLanesFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            lane = engine_lane(config.rootpath / nodeid.split("::", 1)[0])
            return nodeid if lane is None else ENGINE_UNIT.format(lane)

    return EngineLanesFirst(config, log)


class _EngineModulesAgree:
    """In an xdist worker: the scheduler's rule (engine_lane) agrees with the markers of
    every module collected, checked before -k or -m deselect any test; a module where it
    does not is named in a warning (its engine tests may run beside another engine on the
    same core, slower, not wrong)."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, config, items):
        lanes = {}
        for item in items:   # a module's lane: the first its tests' markers name
            if lanes.get(_module(item)) is None:
                lanes[_module(item)] = _marked_lane(item)
        wrong = sorted(m for m, lane in lanes.items()
                       if lane != engine_lane(config.rootpath / m))
        if wrong:
            warnings.warn(pytest.PytestWarning(
                f"{', '.join(wrong)}: the parallel scheduler reads engine modules from "
                "their source (a top-level @pytest.mark.vllm, or pytestmark), which "
                "disagrees with their markers: mark them so"))


class QuietLock:
    """One lock for the workers of a session, in files of ``folder``: every test holds it
    shared, a quiet test exclusively. Writers first: a quiet test takes the gate before it
    waits for the tests in flight, and a test that starts meanwhile waits at the gate, so
    the quiet test runs as soon as those in flight end."""

    def __init__(self, folder: Path):
        self.gate = open(folder / "gate", "a+")
        self.lock = open(folder / "lock", "a+")

    @contextlib.contextmanager
    def held(self, exclusive: bool):
        if exclusive:
            fcntl.flock(self.gate, fcntl.LOCK_EX)
            fcntl.flock(self.lock, fcntl.LOCK_EX)
        else:
            fcntl.flock(self.gate, fcntl.LOCK_SH)
            fcntl.flock(self.lock, fcntl.LOCK_SH)
            fcntl.flock(self.gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self.lock, fcntl.LOCK_UN)
            if exclusive:
                fcntl.flock(self.gate, fcntl.LOCK_UN)


def _lane_core(item) -> int | None:
    """The core a test's engines are pinned to, where its lane is not core 0 and the
    machine has that core (None: vLLM's own choice, core 0 here)."""
    lane = _marked_lane(item)
    if not lane or BIND_ENV in os.environ or lane not in os.sched_getaffinity(0):
        return None
    return lane


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # Around setup, call and teardown: a module fixture that starts an engine is built in
    # its first test's setup, so it runs pinned and under the lock too.
    lock = item.config.stash.get(LOCK_KEY, None)
    core = _lane_core(item)
    quiet = item.get_closest_marker(QUIET_MARKER) is not None
    with contextlib.ExitStack() as stack:
        if lock is not None:
            stack.enter_context(lock.held(exclusive=quiet))
        if core is not None:
            os.environ[BIND_ENV] = str(core)
            stack.callback(os.environ.pop, BIND_ENV, None)
        return (yield)


def pytest_configure(config):
    worker = hasattr(config, "workerinput")   # an xdist worker (the controller has none)
    if worker:
        config.pluginmanager.register(_EngineModulesAgree(), "specboard-engine-modules")
    # An xdist worker shares its controller's lock folder; any other session (the
    # controller, a session without workers, a pytest that a test starts) makes its own.
    folder = os.environ.get(LOCK_DIR_ENV) if worker else None
    if not folder:
        folder = tempfile.mkdtemp(prefix="specboard-test-locks-")
        os.environ[LOCK_DIR_ENV] = folder
        config.stash[OWN_LOCK_DIR_KEY] = Path(folder)
    config.stash[LOCK_KEY] = QuietLock(Path(folder))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    # trylast: after pytest's own reordering by fixture scope; sorted() is stable. Quiet
    # tests last, when the other lanes are ending; among them those that start engines
    # first, so that the rest can shut the lane's idle engines down (conftest's
    # no_engine_in_this_tree) and find no thread of the tree pinned.
    slowest = _slowest(items)

    def order(item):
        quiet = item.get_closest_marker(QUIET_MARKER) is not None
        return (quiet, -slowest[_module(item)] if quiet else slowest[_module(item)])

    items[:] = sorted(items, key=order)


def pytest_unconfigure(config):
    var = config.stash.get(VAR_KEY, None)
    if var is not None and os.environ.get("SPECBOARD_TEST_KEEP_VAR") != "1":
        shutil.rmtree(var, ignore_errors=True)
    locks = config.stash.get(OWN_LOCK_DIR_KEY, None)
    if locks is not None:
        shutil.rmtree(locks, ignore_errors=True)
