"""``validate_checkpoint`` run in a sandboxed child (worker/sandbox.py), so that an upload's
archives, JSON and headers are never parsed by the calling process: a zip of a huge JSON
array, or a tar with a giant extended header, costs the child's memory, bounded by its
limits, not the web worker's. The validated files stay in a folder the caller owns; the
result and every refusal come back as they would from ``validate_checkpoint``.

The child is ``python -m worker.checkpoint.sandboxed REQUEST.json``."""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from worker.checkpoint.results import (CheckpointFile, CheckpointRejected, Problem, TargetFacts,
                                       Upload, ValidatedCheckpoint)
from worker.sandbox import GiB, Limits, SandboxError, run_module, write_result

COPY_CHUNK = 1 << 20


def limits_for(max_total_bytes: int) -> Limits:
    """Room for the checks (archives are streamed) and for converting a published pickle,
    whose own child (worker/checkpoint/convert.py) inherits this address-space cap."""
    return Limits(address_space=3 * GiB + 2 * max_total_bytes,
                  cpu_seconds=120 + max_total_bytes // (4 << 20),
                  wall_seconds=600 + max_total_bytes / (2 << 20),
                  file_bytes=max_total_bytes + (64 << 20))


def _as_path(up: Upload, staging: Path, i: int) -> str:
    """A path the child can open: the upload's own file when it has one (a path, or
    Django's temporary upload file), else a copy written into ``staging``."""
    source = up.source
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    temporary = getattr(source, "temporary_file_path", None)
    if callable(temporary):
        return temporary()
    dest = staging / f"{i:04d}"
    if hasattr(source, "seek"):
        source.seek(0)
    with open(dest, "wb") as out:
        for chunk in iter(lambda: source.read(COPY_CHUNK), b""):
            out.write(chunk)
    return str(dest)


def validate_in_sandbox(uploads, method: str, target: TargetFacts, *, max_total_bytes: int,
                        max_files: int | None = None, tmp_root=None,
                        limits: Limits | None = None) -> ValidatedCheckpoint:
    """``validate_checkpoint`` in a child under ``limits`` (default ``limits_for``). Same
    arguments and result; the result's files live under a new folder of ``tmp_root`` that
    ``cleanup()`` removes (removed at once on a refusal)."""
    uploads = [u if isinstance(u, Upload) else Upload(*u) for u in uploads]
    work = Path(tempfile.mkdtemp(prefix="specboard-intake-", dir=tmp_root))
    try:
        staging = work / "staging"
        staging.mkdir()
        request = {
            "uploads": [[u.name, _as_path(u, staging, i), u.size] for i, u in enumerate(uploads)],
            "method": method, "target": [target.vocab_size, target.hidden_size,
                                         target.num_layers, target.name],
            "max_total_bytes": max_total_bytes, "max_files": max_files, "out": str(work)}
        (work / "request.json").write_text(json.dumps(request))
        try:
            result = run_module("worker.checkpoint.sandboxed", [str(work / "request.json")],
                                limits or limits_for(max_total_bytes))
        except SandboxError as e:
            raise CheckpointRejected([Problem("(upload)", "checks", f"the checks of this upload "
                                              f"stopped: they {e.reason}")]) from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if "problems" in result:
            raise CheckpointRejected([Problem(**p) for p in result["problems"]])
        files = [CheckpointFile(f["name"], f["size"], f["sha256"], Path(f["path"]), f["source"],
                                f["member"]) for f in result["files"]]
        if not all(work in f.path.parents for f in files):
            raise CheckpointRejected([Problem("(upload)", "checks", "the checks returned files "
                                              "outside their folder")])
        return ValidatedCheckpoint(
            method=result["method"], files=files, content_sha256=result["content_sha256"],
            config=result["config"], parameter_count=result["parameter_count"],
            tensor_count=result["tensor_count"], ignored=result["ignored"], temp_dir=work,
            intake=result["intake"])
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def main(argv: list[str]) -> int:
    from worker.checkpoint.archives import DEFAULT_MAX_FILES
    from worker.checkpoint.validate import validate_checkpoint

    request = json.loads(Path(argv[0]).read_text())
    try:
        ckpt = validate_checkpoint(
            [Upload(*u) for u in request["uploads"]], request["method"],
            TargetFacts(*request["target"]), max_total_bytes=request["max_total_bytes"],
            max_files=request["max_files"] or DEFAULT_MAX_FILES, tmp_root=request["out"])
    except CheckpointRejected as e:
        write_result({"problems": e.as_dicts()})
        return 0
    write_result({
        "method": ckpt.method, "content_sha256": ckpt.content_sha256, "config": ckpt.config,
        "parameter_count": ckpt.parameter_count, "tensor_count": ckpt.tensor_count,
        "ignored": ckpt.ignored, "intake": ckpt.intake,
        "files": [{"name": f.name, "size": f.size, "sha256": f.sha256, "path": str(f.path),
                   "source": f.source, "member": f.member} for f in ckpt.files]})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
