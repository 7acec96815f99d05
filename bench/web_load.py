"""Web load benchmark (not a test): seed ~100k Result rows in PostgreSQL, serve the site
with a real server process on 127.0.0.1, and print the response-time p50/p95 of the
leaderboard and drafter pages, one client at a time and under 20 concurrent clients.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/specboard_webload \\
        .venv/bin/python bench/web_load.py [--results 100000] [--clients 20] [--requests 400]
        [--server gunicorn|runserver] [--workers 2] [--reseed]

The database is created if it does not exist.

The seeded figures are test data from tests/factories.py (counts chosen by formula, figures
computed by worker.metrics): not measurements. Seeding is done once per database (a second
run reuses it; --reseed starts again). Traffic goes to 127.0.0.1 only, and every loop is
bounded in requests and time. Times are measured by the client on loopback: the server's
time plus a fraction of a millisecond. The goal is p95 <= 150 ms with no errors.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
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
        protocol = f.make_protocol(target, slug=PROTOCOL_SLUG, hardware="webload",
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
    per_run = len(protocol.spec_obj.cells(with_drafter=True))
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


def start_server(port, server, workers=2, threads=1):
    env = dict(os.environ, DEBUG="0", SECRET_KEY="web-load-benchmark-only",
               ALLOWED_HOSTS="127.0.0.1", PYTHONUNBUFFERED="1", LOG_LEVEL="WARNING")
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


def run_load(urls, requests, clients, max_seconds=300):
    """`requests` GETs spread over `clients` threads, cycling through `urls`."""
    times, errors, lock = [], [0], threading.Lock()
    counter = iter(range(requests))
    deadline = time.monotonic() + max_seconds

    def client():
        while time.monotonic() < deadline:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            ms, ok = fetch(urls[i % len(urls)])
            with lock:
                times.append(ms)
                errors[0] += 0 if ok else 1

    threads = [threading.Thread(target=client) for _ in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    return times, errors[0], wall


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=int, default=100_000)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--requests", type=int, default=400,
                        help="requests per scenario and page (bounded)")
    parser.add_argument("--port", type=int, default=8799)
    parser.add_argument("--server", choices=["runserver", "gunicorn"], default="gunicorn",
                        help="gunicorn: 2 workers x 4 threads (pyproject dev extras); runserver: "
                             "one threaded process, which opens a database connection per "
                             "request thread (Postgres may run out of connections)")
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
    django_setup()
    from django.db import connection

    from leaderboard.models import Drafter, Result

    protocol = seed(args.results, args.reseed)
    total = Result.objects.count()
    slugs = list(Drafter.objects.filter(slug__startswith="webload-")
                 .order_by("?").values_list("slug", flat=True)[:50])
    connection.close()

    base = f"http://127.0.0.1:{args.port}"
    ref = f"{protocol.slug}@{protocol.version}"
    board_urls = [f"{base}/?protocol={ref}"] + [
        f"{base}/?protocol={ref}&{q}" for q in (
            "task=code", "batch_size=16", "batch_size=all&k=4", "sort=acceptance_length&dir=asc",
            "temperature=1&task=chat", "k=2&page=3", "method=ngram&batch_size=64")]
    drafter_urls = [f"{base}/drafters/{s}/" for s in slugs]
    print(f"{total} Result rows; protocol {protocol}; {len(slugs)} drafter pages sampled; "
          f"server: {args.server} on 127.0.0.1:{args.port}, DEBUG off; "
          f"cache {os.environ.get('SPECBOARD_CACHE_URL') or cache_url()}; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    proc = start_server(args.port, args.server, args.workers, args.threads)
    failed = False
    try:
        run_load(board_urls + drafter_urls, len(board_urls) + len(drafter_urls), 1)  # warm up
        time.sleep(1)
        _, seen = server_times(0)
        print(f"\n{'':<21} {'server time (ms)':^26}  {'client response time (ms)':^26}")
        print(f"{'page':<12} {'clients':>8} {'p50':>8} {'p95':>8} {'max':>8}  {'p50':>8} "
              f"{'p95':>8} {'max':>8} {'requests':>8} {'req/s':>6} {'errors':>6}")
        for name, urls in (("leaderboard", board_urls), ("drafter", drafter_urls)):
            for clients in (1, args.clients):
                n = args.requests if clients > 1 else max(args.requests // 4, 20)
                times, errors, wall = run_load(urls, n, clients)
                time.sleep(1)  # let the access log catch up
                stimes, seen = server_times(seen)
                s50, s95, smax = ((statistics.median(stimes), pct(stimes, 95), max(stimes))
                                  if stimes else (float("nan"),) * 3)
                p50, p95 = statistics.median(times), pct(times, 95)
                print(f"{name:<12} {clients:>8} {s50:>8.1f} {s95:>8.1f} {smax:>8.1f}  {p50:>8.1f} "
                      f"{p95:>8.1f} {max(times):>8.1f} {len(times):>8} {len(times) / wall:>6.1f} "
                      f"{errors:>6}", flush=True)
                failed |= errors > 0 or (s95 if stimes else p95) > GOAL_P95_MS
    finally:
        stop_server(proc)
    print(f"load average at the end: {os.getloadavg()[0]:.1f} (other processes share the CPUs)")
    print(f"\ngoal p95 <= {GOAL_P95_MS:.0f} ms and no errors: {'MISSED' if failed else 'met'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
