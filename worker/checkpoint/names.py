"""Name rules for uploaded files and archive members: which names are safe (relative, no
'..', no control characters, not too deep or long), which are operating-system junk to
ignore, which files of published checkpoints are dropped with a note or converted, which
are archives, and which extensions are accepted (and why the others are not)."""
from __future__ import annotations

import fnmatch
import re

from worker.safetensors_header import CONVERT_HINT

ALLOWED_EXTENSIONS = (".json", ".safetensors")
ARCHIVE_EXTENSIONS = (".zip", ".tar.gz", ".tgz")
PICKLE_EXTENSIONS = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib")
CODE_EXTENSIONS = (".py", ".pyc", ".pyo", ".so", ".dll", ".dylib", ".sh", ".ipynb")
NESTED_ARCHIVE_EXTENSIONS = (".zip", ".tar", ".gz", ".tgz", ".bz2", ".xz", ".7z", ".rar", ".zst")
JUNK_DIRS = ("__MACOSX",)
JUNK_FILES = (".DS_Store", "Thumbs.db", "desktop.ini")
# Files that published checkpoints carry beside the weights and that vLLM never reads
# (model cards, git attributes, training state, tokenizer copies: the target's tokenizer is
# used): dropped with a note, never opened. Matched on the base name.
EXTRA_FILES = ("*.md", ".gitattributes", ".gitignore", "LICENSE", "LICENSE.*", "NOTICE",
               "training_state.pt", "optimizer.pt", "optimizer.bin", "scheduler.pt",
               "scaler.pt", "rng_state*.pth", "training_args.bin", "trainer_state.json",
               "tokenizer.model", "vocab.txt", "merges.txt", "*.png", "*.jpg")
# Pickled weights of published formats (SafeAILab EAGLE's pytorch_model.bin, its shards, and
# FasterDecoding Medusa's medusa_lm_head.pt): kept to be converted to safetensors in a
# sandboxed child (worker/checkpoint/convert.py); every other pickle is refused unopened.
CONVERTIBLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model-*-of-*.bin", "medusa_lm_head.pt")
# Python files, kept aside and never run: a speculators checkpoint ships its config class
# as code (dropped with a note, worker/checkpoint/formats.py); anywhere else, refused.
HELD_CODE = ("*.py",)
MAX_NAME_CHARS = 255
MAX_NAME_DEPTH = 16


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


def _matches(name: str, patterns) -> bool:
    base = name.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatchcase(base, p) for p in patterns)


def is_extra(name: str) -> bool:
    return _matches(name, EXTRA_FILES)


def is_convertible_weights(name: str) -> bool:
    return _matches(name, CONVERTIBLE_WEIGHTS)


def is_held_code(name: str) -> bool:
    return _matches(name, HELD_CODE)


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
    if lower.endswith(ALLOWED_EXTENSIONS) or is_convertible_weights(name):
        return None
    ext = "." + base.rsplit(".", 1)[-1] if "." in base else "(none)"
    if lower.endswith(PICKLE_EXTENSIONS):
        return (f"{ext} files are pickles, which can run arbitrary code when loaded; they "
                "are refused and never opened (only published weight files named "
                f"{', '.join(CONVERTIBLE_WEIGHTS)} are converted). {CONVERT_HINT}")
    if lower.endswith(CODE_EXTENSIONS) or is_held_code(name):
        return (f"{ext} is code: remote code (trust_remote_code) is not accepted; a drafter "
                "must use an architecture that vLLM has built in. Remove the file")
    if lower.endswith(".gguf"):
        return f"GGUF files are not accepted: {CONVERT_HINT}"
    if lower.endswith(NESTED_ARCHIVE_EXTENSIONS):
        return ("nested archives are not accepted: upload the files themselves, or one "
                ".zip/.tar.gz/.tgz holding them")
    return (f"files with extension {ext} are not accepted: a checkpoint is .json and "
            ".safetensors files only (the target's tokenizer is used); remove this file")

