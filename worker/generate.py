"""`python -m worker generate`: generate with the reference engine and print the step trace.

    python -m worker generate --target DIR [--drafter METHOD[:DIR]] [--k K]
        [--batch-file FILE] --prompt TEXT --max-new-tokens N --temperature T [--seed S] [--json]

Prompts go through the target's chat template unless --raw. With --batch-file (one prompt a
line) and --prompt given together, the --prompt comes first. Prints, per sequence, the output
token ids, the text and every step (drafted tokens, accepted prefix, bonus token, times).
"""
from __future__ import annotations

import json
import sys


def add_cli_arguments(parser):
    parser.add_argument("--target", required=True, help="target checkpoint folder (config.json + safetensors)")
    parser.add_argument("--drafter", default=None,
                        help="METHOD[:DIR], e.g. ngram or draft_model:/path/to/draft (default: none)")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="a proposer parameter, e.g. prompt_lookup_max=3 (repeatable)")
    parser.add_argument("--k", type=int, default=4, help="tokens drafted per step (default 4)")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--batch-file", default=None, help="a file of prompts, one per line")
    parser.add_argument("--raw", action="store_true", help="tokenise prompts as they are, no chat template")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print JSON")


def parse_drafter(spec: str | None):
    """'ngram' -> ('ngram', None); 'draft_model:/x' -> ('draft_model', '/x')."""
    if not spec:
        return None, None
    method, _, path = spec.partition(":")
    return method, (path or None)


def _parse_value(text):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def cli(args) -> int:
    import torch

    from worker import traces
    from worker.engines.reference import ReferenceEngine
    from worker.methods import make_proposer

    prompts = list(args.prompt)
    if args.batch_file:
        with open(args.batch_file, encoding="utf-8") as fh:
            prompts += [line.rstrip("\n") for line in fh if line.strip()]
    if not prompts:
        print("error: give --prompt or --batch-file", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = ReferenceEngine(args.target, dtype=args.dtype)
    method, path = parse_drafter(args.drafter)
    params = dict(item.split("=", 1) for item in args.param)
    proposer = make_proposer(method, path, **{k: _parse_value(v) for k, v in params.items()}) if method else None
    if engine.tokenizer is None and not args.raw:
        print("error: the target has no tokenizer; use --raw with space-separated token ids",
              file=sys.stderr)
        return 2
    if engine.tokenizer is None:
        prompt_ids = [[int(t) for t in p.split()] for p in prompts]
    elif args.raw:
        prompt_ids = [engine.tokenizer.encode(p) for p in prompts]
    else:
        prompt_ids = [engine.encode_chat(p) for p in prompts]
    results = engine.generate(prompt_ids, proposer=proposer, k=args.k,
                              max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, seed=args.seed)
    report = {
        "target": str(args.target), "drafter": args.drafter, "k": args.k if method else 0,
        "temperature": args.temperature, "seed": args.seed, "max_new_tokens": args.max_new_tokens,
        "summary": traces.summary(results),
        "sequences": [{"index": i, "prompt": prompt, **r.to_dict()}
                      for i, (prompt, r) in enumerate(zip(prompts, results))],
    }
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(_readable(report, engine))
    return 0


def _readable(report, engine) -> str:
    s = report["summary"]
    lines = [f"target {report['target']}  drafter {report['drafter'] or 'none'}  k {report['k']}  "
             f"temperature {report['temperature']}",
             f"{s['generated_tokens']} tokens in {s['wall_s']:.2f} s "
             f"({s['output_throughput'] or 0:.1f} tok/s)"
             + (f", acceptance length {s['acceptance_length']:.2f}" if s["acceptance_length"] else "")]
    shares = s["time_breakdown"]["shares"]
    lines.append("time: " + ", ".join(f"{p} {100 * (v or 0):.1f}%" for p, v in shares.items()))
    for seq in report["sequences"]:
        lines += ["", f"[{seq['index']}] {seq['prompt']!r}", f"output ids: {seq['output_ids']}",
                  f"text: {seq['text']}",
                  f"finish: {seq['finish_reason']}  latency {seq['timings']['wall']:.2f} s"]
        for st in seq["steps"]:
            piece = engine.decode(st["emitted"]) if engine.tokenizer is not None else ""
            drafted = f"drafted {st['drafted']} accepted {st['accepted']} " if st["drafted"] else ""
            lines.append(f"  step {st['step']:3d}: {drafted}bonus {st['bonus']}  -> {piece!r}")
    return "\n".join(lines)
