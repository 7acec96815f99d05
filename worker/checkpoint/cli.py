"""``python -m worker validate --method METHOD --target DIR FILE...``: validate a drafter
checkpoint as an upload would be, without the site."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from worker import methods
from worker.checkpoint.results import CheckpointRejected, Problem, TargetFacts, Upload
from worker.checkpoint.validate import validate_checkpoint, validate_method_params


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", required=True, choices=methods.DRAFTER_METHODS)
    parser.add_argument("--target", required=True, type=Path,
                        help="the target's folder (its config.json gives vocab/hidden/layers)")
    parser.add_argument("--max-bytes", type=int,
                        default=int(os.environ.get("SPECBOARD_MAX_UPLOAD_BYTES", 20 * 1024 ** 3)),
                        help="upload size limit in bytes (default: $SPECBOARD_MAX_UPLOAD_BYTES "
                             "or 20 GiB)")
    parser.add_argument("--params", default=None,
                        help="ngram: the parameters as JSON, e.g. "
                             "'{\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 4}'")
    parser.add_argument("--ks", default="1,2,3,4,5,6,7,8",
                        help="ngram: allowed speculation budgets k, comma separated")
    parser.add_argument("files", nargs="*", type=Path,
                        help="the checkpoint's files, or one .zip/.tar.gz/.tgz")


def cli(args) -> int:
    try:
        target = TargetFacts.from_config(args.target)
    except (OSError, ValueError) as e:
        print(f"cannot read the target's config.json: {e}")
        return 2
    uploads = []
    for path in args.files:
        if not path.is_file():
            print(f"{path}: not a file")
            return 2
        uploads.append(Upload(path.name, path, path.stat().st_size))
    try:
        if args.params is not None:
            try:
                params = json.loads(args.params)
            except ValueError as e:
                raise CheckpointRejected([Problem("params", "params", f"not JSON: {e}")])
            ks = [int(k) for k in str(args.ks).split(",") if k.strip()]
            print(f"params: {json.dumps(validate_method_params(args.method, params, ks))}")
        result = validate_checkpoint(uploads, args.method, target, max_total_bytes=args.max_bytes)
    except CheckpointRejected as e:
        print(str(e))
        return 1
    with result:
        print(f"OK content_sha256={result.content_sha256}")
        print(f"method={result.method} files={len(result.files)} bytes={result.total_bytes} "
              f"tensors={result.tensor_count} parameters={result.parameter_count}")
        for f in result.files:
            print(f"  {f.sha256}  {f.size:>14}  {f.name}")
        for name in result.ignored:
            print(f"  ignored: {name}")
        intake = result.intake
        if intake.get("format"):
            print(f"format: {intake['format']}"
                  + (f" (verifier {intake['verifier']})" if intake.get("verifier") else ""))
        for note in intake.get("notes", []):
            print(f"  note: {note}")
    return 0
