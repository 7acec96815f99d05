"""Export speed and memory of /api/results?format=csv (a benchmark, not a test).

Seeds Result rows in a dedicated PostgreSQL database (created if missing, migrated, and
reseeded only when its row counts differ): LARGE rows under protocol bench-large and SMALL
rows under bench-small, each a baseline run and drafter runs whose figures worker.metrics
computes from chosen counts (tests/factories.py). Then exports each protocol through the
real view (Django's test Client, the whole stack from URL to streamed bytes), with each
CSV writer (on PostgreSQL the database writes the lines, COPY ... TO STDOUT; the portable
path, used on SQLite, is csv.writer over values_list().iterator()), and prints per export:
- rows per second: wall time from the request to the last byte (no tracing), and per
  CPU second of this process (what the web process spends; the machine's load average is
  printed too, since a shared machine slows the wall figure);
- peak traced Python memory during the export (tracemalloc, a separate pass);
- growth of the resident set during the export (VmHWM after resetting it, minus VmRSS
  before).
Goals: >= 50,000 rows/s at LARGE rows; peak memory that does not grow with the row count
(the LARGE and SMALL peaks within a small constant of each other).

    .venv/bin/python bench/export.py [--rows 100000] [--small 20000] [--format csv|json]
        [--writer copy|csv.writer|both] [--repeats 3]
        [--database-url postgres://postgres@127.0.0.1:5432/specboard_bench_export]
"""
import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/specboard_bench_export"
TASKS = ("chat", "code", "math", "rag")
BATCH_SIZES = (1, 2, 4, 8, 16)
TEMPERATURES = (0.0, 0.7)
KS = (1, 2, 3, 4, 5)
CELLS_PER_RUN = len(TASKS) * len(BATCH_SIZES) * len(TEMPERATURES) * len(KS)  # 200


def create_database(url):
    u = urlparse(url)
    name = u.path.lstrip("/")
    args = ["psql", "-h", u.hostname or "127.0.0.1", "-p", str(u.port or 5432),
            "-U", u.username or "postgres", "-d", "postgres", "-tAc"]
    exists = subprocess.run(args + [f"SELECT 1 FROM pg_database WHERE datname = '{name}'"],
                            capture_output=True, text=True, check=True).stdout.strip()
    if exists != "1":
        subprocess.run(args + [f'CREATE DATABASE "{name}"'], check=True, capture_output=True)
        print(f"created database {name}")


def seed(slug, n_rows, progress):
    """A protocol with a baseline run and enough drafter runs for n_rows cells."""
    from django.db import transaction

    from leaderboard.models import Protocol, Result
    from tests import factories as f
    from worker.protocol import Cell, cell_key

    existing = Protocol.objects.filter(slug=slug).first()
    if existing is not None:
        if Result.objects.filter(run__protocol=existing).count() == n_rows:
            return existing
        existing.runs.all().delete()
        existing.delete()
    target = f.make_target("bench-target", vocab_size=64, hidden_size=16, num_layers=2)
    # A task holds at least as many prompts as the largest batch size (Protocol's check).
    prompts = f.make_prompt_set(f"{slug}-prompts", per_category=max(BATCH_SIZES))
    protocol = f.make_protocol(target, slug=slug, hardware=f"{slug}-hw", tasks=TASKS,
                               batch_sizes=BATCH_SIZES, temperatures=TEMPERATURES, ks=KS,
                               prompt_set=prompts)
    spec = protocol.spec
    task_index = {t: i for i, t in enumerate(TASKS)}
    with transaction.atomic():
        baseline = f.make_run(protocol)
        base = f.add_baseline_results(baseline)
    by_cell = {cell_key(r): r for r in base}
    left, i, batch = n_rows - len(base), 0, []
    cells = spec.cells(with_drafter=True)
    while left > 0:
        drafter = f.make_drafter(target, f"{slug} drafter {i}",
                                 params={"prompt_lookup_min": 1 + i % 3,
                                         "prompt_lookup_max": 4 + i % 5, "n": i})
        run = f.make_run(protocol, drafter)
        quality = 0.3 + 0.6 * (i % 97) / 97
        for c in cells[:left]:
            b = by_cell[Cell.of(c, k=0).key]   # the baseline cell at the same place
            counts = f.drafter_counts(quality, task_index[c.task], c.batch_size,
                                      c.temperature, c.k)
            batch.append(f.result_from_counts(run, c.task, c.batch_size, c.temperature, c.k,
                                              counts, baseline=b))
        left -= min(left, len(cells))
        i += 1
        if len(batch) >= 5000 or left <= 0:
            Result.objects.bulk_create(batch, batch_size=5000)
            progress(f"  {slug}: {n_rows - left} / {n_rows} rows")
            batch = []
    return protocol


def rss_kb(field="VmRSS"):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def reset_peak_rss():
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux >= 4.0)
        return True
    except OSError:
        return False


def export(client, protocol, fmt, trace):
    """(rows, bytes, wall s, CPU s, tracemalloc peak bytes or None, RSS growth KiB,
    Content-Disposition)."""
    gc.collect()
    reset_peak_rss()
    rss_before = rss_kb()
    if trace:
        tracemalloc.start()
    t, cpu = time.perf_counter(), time.process_time()
    response = client.get("/api/results", {"protocol": f"{protocol.slug}@{protocol.version}",
                                           "format": fmt})
    assert response.status_code == 200, response.content[:500]
    n_bytes = lines = 0
    last = b""
    for chunk in response.streaming_content:
        n_bytes += len(chunk)
        lines += chunk.count(b"\n")
        last = chunk or last
    seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
    peak = None
    if trace:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    growth = rss_kb("VmHWM") - rss_before
    rows = lines - 1 if fmt == "csv" else lines  # csv: a header line; json: one row a line
    assert last.endswith(b"\n")
    return rows, n_bytes, seconds, cpu, peak, growth, response["Content-Disposition"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--small", type=int, default=20_000)
    parser.add_argument("--format", default="csv", choices=["csv", "json"])
    parser.add_argument("--repeats", type=int, default=3, help="timed exports of each size")
    parser.add_argument("--writer", default="both", choices=["copy", "csv.writer", "both"],
                        help="CSV writer (copy: PostgreSQL writes the lines)")
    parser.add_argument("--database-url", default=os.environ.get("BENCH_DATABASE_URL",
                                                                 DEFAULT_URL))
    args = parser.parse_args()

    create_database(args.database_url)
    os.environ["DATABASE_URL"] = args.database_url
    os.environ["SPECBOARD_VAR_DIR"] = tempfile.mkdtemp(prefix="specboard-bench-export-")
    os.environ["DEBUG"] = "false"  # as in production: no query log
    os.environ.setdefault("SECRET_KEY", "bench-export-not-secret")
    os.environ["DJANGO_SETTINGS_MODULE"] = "leaderboard.settings"
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection
    from django.test import Client

    call_command("migrate", verbosity=0)
    print(f"database: {connection.settings_dict['NAME']} ({connection.vendor}); "
          f"seeding if needed ...", flush=True)
    t = time.perf_counter()
    large = seed("bench-large", args.rows, lambda m: print(m, flush=True))
    small = seed("bench-small", args.small, lambda m: print(m, flush=True))
    print(f"seeded in {time.perf_counter() - t:.1f}s\n")

    from leaderboard.api import results as api_results

    client = Client()
    export(client, small, args.format, trace=False)  # warm-up (imports, first queries)
    writers = ["copy", "csv.writer"] if args.writer == "both" else [args.writer]
    if args.format == "json":
        writers = ["json"]
    verdicts = []
    for writer in writers:
        api_results.CSV_BY_COPY = writer == "copy"
        print(f"--- {args.format} via {writer}; load average {os.getloadavg()[0]:.1f} on "
              f"{os.cpu_count()} CPUs", flush=True)
        results = {}
        for name, protocol in (("large", large), ("small", small)):
            timed = [export(client, protocol, args.format, trace=False)
                     for _ in range(args.repeats)]
            traced = export(client, protocol, args.format, trace=True)
            best = min(timed, key=lambda r: r[2])
            results[name] = (best, traced)
            rows, n_bytes, seconds, cpu, _, growth, disposition = best
            print(f"{protocol.slug}: {rows:,} rows, {n_bytes / 1e6:.1f} MB in {seconds:.2f}s "
                  f"(best of {args.repeats}) = {rows / seconds:,.0f} rows/s wall, "
                  f"{rows / cpu:,.0f} rows per CPU s; RSS growth {growth / 1024:.1f} MiB; "
                  f"tracemalloc peak {traced[4] / 2**20:.2f} MiB; {disposition}", flush=True)
        (lb, lt), (sb, st) = results["large"], results["small"]
        rate, ratio = lb[0] / lb[2], lt[4] / st[4]
        verdicts.append(
            f"{writer}: {rate:,.0f} rows/s wall, {lb[0] / lb[3]:,.0f} rows per CPU s at "
            f"{lb[0]:,} rows (goal >= 50,000 rows/s: {'met' if rate >= 50_000 else 'NOT met'}"
            f"{'' if rate >= 50_000 else ' on the wall clock'}); peak traced memory "
            f"{lt[4] / 2**20:.2f} MiB at {lb[0]:,} rows vs {st[4] / 2**20:.2f} MiB at "
            f"{sb[0]:,} rows = x{ratio:.2f} for x{lb[0] / sb[0]:.1f} rows "
            f"(goal, no growth: {'met' if ratio < 1.5 else 'NOT met'})")
    print("\n" + "\n".join(verdicts))


if __name__ == "__main__":
    main()
