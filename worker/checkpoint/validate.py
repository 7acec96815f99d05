"""The two entry points of a submission's validation: ``validate_checkpoint`` for a
drafter's files and ``validate_method_params`` for a submission's method parameters."""
from __future__ import annotations

import os
import shutil
from typing import Iterable, Mapping

from worker import methods
from worker.checkpoint.archives import DEFAULT_MAX_FILES, Extraction
from worker.checkpoint.formats import Intake, prepare
from worker.checkpoint.contents import check_contents
from worker.checkpoint.results import (CheckpointFile, CheckpointRejected, Problem, TargetFacts,
                                       Upload, ValidatedCheckpoint, content_sha256)
from worker.safetensors_header import tensor_digests
from worker.safetensors_header import is_int


def check_files_given(method: str, names: list[str], hub_reference: str = "") -> None:
    """By names alone: the method is known, and it has files (or a hub reference) exactly
    when it needs weights. The submit page checks this at once; the full checks again."""
    if method not in methods.DRAFTER_METHODS:
        raise CheckpointRejected([Problem("(method)", "method", f"unknown method {method!r}: "
                                          f"use one of {', '.join(methods.DRAFTER_METHODS)}")])
    if not methods.get(method).needs_weights:
        if names or hub_reference:
            raise CheckpointRejected(
                [Problem(name, "method", f"the {method} method takes no files (it has "
                         "parameters only): remove the file") for name in names]
                + ([Problem("(hub)", "hub_reference", f"the {method} method takes no files "
                            "(it has parameters only): leave the hub reference empty")]
                   if hub_reference else []))
    elif not names and not hub_reference:
        raise CheckpointRejected([Problem("(upload)", "files", f"a {method} drafter needs "
                                          "files: config.json and .safetensors weights (or "
                                          "a model-hub reference)")])


def validate_checkpoint(uploads: Iterable, method: str, target, *, max_total_bytes: int,
                        max_files: int = DEFAULT_MAX_FILES,
                        tmp_root: str | os.PathLike | None = None) -> ValidatedCheckpoint:
    """Validate an upload; see worker/checkpoint/__init__.py for the rules.

    ``uploads``: ``(name, file object or path, size)`` triples (``Upload``); ``target``: a
    ``TargetFacts`` or a mapping with vocab_size, hidden_size, num_layers. Returns a
    ``ValidatedCheckpoint`` whose files live in a temporary directory under ``tmp_root``
    (the system default if None) that the caller removes with ``cleanup()``; raises
    ``CheckpointRejected`` with every problem found, after removing that directory.
    """
    uploads = [u if isinstance(u, Upload) else Upload(*u) for u in uploads]
    if not isinstance(target, TargetFacts):
        target = TargetFacts(int(target["vocab_size"]), int(target["hidden_size"]),
                             int(target["num_layers"]))
    check_files_given(method, [u.name for u in uploads])
    if not methods.get(method).needs_weights:
        return ValidatedCheckpoint(method, [], content_sha256({}, None), None, 0, 0)

    run = Extraction(max_total_bytes, max_files, tmp_root)
    try:
        run.collect(uploads)
        config, params, count = (None, 0, 0)
        intake = Intake()
        if not run.aborted:
            intake = prepare(run, methods.get(method), target)
            config, params, count = check_contents(run, methods.get(method), target,
                                                   intake.rules_config)
        if run.problems:
            raise CheckpointRejected(run.problems)
        files = [CheckpointFile(e.name, e.size, e.sha256, e.path, e.source, e.member)
                 for e in sorted(run.entries, key=lambda e: e.name)]
        archive_copy = run.tmp / "archive"
        if archive_copy.exists():
            archive_copy.unlink()
        return ValidatedCheckpoint(
            method=method, files=files,
            content_sha256=checkpoint_content_sha256(
                (f.path for f in files if f.name.endswith(".safetensors")), config),
            config=config, parameter_count=params, tensor_count=count,
            ignored=sorted(run.ignored), temp_dir=run.tmp, intake=intake.as_dict())
    except BaseException:
        shutil.rmtree(run.tmp, ignore_errors=True)
        raise


def checkpoint_content_sha256(weights: Iterable[os.PathLike], config: dict | None) -> str:
    """``content_sha256`` of a checkpoint: the tensors of its checked ``.safetensors`` files
    and config.json's object."""
    tensors = {}
    for path in weights:
        tensors.update(tensor_digests(path))
    return content_sha256(tensors, config)


def validate_method_params(method: str, params: Mapping, allowed_ks: Iterable[int]) -> dict:
    """Check a submission's method parameters by the method's own rule
    (``Method.check_submitted_params``; n-gram: worker.methods.ngram.lookup_bounds), and
    ``k`` (optional; the protocol's budgets apply when it is absent) in ``allowed_ks``. A
    method without such a rule takes k alone. Returns the normalised parameters or raises
    CheckpointRejected."""
    problems = []
    allowed = sorted(set(allowed_ks))
    rule = methods.get(method).check_submitted_params
    keys = (*(methods.ALLOWED_PARAMS[method] if rule else ()), "k")

    def bad(fld, msg):
        problems.append(Problem("params", fld, msg))

    if not isinstance(params, Mapping):
        raise CheckpointRejected([Problem("params", "params", "must be a JSON object")])
    for key in params:
        if key in keys:
            continue
        takers = [m.name for m in methods.REGISTRY.values()
                  if m.check_submitted_params and key in m.params]
        bad(key, f"applies to the {', '.join(takers)} method only: leave it empty for {method}"
            if takers else f"unknown parameter: {method} takes {', '.join(keys)}")
    out = {}
    if rule:
        out, rule_problems = rule(params)
        for key, msg in rule_problems:
            bad(key, msg)
    if "k" in params:
        k = params["k"]
        if not is_int(k) or k not in allowed:
            bad("k", f"must be one of the protocol's speculation budgets {allowed}, got {k!r}")
        else:
            out["k"] = k
    if problems:
        raise CheckpointRejected(problems)
    return out

