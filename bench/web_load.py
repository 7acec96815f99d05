"""Web load benchmark (not a test): seed ~100k Result rows in PostgreSQL, serve the site
with a real server process on 127.0.0.1, and print the response times (p50/p95/p99) of the
leaderboard and drafter pages under 20 concurrent clients, with a quiet database and while
cells keep landing, side by side in one invocation.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/specboard_webload \\
        .venv/bin/python bench/web_load.py [--results 100000] [--clients 20] [--seconds 30]
        [--landing-rate 1.0] [--before] [--no-refresh] [--server gunicorn|runserver]
        [--workers 2] [--reseed]

The database is created if it does not exist.

Cells landing: a writer thread in this process lands the cells of a running drafter run,
`--landing-rate` cells a second, through services.runs.record_cell and update_progress (the
calls a worker makes for each measured cell), starting a new run when one is complete. The
drafter page load mixes 45 seeded drafters' pages with the landing drafter's page (one
request in ten): the page its submitter watches, which changes with every cell.

--before measures the same scenarios again with SPECBOARD_PAGE_CACHE_INCREMENTAL=0 (each
new state of a page rendered from scratch by every request that misses it, as before
2026-12-01), so the ratio shows in one invocation. --no-refresh measures the figures kept
per run without the refresh interval (SPECBOARD_LANDING_REFRESH_S=0: a page rendered again
for every landing cell).

The seeded figures are test data from tests/factories.py (counts chosen by formula, figures
computed by worker.metrics): not measurements. Seeding is done once per database (a second
run reuses it; --reseed starts again). Traffic goes to 127.0.0.1 only, and every loop is
bounded in time. Client times are measured on loopback; server times come from gunicorn's
access log. The goal is p95 <= 150 ms with no errors, quiet and with cells landing.
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROTOCOL_SLUG = "webload"
GOAL_P95_MS = 150.0


def ensure_database(url):
    import psycopg

    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    admin = url.replace(parts.path, "/postgres", 1)
    with psycopg.connect(admin, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')
            print(f"created database {name}")


def django_setup():
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "leaderboard.settings")
    import django

    django.setup()


def seed(target_results: int, reseed: bool):
    """One protocol (4 tasks x 4 batch sizes x 2 temperatures x 3 k = 96 cells per drafter
    run) with enough drafters for `target_results` rows, plus a baseline."""
    from django.db import transaction

    from leaderboard.models import Drafter, Protocol, Result, Run, Target
    from tests import factories as f

    protocol = Protocol.objects.filter(slug=PROTOCOL_SLUG).first()
    if protocol is not None and reseed:
        Run.objects.filter(protocol=protocol).delete()
        Drafter.objects.filter(slug__startswith="webload-").delete()
        protocol.delete()
        Target.objects.filter(slug="webload-target").delete()
        protocol = None
    if protocol is None:
        target = f.make_target(slug="webload-target", name="Web load target (test data)")
        # the largest batch size (64) needs 64 prompts per task (protocol v2)
        prompts = f.make_prompt_set("webload-prompts", per_category=32)
        protocol = f.make_protocol(target, slug=PROTOCOL_SLUG, hardware="webload",
                                   prompt_set=prompts,
                                   tasks=("chat", "math", "code", "summary"),
                                   batch_sizes=(1, 4, 16, 64), temperatures=(0.0, 1.0),
                                   ks=(2, 4, 6))
    have = Result.objects.filter(run__protocol=protocol).count()
    if have >= target_results:
        print(f"seeded already: {have} results under protocol {protocol}")
        return protocol
    baseline = Run.objects.filter(protocol=protocol, drafter__isnull=True).first()
    if baseline is None:
        with transaction.atomic():
            baseline = f.make_run(protocol)
            base_results = f.add_baseline_results(baseline)
    else:
        base_results = list(Result.objects.filter(run=baseline))
    per_run = len(protocol.spec.cells(with_drafter=True))
    n = Drafter.objects.filter(slug__startswith="webload-").count()
    started = time.monotonic()
    while have < target_results:
        with transaction.atomic():
            for _ in range(50):
                d = f.make_drafter(protocol.target, f"webload {n}",
                                   params={"prompt_lookup_min": 1 + n % 3,
                                           "prompt_lookup_max": 3 + n % 5})
                run = f.make_run(protocol, d)
                f.add_drafter_results(run, 0.3 + 0.6 * random.Random(n).random(), base_results)
                n += 1
                have += per_run
        print(f"  seeded {have} results ({n} drafters), {time.monotonic() - started:.0f}s",
              flush=True)
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")  # planner statistics for the new rows
    return protocol


def cache_url():
    """The fragment cache shared by the server's processes: Redis on 127.0.0.1 if it
    answers (its database 13, keys expire), else a folder under var/."""
    import socket

    try:
        with socket.create_connection(("127.0.0.1", 6379), timeout=1):
            return "redis://127.0.0.1:6379/13"
    except OSError:
        return f"file://{ROOT / 'var' / 'web_load_cache'}"


ACCESS_LOG = ROOT / "var" / "web_load_access.log"


def server_times(skip_lines):
    """Server-side milliseconds per request from gunicorn's access log (%(M)s: from the
    request read to the response written), after the first `skip_lines` lines."""
    if not ACCESS_LOG.exists():
        return [], 0
    lines = ACCESS_LOG.read_text().splitlines()
    times = [float(line.split()[0]) for line in lines[skip_lines:] if line.strip()]
    return times, len(lines)


def start_server(port, server, workers=2, threads=1, extra_env=None):
    env = dict(os.environ, DEBUG="0", SECRET_KEY="web-load-benchmark-only",
               ALLOWED_HOSTS="127.0.0.1", PYTHONUNBUFFERED="1", LOG_LEVEL="WARNING",
               **(extra_env or {}))
    env.setdefault("SPECBOARD_CACHE_URL", cache_url())
    if server == "gunicorn":
        ACCESS_LOG.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "gunicorn", "leaderboard.wsgi", "-b", f"127.0.0.1:{port}",
               "-w", str(workers), "--threads", str(threads), "--log-level", "warning",
               "--backlog", "256", "--access-logfile", str(ACCESS_LOG),
               "--access-logformat", "%(M)s %(s)s %(U)s"]
    else:
        cmd = [sys.executable, "manage.py", "runserver", "--noreload", f"127.0.0.1:{port}"]
    log = open(ROOT / "var" / "web_load_server.log", "wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/protocols/", timeout=5).read()
            return proc
        except (urllib.error.URLError, ConnectionError, OSError):
            if proc.poll() is not None:
                raise SystemExit(f"the server exited: see {log.name}")
            time.sleep(0.5)
    stop_server(proc)
    raise SystemExit("the server did not answer within 60 s")


def stop_server(proc):
    from worker.processes import stop_process_group

    stop_process_group(proc, term_timeout=20, kill_timeout=10)


def fetch(url):
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            body = r.read()
            ok = r.status == 200 and len(body) > 500
    except (urllib.error.URLError, ConnectionError, OSError):
        ok = False
    return (time.perf_counter() - t0) * 1000.0, ok


def run_load(urls, clients, seconds):
    """GETs from `clients` threads for `seconds`, each thread cycling through `urls` from
    its own starting point."""
    times, errors, lock = [], [0], threading.Lock()
    deadline = time.monotonic() + seconds

    def client(offset):
        i = offset
        while time.monotonic() < deadline:
            ms, ok = fetch(urls[i % len(urls)])
            i += 1
            with lock:
                times.append(ms)
                errors[0] += 0 if ok else 1

    threads = [threading.Thread(target=client, args=(n * 7,)) for n in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return times, errors[0], time.perf_counter() - started


LANDING_PREFIX = "webload-landing-"


class CellWriter:
    """Lands the cells of a running drafter run at `rate` cells a second through the run
    service (services.runs.record_cell, then update_progress, as a worker does), in a
    thread; a complete run succeeds and a new one starts."""

    def __init__(self, protocol, rate):
        self.protocol, self.rate = protocol, rate
        self.stop_flag = threading.Event()
        self.thread = None
        self.landed = 0
        self.run = None
        self.new_run()

    def new_run(self):
        from leaderboard.models import Drafter, Run
        from tests import factories as f

        n = Drafter.objects.filter(slug__startswith=LANDING_PREFIX).count()
        drafter = f.make_drafter(self.protocol.target, f"{LANDING_PREFIX}{n}")
        self.run = f.make_run(self.protocol, drafter, state=Run.RUNNING, cells_done=0)
        self.cells = [c for c in self.protocol.spec.run_cells(drafter.method)]
        self.next_cell = 0

    @property
    def drafter_slug(self):
        return self.run.drafter.slug

    def land_one(self):
        from leaderboard.models import Run
        from leaderboard.services import runs
        from tests import factories as f

        if self.next_cell >= len(self.cells):
            Run.objects.filter(pk=self.run.pk).update(state=Run.SUCCEEDED)
            self.new_run()
        runs.record_cell(self.run, f.landing_cell(self.run, self.cells[self.next_cell]))
        self.next_cell += 1
        runs.update_progress(self.run, self.next_cell, self.started)
        self.landed += 1

    def _loop(self):
        from django.db import connection

        try:
            self.started = time.monotonic()
            while not self.stop_flag.is_set():
                t0 = time.monotonic()
                self.land_one()
                self.stop_flag.wait(max(0.0, 1.0 / self.rate - (time.monotonic() - t0)))
        finally:
            connection.close()

    def start(self):
        self.stop_flag.clear()
        self.landed = 0
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def stop(self):
        self.stop_flag.set()
        self.thread.join()


def clean_landing_runs():
    from leaderboard.models import Drafter, Run

    Run.objects.filter(drafter__slug__startswith=LANDING_PREFIX).delete()
    Drafter.objects.filter(slug__startswith=LANDING_PREFIX).delete()


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def pcts(xs):
    return (pct(xs, 50), pct(xs, 95), pct(xs, 99)) if xs else (float("nan"),) * 3


def measure_mode(mode, args, protocol, board_urls, drafter_slugs, base):
    """Start a server for `mode` ("incremental", "no-refresh" or "before"), then each page
    quiet and with cells landing. Returns whether the goal was met."""
    from django.core.cache import cache
    from django.db import connection

    cache.clear()  # the benchmark's own cache: each mode starts cold
    clean_landing_runs()
    writer = CellWriter(protocol, args.landing_rate)
    for _ in range(3):  # the landing run has a few cells before the quiet scenario
        writer.started = time.monotonic()
        writer.land_one()
    connection.close()
    landing_url = f"{base}/drafters/{writer.drafter_slug}/"
    drafter_urls = []
    for i, slug in enumerate(drafter_slugs[:45]):
        drafter_urls.append(f"{base}/drafters/{slug}/")
        if i % 9 == 8:
            drafter_urls.append(landing_url)  # one request in ten
    env = {"SPECBOARD_PAGE_CACHE_INCREMENTAL": "0" if mode == "before" else "1"}
    if mode == "no-refresh":  # per-run figures, but a page rendered again for every cell
        env["SPECBOARD_LANDING_REFRESH_S"] = "0"
    proc = start_server(args.port, args.server, args.workers, args.threads, env)
    met = True
    try:
        for url in board_urls + drafter_urls:  # every page rendered once (warm)
            fetch(url)
        time.sleep(1)
        _, seen = server_times(0)
        for name, urls in (("leaderboard", board_urls), ("drafter", drafter_urls)):
            for scenario in ("quiet", "landing"):
                if scenario == "landing":
                    writer.start()
                times, errors, wall = run_load(urls, args.clients, args.seconds)
                landed = 0
                if scenario == "landing":
                    writer.stop()
                    landed = writer.landed
                time.sleep(1)  # let the access log catch up
                stimes, seen = server_times(seen)
                c50, c95, c99 = pcts(times)
                s50, s95, s99 = pcts(stimes)
                print(f"{mode:<12} {name:<12} {scenario:<8} {c50:>7.0f} {c95:>7.0f} {c99:>7.0f}  "
                      f"{s50:>7.0f} {s95:>7.0f} {s99:>7.0f} {len(times):>7} "
                      f"{len(times) / wall:>6.1f} {errors:>6} {landed:>6} "
                      f"{os.getloadavg()[0]:>5.1f}", flush=True)
                met &= errors == 0 and (s95 if stimes else c95) <= GOAL_P95_MS
    finally:
        stop_server(proc)
        if writer.thread is not None and writer.thread.is_alive():
            writer.stop()
    return met


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=int, default=100_000)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=30.0,
                        help="how long each page is loaded in each scenario")
    parser.add_argument("--landing-rate", type=float, default=1.0,
                        help="cells landed per second while cells land")
    parser.add_argument("--before", action="store_true",
                        help="also measure with SPECBOARD_PAGE_CACHE_INCREMENTAL=0")
    parser.add_argument("--no-refresh", action="store_true",
                        help="also measure with SPECBOARD_LANDING_REFRESH_S=0 (figures kept "
                             "per run, but a page rendered again for every landing cell)")
    parser.add_argument("--port", type=int, default=8799)
    parser.add_argument("--server", choices=["runserver", "gunicorn"], default="gunicorn",
                        help="gunicorn (pyproject dev extras); runserver: one threaded "
                             "process, which opens a database connection per request thread "
                             "(Postgres may run out of connections)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="gunicorn threads per worker")
    parser.add_argument("--reseed", action="store_true")
    args = parser.parse_args(argv)

    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://")):
        raise SystemExit("set DATABASE_URL=postgres://postgres@127.0.0.1:5432/specboard_webload")
    ensure_database(url)
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT,
                   check=True)
    # the server and this process (the cell writer, clearing the cache) share one cache
    os.environ.setdefault("SPECBOARD_CACHE_URL", cache_url())
    os.environ.setdefault("MEDIA_ROOT", str(ROOT / "var" / "web_load_media"))
    django_setup()
    from django.db import connection

    from leaderboard.models import Drafter, Result

    protocol = seed(args.results, args.reseed)
    clean_landing_runs()
    total = Result.objects.count()
    slugs = list(Drafter.objects.filter(slug__startswith="webload-")
                 .exclude(slug__startswith=LANDING_PREFIX)
                 .order_by("?").values_list("slug", flat=True)[:45])
    connection.close()

    base = f"http://127.0.0.1:{args.port}"
    ref = f"{protocol.slug}@{protocol.version}"
    board_urls = [f"{base}/?protocol={ref}"] + [
        f"{base}/?protocol={ref}&{q}" for q in (
            "task=code", "batch_size=16", "batch_size=all&k=4", "sort=acceptance_length&dir=asc",
            "temperature=1&task=chat", "k=2&page=3", "method=ngram&batch_size=64")]
    print(f"{total} Result rows; protocol {protocol}; server: {args.server} "
          f"({args.workers} workers) on 127.0.0.1:{args.port}, DEBUG off; "
          f"cache {os.environ['SPECBOARD_CACHE_URL']}; {args.clients} clients, "
          f"{args.seconds:g} s per scenario; cells landing at {args.landing_rate:g}/s; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"\n{'':<34} {'client time (ms)':^23}  {'server time (ms)':^23}")
    print(f"{'mode':<12} {'page':<12} {'db':<8} {'p50':>7} {'p95':>7} {'p99':>7}  {'p50':>7} "
          f"{'p95':>7} {'p99':>7} {'requests':>7} {'req/s':>6} {'errors':>6} {'cells':>6} "
          f"{'load':>5}")
    met = {}
    modes = ["incremental"] + ["no-refresh"] * args.no_refresh + ["before"] * args.before
    for mode in modes:
        met[mode] = measure_mode(mode, args, protocol, board_urls, slugs, base)
    clean_landing_runs()
    print(f"load average at the end: {os.getloadavg()[0]:.1f} (other processes share the CPUs)")
    print(f"\ngoal p95 <= {GOAL_P95_MS:.0f} ms and no errors, quiet and with cells landing: "
          + ", ".join(f"{mode} {'met' if ok else 'MISSED'}" for mode, ok in met.items()))
    return 0 if met["incremental"] else 1


if __name__ == "__main__":
    sys.exit(main())
