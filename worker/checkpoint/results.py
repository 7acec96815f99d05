"""What validation takes and gives: the uploads, the target's facts, each problem found,
and the validated checkpoint (its files in a temporary directory, its content hash)."""
from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Mapping, NamedTuple

from worker.protocol import canonical_json


class Upload(NamedTuple):
    """One uploaded file: its name, a readable binary file object or a path, its size."""
    name: str
    source: Any
    size: int | None = None


@dataclass(frozen=True)
class TargetFacts:
    vocab_size: int
    hidden_size: int
    num_layers: int
    name: str = ""   # the target's model name, compared with a verifier a drafter names

    @classmethod
    def from_config(cls, folder_or_file) -> "TargetFacts":
        """Read the facts from a target's config.json (or the folder holding it)."""
        path = Path(folder_or_file)
        if path.is_dir():
            path = path / "config.json"
        cfg = json.loads(path.read_text())
        text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
        def get(key):
            value = cfg.get(key, text.get(key))
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{path}: {key} must be a positive integer, got {value!r}")
            return value
        return cls(get("vocab_size"), get("hidden_size"), get("num_hidden_layers"))


@dataclass(frozen=True)
class Problem:
    """One reason an upload is refused: the uploaded file, the archive member (if any),
    the field (a config key, a tensor, or an aspect such as ``extension``/``size``/``path``)
    and what is wrong and how to fix it."""
    file: str
    field: str
    message: str
    member: str | None = None

    @property
    def where(self) -> str:
        return f"{self.file} -> {self.member}" if self.member else self.file

    def __str__(self) -> str:
        return f"{self.where} [{self.field}]: {self.message}"

    def as_dict(self) -> dict:
        return {"file": self.file, "member": self.member, "field": self.field,
                "message": self.message}


class CheckpointRejected(Exception):
    """The upload was refused; ``problems`` lists every reason found."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        super().__init__(self.__str__())

    def __str__(self) -> str:
        n = len(self.problems)
        lines = [f"checkpoint rejected: {n} problem{'s' if n != 1 else ''}"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)

    def as_dicts(self) -> list[dict]:
        return [p.as_dict() for p in self.problems]


@dataclass(frozen=True)
class CheckpointFile:
    name: str          # relative name inside the checkpoint, e.g. "model.safetensors"
    size: int
    sha256: str
    path: Path         # the validated bytes, inside the result's temporary directory
    source: str        # the uploaded file it came from
    member: str | None = None  # the archive member it came from

    def open(self) -> BinaryIO:
        return open(self.path, "rb")


@dataclass
class ValidatedCheckpoint:
    method: str
    files: list[CheckpointFile]
    content_sha256: str
    config: dict | None
    parameter_count: int
    tensor_count: int
    ignored: list[str] = field(default_factory=list)
    temp_dir: Path | None = None
    # The published format and what intake did to it (worker/checkpoint/formats.py Intake).
    intake: dict = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def file(self, name: str) -> CheckpointFile:
        for f in self.files:
            if f.name == name:
                return f
        raise KeyError(name)

    def cleanup(self) -> None:
        """Remove the temporary directory (after the caller has stored the files)."""
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None

    def __enter__(self) -> "ValidatedCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()


def content_sha256(tensors: Mapping[str, tuple[str, list[int], str]],
                   config: dict | None) -> str:
    """The identity of a checkpoint: sha256 over what vLLM loads, each tensor's name, dtype,
    shape and bytes (sorted by name: ``tensor_digests``), and config.json as canonical JSON.
    File names, shards, safetensors metadata and JSON formatting do not count, so a
    reformatted or re-sharded copy of a drafter is the same drafter."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        dtype, shape, digest = tensors[name]
        h.update(json.dumps([name, dtype, list(shape), digest]).encode() + b"\n")
    h.update(b"config\0" + canonical_json(config).encode())
    return h.hexdigest()
