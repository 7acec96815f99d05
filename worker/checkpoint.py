"""Drafter upload validation: one pure function that the submit form, the REST API and
``python -m worker validate`` all call before anything is stored. No Django here.

    with validate_checkpoint(uploads, "draft_model", target, max_total_bytes=...) as ckpt:
        ...store each ckpt.files[i].path under ckpt.files[i].name, record ckpt.content_sha256...

``uploads`` is a list of ``(name, source, size)``: ``source`` is a readable binary file
object (a Django ``UploadedFile`` works) or a path. Either several loose files, or exactly
one ``.zip`` / ``.tar.gz`` / ``.tgz`` archive.

Rules (each refusal is a ``Problem(file, field, message, member)``; all of them are
collected and raised together as ``CheckpointRejected``):

Files
- Only ``.json`` and ``.safetensors`` files are accepted. Pickle-capable formats
  (``.bin .pt .pth .pkl .pickle .ckpt .joblib``) are refused by name, never opened, with
  how to convert them; code (``.py`` ...) is refused as remote code; anything else is
  refused with the list of what is accepted.
- Operating-system junk in archives or uploads (``__MACOSX/``, ``.DS_Store``, ``._*``
  AppleDouble files, ``Thumbs.db``, ``desktop.ini``) is IGNORED: it is never extracted,
  not part of the checkpoint or of its hash, and listed in ``ValidatedCheckpoint.ignored``.
  Its names still pass the path and file-type checks below, so it cannot smuggle a link.
- Names (loose or archive members): no absolute paths (``/x``, ``C:x``), no ``..``
  component, no backslashes or control characters, at most 16 levels and 255 characters.
  ``./`` and doubled slashes are normalised away. Duplicate names are refused.
- Archive members must be regular files (or directories, which are skipped): symlinks,
  hard links, devices, FIFOs, sparse and encrypted members are refused.
- If every member sits under one top-level folder (``mydrafter/config.json``), that folder
  is stripped, so a zipped folder and the loose files give the same names and hash.
- Size: the sum of file sizes may not exceed ``max_total_bytes``. For archives it is
  checked on the declared sizes before anything is extracted (zip) or before each member
  is written (tar), AND on the bytes actually decompressed, counted while streaming; a
  .tar.gz stream is also capped as a whole (headers included). The archive itself may not
  exceed the limit either. At most ``max_files`` files.
- ``ngram`` takes no files (its parameters: ``validate_ngram_params``).

Safetensors (headers only; no tensor is ever loaded)
- 8-byte little-endian header length N with 2 <= N <= min(file size - 8, 100 MB); the
  header is UTF-8 JSON, an object, without duplicate keys; ``__metadata__`` is a str->str
  map; every other entry has exactly ``dtype`` (a known safetensors dtype), ``shape`` (a
  list of non-negative ints) and ``data_offsets`` ([begin, end] ints, begin <= end);
  end - begin == product(shape) * dtype size; sorted by begin, the tensors tile the data
  section exactly: no overlap, no gap, the last end is the data section's length.
- Tensor names are unique across files; ``model.safetensors.index.json`` (if present)
  maps tensors to files that are present and that hold them.
- Parameter count: elements of floating-point tensors (index buffers such as EAGLE-3's
  ``d2t``/``t2d`` are not parameters).

config.json (required at the top level for every method with weights)
- Remote code is refused: an ``auto_map`` key (anywhere, in any .json file), a truthy
  ``trust_remote_code``, or a code file among the uploads.
- ``architectures`` allowed for the method, as vLLM 0.32 loads them
  (vllm/model_executor/models/registry.py ``_SPECULATIVE_DECODING_MODELS`` and
  vllm/transformers_utils/configs/eagle.py, which renames ``XForCausalLM`` to
  ``EagleXForCausalLM`` / ``Eagle3XForCausalLM``): see the ``*_ARCHITECTURES`` constants.
  Medusa configs may omit ``architectures`` (vLLM defaults it to ``MedusaModel``).
- ``vocab_size`` equals the target's (medusa: when present). eagle3: a
  ``draft_vocab_size`` different from ``vocab_size`` needs a ``d2t`` tensor of shape
  [draft_vocab_size] with an integer dtype.
- ``hidden_size`` equals the target's for eagle, eagle3 (``target_hidden_size`` when the
  head declares one), medusa and mtp heads.
- Sane sizes: 1 <= num_hidden_layers <= 200, num_attention_heads >= 1 dividing
  hidden_size, num_key_value_heads >= 1 dividing num_attention_heads, positive
  intermediate_size/head_dim; eagle3 ``eagle_aux_hidden_state_layer_ids`` within the
  target's layers.
- draft_model: ``model_type`` matches the architecture; the tensors agree with the
  config: ``model.embed_tokens.weight`` is [vocab_size, hidden_size], ``lm_head.weight``
  (or ``tie_word_embeddings``), and ``model.layers.i`` for exactly i < num_hidden_layers.

The duplicate-hash and rate-limit checks need the database and are the caller's; the
caller gets ``content_sha256`` (sha256 over the sorted (name, file sha256) pairs).
Validation writes only inside its own temporary directory, removed on failure; on success
the caller removes it with ``cleanup()`` (or by using the result as a context manager).
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import os
import re
import shutil
import stat
import struct
import tarfile
import tempfile
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Mapping, NamedTuple

METHODS = ("ngram", "draft_model", "eagle", "eagle3", "medusa", "mtp")
WEIGHT_METHODS = tuple(m for m in METHODS if m != "ngram")

ALLOWED_EXTENSIONS = (".json", ".safetensors")
ARCHIVE_EXTENSIONS = (".zip", ".tar.gz", ".tgz")
PICKLE_EXTENSIONS = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib")
CODE_EXTENSIONS = (".py", ".pyc", ".pyo", ".so", ".dll", ".dylib", ".sh", ".ipynb")
NESTED_ARCHIVE_EXTENSIONS = (".zip", ".tar", ".gz", ".tgz", ".bz2", ".xz", ".7z", ".rar", ".zst")
JUNK_DIRS = ("__MACOSX",)
JUNK_FILES = (".DS_Store", "Thumbs.db", "desktop.ini")

DEFAULT_MAX_FILES = 256
MAX_HEADER_BYTES = 100 * 1000 * 1000
MAX_JSON_BYTES = 64 * 1024 * 1024
MAX_NAME_CHARS = 255
MAX_NAME_DEPTH = 16
MAX_PROBLEMS_PER_FILE = 50
MAX_LAYERS = 200
CHUNK = 1 << 20

CONVERT_HINT = ("convert it to safetensors: load the weights in Python and save them with "
                "`safetensors.torch.save_file(state_dict, \"model.safetensors\")`, or "
                "`model.save_pretrained(out_dir, safe_serialization=True)` for a "
                "transformers model, then upload model.safetensors instead")

# Safetensors dtypes (safetensors 0.8) and their size in bits.
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
FLOAT_DTYPES = frozenset(d for d in DTYPE_BITS if d.startswith(("F", "BF", "C")))
INTEGER_DTYPES = frozenset({"I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64"})

# draft_model: the Llama-family causal LMs that both engines load, with their model_type.
DRAFT_MODEL_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
# vLLM 0.32, model_executor/models/registry.py, _SPECULATIVE_DECODING_MODELS.
VLLM_EAGLE_ARCHITECTURES = frozenset({
    "EagleLlamaForCausalLM", "EagleLlama4ForCausalLM", "EagleMistralForCausalLM",
    "EagleMiniCPMForCausalLM", "EagleCohereForCausalLM", "EagleMistralLarge3ForCausalLM",
    "EagleDeepSeekMTPModel",
})
VLLM_EAGLE3_ARCHITECTURES = frozenset({
    "Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3", "Eagle3Qwen3ForCausalLM",
    "Eagle3Qwen2_5vlForCausalLM", "Eagle3Qwen3vlForCausalLM", "Eagle3MiniMaxM2ForCausalLM",
    "Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM",
    "PEagleDraftModel", "PeagleLlamaForCausalLM", "PeagleQwen3ForCausalLM",
})
VLLM_MEDUSA_ARCHITECTURES = frozenset({"MedusaModel"})
VLLM_MTP_ARCHITECTURES = frozenset({
    "DeepSeekMTPModel", "DeepseekV32MTPModel", "DeepSeekV4MTPModel", "Dots3NoteMTPModel",
    "MiMoMTPModel", "MiMoV2MTPModel", "MiMoV2OmniMTPModel", "Glm4MoeMTPModel",
    "Glm4MoeLiteMTPModel", "GlmOcrMTPModel", "Glm5NextMTPModel", "ErnieMTPModel",
    "NemotronHMTPModel", "ExaoneMoeMTP", "Exaone4_5_MTP", "Qwen3NextMTP", "Qwen4ExpMTP",
    "Qwen3_5MTP", "Qwen3_5MoeMTP", "LongCatFlashMTPModel", "BailingMoeV25MTPModel",
    "BailingMoeV3MTPModel", "MiniMaxM3MTP", "InklingMTPModel", "KimiK3MTPModel",
    "OpenPanguMTPModel", "Step3p5MTP", "HYV3MTPModel", "HYV4MTPModel", "Gemma4MTPModel",
    "InternS2MobiusMTP",
})


def vllm_architecture(method: str, arch: str) -> str:
    """The architecture vLLM's EAGLEConfig turns ``arch`` into for ``method``."""
    if method == "eagle":
        return arch if arch.startswith("Eagle") else f"Eagle{arch}"
    if method == "eagle3":
        return arch if arch.startswith("Eagle3") or arch.endswith("Eagle3") else f"Eagle3{arch}"
    return arch


def architecture_allowed(method: str, arch: str) -> bool:
    if method == "draft_model":
        return arch in DRAFT_MODEL_ARCHITECTURES
    if method == "eagle":
        return vllm_architecture(method, arch) in VLLM_EAGLE_ARCHITECTURES
    if method == "eagle3":
        return arch in VLLM_EAGLE3_ARCHITECTURES or vllm_architecture(method, arch) in VLLM_EAGLE3_ARCHITECTURES
    if method == "medusa":
        return arch in VLLM_MEDUSA_ARCHITECTURES
    if method == "mtp":
        return arch in VLLM_MTP_ARCHITECTURES
    return False


def _allowed_architectures_text(method: str) -> str:
    if method == "draft_model":
        names = sorted(DRAFT_MODEL_ARCHITECTURES)
    elif method == "eagle":
        names = sorted(VLLM_EAGLE_ARCHITECTURES) + ["or XForCausalLM for which vLLM has EagleXForCausalLM"]
    elif method == "eagle3":
        names = sorted(VLLM_EAGLE3_ARCHITECTURES) + ["or XForCausalLM for which vLLM has Eagle3XForCausalLM"]
    elif method == "medusa":
        names = sorted(VLLM_MEDUSA_ARCHITECTURES)
    else:
        names = sorted(VLLM_MTP_ARCHITECTURES)
    return ", ".join(names)


# --------------------------------------------------------------------------------------
# Public data types


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


def content_sha256(pairs: Iterable[tuple[str, str]]) -> str:
    """sha256 over sorted (relative name, file sha256) pairs."""
    h = hashlib.sha256()
    for name, digest in sorted(pairs):
        h.update(name.encode("utf-8") + b"\0" + digest.encode("ascii") + b"\n")
    return h.hexdigest()


# --------------------------------------------------------------------------------------
# Names


def normalise_name(name: str) -> tuple[str | None, str | None]:
    """(normalised relative name, None) or (None, why it is refused)."""
    if not isinstance(name, str) or not name:
        return None, "empty name: give every file a name"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return None, "the name contains control characters: rename the file"
    if "\\" in name:
        return None, "the name contains a backslash: use '/' between folders and rename the file"
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        return None, ("absolute path: archive members must be relative to the checkpoint "
                      "folder (re-create the archive from inside the folder)")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        return None, "the path contains '..': archive members must stay inside the checkpoint folder"
    if not parts:
        return None, "empty name: give every file a name"
    if len(parts) > MAX_NAME_DEPTH or len(name) > MAX_NAME_CHARS:
        return None, (f"path too long (at most {MAX_NAME_DEPTH} folders and {MAX_NAME_CHARS} "
                      "characters): flatten the checkpoint folder")
    return "/".join(parts), None


def is_junk(name: str) -> bool:
    parts = name.split("/")
    base = parts[-1]
    return (any(p in JUNK_DIRS for p in parts) or base in JUNK_FILES or base.startswith("._"))


def archive_kind(name: str) -> str | None:
    lower = name.lower()
    if lower.endswith(".zip"):
        return "zip"
    if lower.endswith((".tar.gz", ".tgz")):
        return "tar.gz"
    return None


def extension_problem(name: str) -> str | None:
    """Why a file of this name is refused by its extension, or None if it is accepted."""
    lower = name.lower()
    base = lower.rsplit("/", 1)[-1]
    if lower.endswith(ALLOWED_EXTENSIONS):
        return None
    ext = "." + base.rsplit(".", 1)[-1] if "." in base else "(none)"
    if lower.endswith(PICKLE_EXTENSIONS):
        return (f"{ext} files are pickles, which can run arbitrary code when loaded; they "
                f"are refused and never opened. {CONVERT_HINT}")
    if lower.endswith(CODE_EXTENSIONS):
        return (f"{ext} is code: remote code (trust_remote_code) is not accepted; a drafter "
                "must use an architecture that vLLM has built in. Remove the file")
    if lower.endswith(".gguf"):
        return f"GGUF files are not accepted: {CONVERT_HINT}"
    if lower.endswith(NESTED_ARCHIVE_EXTENSIONS):
        return ("nested archives are not accepted: upload the files themselves, or one "
                ".zip/.tar.gz/.tgz holding them")
    return (f"files with extension {ext} are not accepted: a checkpoint is .json and "
            ".safetensors files only (the target's tokenizer is used); remove this file")


# --------------------------------------------------------------------------------------
# Streaming helpers


class _TooBig(Exception):
    pass


class _CappedReader:
    """A read-only stream that raises _TooBig once more than ``cap`` bytes were read."""

    def __init__(self, raw, cap: int):
        self.raw = raw
        self.cap = cap
        self.count = 0

    def read(self, n=-1):
        if n is None or n < 0:
            n = self.cap - self.count + 1
        data = self.raw.read(min(n, self.cap - self.count + 1))
        self.count += len(data)
        if self.count > self.cap:
            raise _TooBig()
        return data

    def readable(self):
        return True


def _read_source(source):
    """An open binary stream for a path or a file object, and whether we opened it."""
    if isinstance(source, (str, os.PathLike)):
        return open(source, "rb"), True
    if hasattr(source, "seek"):
        try:
            source.seek(0)
        except (OSError, ValueError):
            pass
    return source, False


# --------------------------------------------------------------------------------------
# The validation run


@dataclass
class _Entry:
    raw_name: str          # normalised name before stripping a common top folder
    path: Path
    size: int
    sha256: str
    source: str
    member: str | None
    name: str = ""


class _Run:
    def __init__(self, method: str, target: TargetFacts, max_total_bytes: int, max_files: int,
                 tmp_root):
        self.method = method
        self.target = target
        self.limit = int(max_total_bytes)
        self.max_files = max_files
        self.problems: list[Problem] = []
        self._per_file: dict[tuple, int] = {}
        self.entries: list[_Entry] = []
        self.names: set[str] = set()
        self.ignored: list[str] = []
        self.total = 0
        self.aborted = False
        self.tmp = Path(tempfile.mkdtemp(prefix="specboard-validate-", dir=tmp_root))
        self.files_dir = self.tmp / "files"
        self.files_dir.mkdir()

    # problems ---------------------------------------------------------------------------
    def add(self, file: str, fld: str, message: str, member: str | None = None):
        key = (file, member)
        n = self._per_file.get(key, 0) + 1
        self._per_file[key] = n
        if n <= MAX_PROBLEMS_PER_FILE:
            self.problems.append(Problem(file, fld, message, member))
        elif n == MAX_PROBLEMS_PER_FILE + 1:
            self.problems.append(Problem(file, "problems", "more problems in this file were "
                                         "not listed: fix the ones above and upload again", member))

    def too_big(self, file: str, member: str | None, what: str):
        self.add(file, "size", f"{what} exceeds the upload limit of {self.limit} bytes "
                 f"({_human(self.limit)}): upload a smaller checkpoint (bf16 weights, only "
                 "the drafter's own tensors)", member)
        self.aborted = True

    # writing ----------------------------------------------------------------------------
    def accept_name(self, file: str, member: str | None, name: str) -> bool:
        """Name/extension/duplicate/count checks before any byte of the file is read."""
        problem = extension_problem(name)
        if problem:
            self.add(file, "extension", problem, member)
            return False
        if name in self.names:
            self.add(file, "path", f"'{name}' appears twice: keep one copy", member)
            return False
        if len(self.names) >= self.max_files:
            self.add(file, "files", f"more than {self.max_files} files: a checkpoint needs a "
                     "config.json and a few .safetensors shards", member)
            self.aborted = True
            return False
        self.names.add(name)
        return True

    def write(self, stream, name: str, file: str, member: str | None,
              declared: int | None = None) -> None:
        dest = self.files_dir / name
        if self.files_dir.resolve() not in dest.resolve().parents:  # belt and braces
            self.add(file, "path", "the path leaves the checkpoint folder", member)
            return
        h = hashlib.sha256()
        n = 0
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(dest, "xb") as out:
                while True:
                    chunk = stream.read(CHUNK)
                    if not chunk:
                        break
                    n += len(chunk)
                    if self.total + n > self.limit:
                        break
                    if declared is not None and n > declared:
                        break
                    h.update(chunk)
                    out.write(chunk)
        except (FileExistsError, NotADirectoryError, IsADirectoryError):
            self.add(file, "path", f"'{name}' clashes with another file or folder of the "
                     "same name: rename one of them", member)
            return
        if self.total + n > self.limit:
            dest.unlink(missing_ok=True)
            self.too_big(file, member, "the data actually read")
            return
        if declared is not None and n != declared:
            dest.unlink(missing_ok=True)
            self.add(file, "size", f"declared size {declared} bytes but {n} bytes were read: "
                     "the upload is truncated or its header lies; upload it again", member)
            if n > declared:
                self.aborted = True
            return
        self.total += n
        self.entries.append(_Entry(name, dest, n, h.hexdigest(), file, member))

    # inputs -----------------------------------------------------------------------------
    def take_loose(self, up: Upload):
        name, problem = normalise_name(up.name)
        if problem:
            self.add(str(up.name), "path", problem)
            return
        if is_junk(name):
            self.ignored.append(name)
            return
        if not self.accept_name(up.name, None, name):
            return
        if up.size is not None and self.total + up.size > self.limit:
            self.too_big(up.name, None, f"the uploads' total size ({_human(self.total + up.size)}+)")
            return
        try:
            stream, opened = _read_source(up.source)
        except OSError as e:
            self.add(up.name, "file", f"cannot be read ({e.strerror or e}): upload it again")
            return
        try:
            self.write(stream, name, up.name, None, declared=up.size)
        finally:
            if opened:
                stream.close()

    def spool_archive(self, up: Upload) -> Path | None:
        """A path for the archive: the given path, or a copy of the file object in tmp."""
        if up.size is not None and up.size > self.limit:
            self.too_big(up.name, None, f"the archive ({_human(up.size)})")
            return None
        if isinstance(up.source, (str, os.PathLike)):
            path = Path(up.source)
            try:
                size = path.stat().st_size
            except OSError as e:
                self.add(up.name, "file", f"cannot be read ({e.strerror or e}): upload it again")
                return None
            if size > self.limit:
                self.too_big(up.name, None, f"the archive ({_human(size)})")
                return None
            return path
        dest = self.tmp / "archive"
        stream, _ = _read_source(up.source)
        n = 0
        with open(dest, "wb") as out:
            while True:
                chunk = stream.read(CHUNK)
                if not chunk:
                    break
                n += len(chunk)
                if n > self.limit:
                    self.too_big(up.name, None, "the archive")
                    return None
                out.write(chunk)
        return dest

    def member_name(self, file: str, raw: str, is_dir: bool = False) -> str | None:
        if is_dir and raw.strip("/") in ("", "."):
            return None  # the archive's own root folder, "./"
        name, problem = normalise_name(raw)
        if problem:
            self.add(file, "path", problem, raw)
            return None
        return name

    def take_zip(self, up: Upload):
        path = self.spool_archive(up)
        if path is None:
            return
        try:
            zf = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError) as e:
            self.add(up.name, "archive", f"not a readable zip file ({e}): re-create the archive")
            return
        with zf:
            infos = zf.infolist()
            if len(infos) > 4 * self.max_files:
                self.add(up.name, "files", f"{len(infos)} archive members: at most "
                         f"{self.max_files} files are accepted")
                self.aborted = True
                return
            todo = []
            for info in infos:
                mode = info.external_attr >> 16
                kind = _zip_member_kind(info, mode)
                name = self.member_name(up.name, info.filename, kind == "dir")
                if kind != "file" and kind != "dir":
                    self.add(up.name, "type", f"the member is a {kind}: only regular files "
                             "are accepted; put the file itself in the archive", info.filename)
                    continue
                if name is None or kind == "dir":
                    continue
                if is_junk(name):
                    self.ignored.append(name)
                    continue
                if info.flag_bits & 0x1:
                    self.add(up.name, "encryption", "the member is encrypted: upload an "
                             "archive without a password", info.filename)
                    continue
                if self.accept_name(up.name, info.filename, name):
                    todo.append((info, name))
            if self.aborted:
                return
            declared = sum(info.file_size for info, _ in todo)
            if declared > self.limit:
                self.too_big(up.name, None, f"the archive's declared content ({_human(declared)})")
                return
            for info, name in todo:
                try:
                    with zf.open(info) as stream:
                        self.write(stream, name, up.name, info.filename, declared=info.file_size)
                except (zipfile.BadZipFile, zlib.error, EOFError, OSError, NotImplementedError,
                        RuntimeError) as e:
                    (self.files_dir / name).unlink(missing_ok=True)
                    self.entries = [x for x in self.entries if x.raw_name != name]
                    self.add(up.name, "archive", f"the member is corrupt ({e}); its data do not "
                             "match its header: re-create the archive", info.filename)
                if self.aborted:
                    return

    def take_tar(self, up: Upload):
        path = self.spool_archive(up)
        if path is None:
            return
        # the decompressed stream as a whole (headers, long names, padding) is capped too
        cap = self.limit + 2048 * 4 * self.max_files + (1 << 20)
        declared = 0
        members = 0
        try:
            with open(path, "rb") as raw, gzip.GzipFile(fileobj=raw, mode="rb") as gz:
                capped = _CappedReader(gz, cap)
                with tarfile.open(fileobj=capped, mode="r|") as tf:
                    for m in tf:
                        members += 1
                        if members > 4 * self.max_files:
                            self.add(up.name, "files", f"more than {4 * self.max_files} archive "
                                     f"members: at most {self.max_files} files are accepted")
                            self.aborted = True
                            return
                        kind = _tar_member_kind(m)
                        name = self.member_name(up.name, m.name, kind == "dir")
                        if kind not in ("file", "dir"):
                            extra = f" to '{m.linkname}'" if m.issym() or m.islnk() else ""
                            self.add(up.name, "type", f"the member is a {kind}{extra}: only "
                                     "regular files are accepted; put the file itself in the "
                                     "archive", m.name)
                            continue
                        if name is None or kind == "dir":
                            continue
                        if is_junk(name):
                            self.ignored.append(name)
                            continue
                        if not self.accept_name(up.name, m.name, name):
                            if self.aborted:
                                return
                            continue
                        declared += m.size
                        if declared > self.limit:
                            self.too_big(up.name, m.name, "the archive's declared content "
                                         f"({_human(declared)} so far)")
                            return
                        stream = tf.extractfile(m)
                        self.write(stream, name, up.name, m.name, declared=m.size)
                        if self.aborted:
                            return
        except _TooBig:
            self.too_big(up.name, None, "the decompressed archive stream")
        except (tarfile.TarError, gzip.BadGzipFile, zlib.error, EOFError, OSError, ValueError) as e:
            self.add(up.name, "archive", f"not a readable .tar.gz ({type(e).__name__}: {e}): "
                     "re-create it with `tar czf drafter.tar.gz -C checkpoint_dir .`")

    # after extraction ---------------------------------------------------------------
    def strip_common_folder(self):
        if not self.entries:
            return
        firsts = {e.raw_name.split("/", 1)[0] for e in self.entries}
        strip = len(firsts) == 1 and all("/" in e.raw_name for e in self.entries)
        prefix = next(iter(firsts)) + "/" if strip else ""
        for e in self.entries:
            e.name = e.raw_name[len(prefix):]


def _zip_member_kind(info: zipfile.ZipInfo, mode: int) -> str:
    if info.is_dir():
        return "dir"
    if info.create_system == 3 and mode:   # unix attributes
        fmt = stat.S_IFMT(mode)
        if fmt == 0 or stat.S_ISREG(mode):
            return "file"
        if stat.S_ISDIR(mode):
            return "dir"
        if stat.S_ISLNK(mode):
            return "symbolic link"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
            return "device"
        if stat.S_ISFIFO(mode):
            return "FIFO"
        if stat.S_ISSOCK(mode):
            return "socket"
        return "special file"
    return "file"


def _tar_member_kind(m: tarfile.TarInfo) -> str:
    if m.issym():
        return "symbolic link"
    if m.islnk():
        return "hard link"
    if m.ischr() or m.isblk():
        return "device"
    if m.isfifo():
        return "FIFO"
    if m.issparse():
        return "sparse file"
    if m.isdir():
        return "dir"
    if m.isreg():
        return "file"
    return "special file"


def _human(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# --------------------------------------------------------------------------------------
# Safetensors headers


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_safetensors_header(path: Path, add) -> dict[str, tuple[str, list[int]]] | None:
    """Check one safetensors file's header without loading tensors. ``add(field, message)``
    receives each problem. Returns {tensor name: (dtype, shape)}, or None if unusable."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            add("header_length", f"the file is {size} bytes, shorter than the 8-byte header "
                "length: the file is truncated or not safetensors; upload it again")
            return None
        (n,) = struct.unpack("<Q", head)
        looks_pickled = head.startswith(b"PK\x03\x04") or (
            head[:1] == b"\x80" and 2 <= head[1] <= 5)
        if looks_pickled and (n > size - 8 or n > MAX_HEADER_BYTES):
            add("header", "this is a PyTorch pickle/zip checkpoint renamed to .safetensors, "
                f"not safetensors: {CONVERT_HINT}")
            return None
        if n > size - 8:
            add("header_length", f"the header claims {n} bytes but the file has only {size - 8} "
                "after the length: the file is truncated or not safetensors")
            return None
        if n > MAX_HEADER_BYTES:
            add("header_length", f"the header is {n} bytes, above the {MAX_HEADER_BYTES}-byte "
                "cap: this is not a normal safetensors file; save it again with safetensors")
            return None
        if n < 2:
            add("header_length", f"header length {n} is too small for a JSON object")
            return None
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        add("header", f"the header is not valid UTF-8 JSON ({e}): save the file again with "
            "safetensors")
        return None
    if not isinstance(header, dict):
        add("header", f"the header is a JSON {type(header).__name__}, not an object")
        return None
    data_len = size - 8 - n
    ok = True
    tensors: dict[str, tuple[str, list[int]]] = {}
    spans = []
    for key, info in header.items():
        if key == "__metadata__":
            if not isinstance(info, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in info.items()):
                add("__metadata__", "__metadata__ must map strings to strings")
                ok = False
            continue
        if not key:
            add("header", "a tensor has an empty name")
            ok = False
            continue
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            got = sorted(info) if isinstance(info, dict) else type(info).__name__
            add(key, f"a tensor entry must have exactly dtype, shape and data_offsets (got {got})")
            ok = False
            continue
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        good = True
        if dtype not in DTYPE_BITS:
            add(f"{key}.dtype", f"unknown dtype {dtype!r}: use one of {', '.join(sorted(DTYPE_BITS))}")
            good = False
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            add(f"{key}.shape", f"shape must be a list of non-negative integers, got {shape!r}")
            good = False
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(_is_int(o) and o >= 0 for o in offsets) or offsets[0] > offsets[1]):
            add(f"{key}.data_offsets", "data_offsets must be [begin, end] with "
                f"0 <= begin <= end, got {offsets!r}")
            good = False
        if not good:
            ok = False
            continue
        begin, end = offsets
        if end > data_len:
            add(f"{key}.data_offsets", f"[{begin}, {end}] runs past the data section "
                f"({data_len} bytes): the file is truncated")
            ok = False
        bits = math.prod(shape) * DTYPE_BITS[dtype]
        if bits % 8 or end - begin != bits // 8:
            add(f"{key}.data_offsets", f"shape {shape} of {dtype} needs {bits / 8:g} bytes but "
                f"data_offsets [{begin}, {end}] hold {end - begin}: the header does not match "
                "the data; save the tensors again with safetensors")
            ok = False
        spans.append((begin, end, key))
        tensors[key] = (dtype, shape)
    spans.sort()
    pos = 0
    for begin, end, key in spans:
        if begin < pos:
            add(f"{key}.data_offsets", f"[{begin}, {end}] overlaps the previous tensor "
                f"(which ends at {pos}): tensors may not share bytes")
            ok = False
        elif begin > pos:
            add(f"{key}.data_offsets", f"gap of {begin - pos} bytes before this tensor "
                f"(from {pos} to {begin}): the data section must be covered exactly")
            ok = False
        pos = max(pos, end)
    if spans and pos != data_len:
        add("data_offsets", f"the tensors cover {pos} bytes but the data section has "
            f"{data_len}: the file has trailing or missing bytes")
        ok = False
    if not spans and data_len:
        add("data_offsets", f"no tensors but {data_len} bytes of data")
        ok = False
    return tensors if ok else None


# --------------------------------------------------------------------------------------
# config.json


def _remote_code_hints(obj, path="", depth=0):
    """(key path, key) of every remote-code hint in a JSON value."""
    if depth > 64:
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            here = f"{path}.{k}" if path else k
            if k == "auto_map":
                yield here, "auto_map"
            elif k == "trust_remote_code" and v:
                yield here, "trust_remote_code"
            else:
                yield from _remote_code_hints(v, here, depth + 1)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _remote_code_hints(v, f"{path}[{i}]", depth + 1)


def check_config(cfg: dict, method: str, target: TargetFacts,
                 tensors: dict[str, tuple[str, list[int]]], add) -> None:
    """Check a parsed config.json for ``method`` against the target's facts and the
    tensors found in the safetensors headers. ``add(field, message)`` gets each problem."""
    def pos_int(key, required=True, upper=None, value=None, label=None):
        label = label or key
        v = cfg.get(key) if value is None else value
        if v is None:
            if required:
                add(label, f"missing: config.json needs a positive integer {label}")
            return None
        if not _is_int(v) or v < 1:
            add(label, f"must be a positive integer, got {v!r}")
            return None
        if upper is not None and v > upper:
            add(label, f"{v} is more than {upper}: not a plausible drafter")
            return None
        return v

    # architecture
    archs = cfg.get("architectures")
    if archs is None and method == "medusa":
        pass
    elif not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        add("architectures", f"must be a non-empty list of names; for {method} use one of: "
            f"{_allowed_architectures_text(method)}")
    else:
        for a in archs:
            if not architecture_allowed(method, a):
                add("architectures", f"{a!r} is not a {method} architecture vLLM can load "
                    f"without remote code; use one of: {_allowed_architectures_text(method)}")
    if method == "draft_model" and isinstance(archs, list) and archs and archs[0] in DRAFT_MODEL_ARCHITECTURES:
        want = DRAFT_MODEL_ARCHITECTURES[archs[0]]
        if cfg.get("model_type") != want:
            add("model_type", f"is {cfg.get('model_type')!r}; {archs[0]} needs model_type {want!r}")

    # sizes
    upper_layers = MAX_LAYERS
    if method == "medusa":
        hidden = pos_int("hidden_size", upper=1 << 16)
        for key in cfg:
            if "num" in key and ("heads" in key or "layers" in key):
                pos_int(key, upper=64 if "heads" in key else upper_layers)
    else:
        hidden = pos_int("hidden_size", upper=1 << 16)
        pos_int("num_hidden_layers", upper=upper_layers)
        heads = pos_int("num_attention_heads", upper=1024)
        kv = pos_int("num_key_value_heads", required=False, upper=1024)
        pos_int("intermediate_size", required=False)
        pos_int("head_dim", required=False, upper=4096)
        if hidden and heads and hidden % heads:
            add("num_attention_heads", f"{heads} does not divide hidden_size {hidden}")
        if heads and kv and heads % kv:
            add("num_key_value_heads", f"{kv} does not divide num_attention_heads {heads}")

    # vocabulary
    vocab = cfg.get("vocab_size")
    if vocab is None and method == "medusa":
        pass  # vLLM aligns an absent medusa vocab_size with the target's
    elif not _is_int(vocab):
        add("vocab_size", f"must be an integer equal to the target's vocabulary size "
            f"({target.vocab_size}), got {vocab!r}")
    elif vocab != target.vocab_size:
        add("vocab_size", f"{vocab} differs from the target's vocabulary size "
            f"({target.vocab_size}): the drafter must use the target's tokenizer"
            + ("; an EAGLE-3 head with a smaller draft vocabulary sets vocab_size to the "
               "target's and draft_vocab_size to its own, with a d2t tensor"
               if method == "eagle3" else ""))
    if method == "eagle3":
        dv = cfg.get("draft_vocab_size")
        if dv is not None:
            if not _is_int(dv) or dv < 1 or dv > target.vocab_size:
                add("draft_vocab_size", f"must be an integer in 1..{target.vocab_size} "
                    f"(the target's vocabulary), got {dv!r}")
            elif dv != target.vocab_size:
                d2t = [k for k in tensors if k == "d2t" or k.endswith(".d2t")]
                if not d2t:
                    add("d2t", f"draft_vocab_size {dv} differs from the target's vocabulary "
                        f"({target.vocab_size}) but no d2t tensor maps draft ids to target ids: "
                        "include the d2t tensor of shape [draft_vocab_size]")
                for k in d2t:
                    dtype, shape = tensors[k]
                    if shape != [dv] or dtype not in INTEGER_DTYPES:
                        add(k, f"d2t must be an integer tensor of shape [{dv}] "
                            f"(draft_vocab_size), got {dtype} {shape}")
        aux = cfg.get("eagle_aux_hidden_state_layer_ids")
        if aux is None and isinstance(cfg.get("eagle_config"), dict):
            aux = cfg["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
        if aux is not None and (not isinstance(aux, list) or not all(
                _is_int(i) and 0 <= i < target.num_layers for i in aux)):
            add("eagle_aux_hidden_state_layer_ids", f"must list target layers in "
                f"0..{target.num_layers - 1}, got {aux!r}")

    # hidden size of heads that read the target's hidden states
    if method in ("eagle", "eagle3", "medusa", "mtp") and hidden:
        key = "hidden_size"
        value = hidden
        if method == "eagle3" and cfg.get("target_hidden_size") is not None:
            key, value = "target_hidden_size", cfg.get("target_hidden_size")
        if value != target.hidden_size:
            add(key, f"{value} differs from the target's hidden size ({target.hidden_size}): "
                f"the {method} head reads the target's hidden states, so they must match")

    # draft_model: the tensors agree with the config
    if method == "draft_model" and hidden and _is_int(vocab):
        emb = tensors.get("model.embed_tokens.weight")
        if emb is None:
            add("model.embed_tokens.weight", "missing from the safetensors files: a draft "
                "model needs its embeddings")
        elif emb[1] != [vocab, hidden]:
            add("model.embed_tokens.weight", f"shape {emb[1]} does not match config.json "
                f"[vocab_size, hidden_size] = [{vocab}, {hidden}]")
        head = tensors.get("lm_head.weight")
        if head is None and not cfg.get("tie_word_embeddings", False):
            add("lm_head.weight", "missing, and tie_word_embeddings is not true: include "
                "lm_head.weight or set tie_word_embeddings")
        elif head is not None and head[1] != [vocab, hidden]:
            add("lm_head.weight", f"shape {head[1]} does not match [vocab_size, hidden_size] "
                f"= [{vocab}, {hidden}]")
        layers = cfg.get("num_hidden_layers")
        if _is_int(layers) and 1 <= layers <= MAX_LAYERS:
            found = {int(m.group(1)) for k in tensors
                     if (m := re.match(r"model\.layers\.(\d+)\.", k))}
            if found != set(range(layers)):
                missing = sorted(set(range(layers)) - found)
                extra = sorted(found - set(range(layers)))
                add("num_hidden_layers", f"config.json says {layers} layers but the tensors "
                    f"have layers {_ranges(sorted(found))}"
                    + (f" (missing {_ranges(missing)})" if missing else "")
                    + (f" (extra {_ranges(extra)})" if extra else ""))


def _ranges(xs: list[int]) -> str:
    if not xs:
        return "none"
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(out)


# --------------------------------------------------------------------------------------
# The function


def validate_checkpoint(uploads: Iterable, method: str, target, *, max_total_bytes: int,
                        max_files: int = DEFAULT_MAX_FILES,
                        tmp_root: str | os.PathLike | None = None) -> ValidatedCheckpoint:
    """Validate an upload; see the module docstring for the rules.

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
    if method not in METHODS:
        raise CheckpointRejected([Problem("(method)", "method", f"unknown method {method!r}: "
                                          f"use one of {', '.join(METHODS)}")])
    if method == "ngram":
        if uploads:
            raise CheckpointRejected([Problem(u.name, "method", "the ngram method takes no "
                                              "files (it has parameters only): remove the file")
                                      for u in uploads])
        return ValidatedCheckpoint(method, [], content_sha256([]), None, 0, 0)
    if not uploads:
        raise CheckpointRejected([Problem("(upload)", "files", f"a {method} drafter needs "
                                          "files: config.json and .safetensors weights")])

    run = _Run(method, target, max_total_bytes, max_files, tmp_root)
    try:
        _collect(run, uploads)
        config, params, count = (None, 0, 0)
        if not run.aborted:
            config, params, count = _check_contents(run)
        if run.problems:
            raise CheckpointRejected(run.problems)
        files = [CheckpointFile(e.name, e.size, e.sha256, e.path, e.source, e.member)
                 for e in sorted(run.entries, key=lambda e: e.name)]
        archive_copy = run.tmp / "archive"
        if archive_copy.exists():
            archive_copy.unlink()
        return ValidatedCheckpoint(
            method=method, files=files,
            content_sha256=content_sha256((f.name, f.sha256) for f in files),
            config=config, parameter_count=params, tensor_count=count,
            ignored=sorted(run.ignored), temp_dir=run.tmp)
    except BaseException:
        shutil.rmtree(run.tmp, ignore_errors=True)
        raise


def _collect(run: _Run, uploads: list[Upload]) -> None:
    archives = [u for u in uploads if archive_kind(u.name)]
    if archives and len(uploads) > 1:
        for u in uploads:
            run.add(u.name, "files", "upload either one archive (.zip, .tar.gz, .tgz) or loose "
                    "files, not several archives or an archive with other files")
        run.aborted = True
        return
    if archives:
        up = archives[0]
        if archive_kind(up.name) == "zip":
            run.take_zip(up)
        else:
            run.take_tar(up)
    else:
        for up in uploads:
            run.take_loose(up)
            if run.aborted:
                return
    run.strip_common_folder()


def _check_contents(run: _Run):
    entries = {e.name: e for e in run.entries}
    tensors: dict[str, tuple[str, list[int]]] = {}
    tensor_file: dict[str, str] = {}
    per_file_tensors: dict[str, set[str]] = {}
    jsons: dict[str, Any] = {}
    params = 0

    def adder(e):
        return lambda fld, msg: run.add(e.source, fld, msg, e.member)

    for name in sorted(entries):
        e = entries[name]
        add = adder(e)
        if name.lower().endswith(".json"):
            if e.size > MAX_JSON_BYTES:
                add("size", f"a {_human(e.size)} JSON file is larger than the "
                    f"{_human(MAX_JSON_BYTES)} accepted")
                continue
            try:
                value = json.loads(e.path.read_bytes().decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError) as ex:
                add("json", f"not valid UTF-8 JSON ({ex}): fix the file")
                continue
            jsons[name] = value
            for where, hint in _remote_code_hints(value):
                add(where, f"{hint} asks for remote code, which is not accepted: remove it "
                    "and use an architecture that vLLM has built in")
        elif name.lower().endswith(".safetensors"):
            found = check_safetensors_header(e.path, add)
            if found is None:
                continue
            per_file_tensors[name] = set(found)
            for key, (dtype, shape) in found.items():
                if key in tensors:
                    add(key, f"tensor also present in {tensor_file[key]}: each tensor must be "
                        "stored once")
                    continue
                tensors[key] = (dtype, shape)
                tensor_file[key] = name
                if dtype in FLOAT_DTYPES:
                    params += math.prod(shape)

    if not any(n.lower().endswith(".safetensors") for n in entries):
        run.add("(upload)", "files", f"no .safetensors file: a {run.method} drafter needs its "
                "weights as .safetensors")

    # sharded checkpoints
    for name, value in jsons.items():
        if not name.endswith(".safetensors.index.json"):
            continue
        e = entries[name]
        wm = value.get("weight_map") if isinstance(value, dict) else None
        if not isinstance(wm, dict):
            run.add(e.source, "weight_map", "must map tensor names to file names", e.member)
            continue
        base = name.rsplit("/", 1)[0] + "/" if "/" in name else ""
        missing_files = set()
        for tname, fname in wm.items():
            full = base + fname if isinstance(fname, str) else None
            if full not in entries:
                missing_files.add(str(fname))
            elif full in per_file_tensors and tname not in per_file_tensors[full]:
                run.add(e.source, f"weight_map.{tname}", f"the index places it in {fname}, "
                        "which does not hold it", e.member)
        for fname in sorted(missing_files):
            run.add(e.source, "weight_map", f"refers to {fname}, which was not uploaded",
                    e.member)

    config = jsons.get("config.json")
    if "config.json" not in entries:
        elsewhere = [n for n in entries if n.endswith("/config.json")]
        run.add("config.json", "config.json", "missing: a config.json at the top level of the "
                "checkpoint is required" + (f" (found {', '.join(elsewhere)}: put the "
                                            "checkpoint files in one folder)" if elsewhere else ""))
    elif not isinstance(config, dict):
        if config is not None:
            e = entries["config.json"]
            run.add(e.source, "config.json", "must be a JSON object", e.member)
        config = None
    else:
        e = entries["config.json"]
        check_config(config, run.method, run.target, tensors, adder(e))
    return config, params, len(tensors)


# --------------------------------------------------------------------------------------
# ngram


NGRAM_KEYS = ("prompt_lookup_min", "prompt_lookup_max", "k")


def validate_ngram_params(params: Mapping, allowed_ks: Iterable[int]) -> dict:
    """Check n-gram prompt-lookup parameters: ints with 1 <= prompt_lookup_min <=
    prompt_lookup_max <= 16, and ``k`` (optional; the protocol's budgets apply when it is
    absent) in ``allowed_ks``. Returns the normalised parameters or raises
    CheckpointRejected."""
    problems = []
    allowed = sorted(set(allowed_ks))

    def bad(fld, msg):
        problems.append(Problem("params", fld, msg))

    if not isinstance(params, Mapping):
        raise CheckpointRejected([Problem("params", "params", "must be a JSON object with "
                                          "prompt_lookup_min and prompt_lookup_max")])
    for key in params:
        if key not in NGRAM_KEYS:
            bad(key, f"unknown parameter: ngram takes {', '.join(NGRAM_KEYS)}")
    out = {}
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        v = params.get(key)
        if v is None:
            bad(key, "missing: give an integer from 1 to 16")
        elif not _is_int(v) or not 1 <= v <= 16:
            bad(key, f"must be an integer from 1 to 16, got {v!r}")
        else:
            out[key] = v
    if len(out) == 2 and out["prompt_lookup_min"] > out["prompt_lookup_max"]:
        bad("prompt_lookup_min", f"{out['prompt_lookup_min']} is larger than "
            f"prompt_lookup_max {out['prompt_lookup_max']}")
    if "k" in params:
        k = params["k"]
        if not _is_int(k) or k not in allowed:
            bad("k", f"must be one of the protocol's speculation budgets {allowed}, got {k!r}")
        else:
            out["k"] = k
    if problems:
        raise CheckpointRejected(problems)
    return out


# --------------------------------------------------------------------------------------
# CLI: python -m worker validate --method METHOD --target DIR FILE...


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", required=True, choices=METHODS)
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
        if args.method == "ngram" and args.params is not None:
            try:
                params = json.loads(args.params)
            except ValueError as e:
                raise CheckpointRejected([Problem("params", "params", f"not JSON: {e}")])
            ks = [int(k) for k in str(args.ks).split(",") if k.strip()]
            print(f"params: {json.dumps(validate_ngram_params(params, ks))}")
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
    return 0
