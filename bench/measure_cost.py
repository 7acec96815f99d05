"""What a measurement costs, and how repeatable it is (a benchmark, not a test).

For the demo protocol (or a smaller one with --prompts-per-task), measures a drafter run
REPEATS times through the same code path as a Celery worker (leaderboard.services.runs.execute_run),
in a throw-away SQLite database, and prints:
- the run's wall time and the share spent generating (sum of the cells' wall times)
  against engine start + warm-up, set-up (building the job from the database) and database
  writes (recording cells and progress);
- over the repeats, the coefficient of variation of output throughput per cell;
- whether the acceptance figures are identical across repeats at temperature 0.
Goals: overhead <= 20% of the wall time; throughput CV <= 5% at batch sizes >= 4;
acceptance identical across repeats at temperature 0.

    .venv/bin/python bench/measure_cost.py [--drafter ngram|baseline] [--repeats 3]
                                           [--prompts-per-task 16]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default="ngram", choices=["ngram", "baseline"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts-per-task", type=int, default=None)
    args = parser.parse_args()

    var = tempfile.mkdtemp(prefix="specboard-bench-")
    os.environ["SPECBOARD_VAR_DIR"] = var
    os.environ.setdefault("SPECBOARD_DATA_DIR", str(ROOT / "var" / "data"))
    os.environ.pop("DATABASE_URL", None)
    os.environ["DJANGO_SETTINGS_MODULE"] = "leaderboard.settings"
    import django

    django.setup()
    from django.core.management import call_command

    from leaderboard.models import Result
    from leaderboard.services import runs, setup

    call_command("migrate", verbosity=0)
    rows = setup.setup_demo(progress=lambda m: None, prompts_per_task=args.prompts_per_task)
    protocol = rows["protocol"]
    drafter = None if args.drafter == "baseline" else rows["drafters"][0]

    timers = {"db": 0.0, "setup": 0.0}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                timers[name] += time.perf_counter() - t
        return wrapper

    # Instrument the real code path (timing only; behaviour unchanged).
    runs.record_cell = timed("db", runs.record_cell)
    runs.update_progress = timed("db", runs.update_progress)
    runs.record_started = timed("db", runs.record_started)
    runs.build_job = timed("setup", runs.build_job)

    if drafter is not None:  # the baseline first, so that speedups are computed as usual
        runs.execute_run(runs.queue_run(protocol, None, send=False).pk)

    measured = []
    for repeat in range(args.repeats):
        timers.update(db=0.0, setup=0.0)
        run = runs.queue_run(protocol, drafter, send=False)
        t = time.perf_counter()
        state = runs.execute_run(run.pk)
        wall = time.perf_counter() - t
        run.refresh_from_db()
        if state != "succeeded":
            print(f"run {run.pk} {state}: {run.error}\n{run.log_tail}")
            return 1
        cells = list(Result.objects.filter(run=run))
        generating = sum(c.wall_seconds for c in cells)
        rest = wall - generating - timers["db"] - timers["setup"]
        print(f"repeat {repeat + 1}: wall {wall:.1f}s | generating {generating:.1f}s "
              f"({generating / wall:.0%}) | engine start + warm-up + process {rest:.1f}s "
              f"({rest / wall:.0%}) | set-up {timers['setup']:.2f}s ({timers['setup'] / wall:.1%}) "
              f"| database writes {timers['db']:.2f}s ({timers['db'] / wall:.1%}) "
              f"| overhead {1 - generating / wall:.0%} (goal <= 20%)")
        measured.append({(c.task, c.batch_size, c.temperature, c.k): c for c in cells})

    print("\ncell (task, batch, temperature, k): throughput mean tok/s, CV over repeats, "
          "acceptance identical")
    worst_cv_large_batch, all_identical = 0.0, True
    for key in sorted(measured[0]):
        values = [m[key].output_throughput for m in measured]
        mean = statistics.fmean(values)
        cv = statistics.pstdev(values) / mean if len(values) > 1 and mean else 0.0
        acceptance = {(m[key].drafts, m[key].accepted_tokens, tuple(m[key].accepted_at))
                      for m in measured}
        identical = len(acceptance) == 1
        if key[2] == 0:
            all_identical &= identical
        if key[1] >= 4:
            worst_cv_large_batch = max(worst_cv_large_batch, cv)
        print(f"  {key}: {mean:8.1f} tok/s  CV {cv:5.1%}  "
              f"AL {measured[0][key].acceptance_length or 1:.3f}  identical={identical}")
    print(f"\nworst throughput CV at batch >= 4: {worst_cv_large_batch:.1%} (goal <= 5%)")
    print(f"acceptance identical across repeats at temperature 0: {all_identical}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
