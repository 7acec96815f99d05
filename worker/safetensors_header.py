"""The one safetensors header validator: reads a file's header (never a tensor) and checks
that it describes the file exactly. The upload validation (worker/checkpoint) collects its
problems; the pre-flight check before an engine loads a drafter (worker/methods) stops at
the first. Both give the same rules and messages.

Rules: 8-byte little-endian header length N with 2 <= N <= min(file size - 8, 100 MB); the
header is UTF-8 JSON, an object, without duplicate keys; ``__metadata__`` is a str->str
map; every other entry has exactly ``dtype`` (a known safetensors dtype), ``shape`` (a list
of non-negative ints) and ``data_offsets`` ([begin, end] ints, begin <= end);
end - begin == product(shape) * dtype size; sorted by begin, the tensors tile the data
section exactly: no overlap, no gap, the last end is the data section's length; the file
holds at least one tensor.

It lives beside both packages, not in worker/checkpoint, because the method registry uses
it and worker/checkpoint uses the registry.
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path

MAX_HEADER_BYTES = 100 * 1000 * 1000

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


def is_int(v) -> bool:
    """A JSON integer: Python's bool is an int, JSON's true is not."""
    return isinstance(v, int) and not isinstance(v, bool)


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def check_safetensors_header(path: Path, add) -> dict[str, tuple[str, list[int]]] | None:
    """Check one safetensors file's header without loading tensors. ``add(field, message)``
    receives each problem (an ``add`` that raises stops at the first). Returns
    {tensor name: (dtype, shape)}, or None if the file is unusable."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            add("header_length", f"the file is {size} bytes, too short for the 8-byte header "
                "length: the file is truncated or not safetensors")
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
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            add(f"{key}.shape", f"shape must be a list of non-negative integers, got {shape!r}")
            good = False
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(is_int(o) and o >= 0 for o in offsets) or offsets[0] > offsets[1]):
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
    if all(key == "__metadata__" for key in header):
        add("header", "the file holds no tensors"
            + (f" but {data_len} bytes of data" if data_len else "")
            + ": save the weights again with safetensors")
        ok = False
    return tensors if ok else None


def read_header(path: Path) -> dict | None:
    """The header of a safetensors file already checked by ``check_safetensors_header``
    (None if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            return json.loads(f.read(n))
    except (OSError, struct.error, ValueError):
        return None


def tensor_digests(path: Path) -> dict[str, tuple[str, list[int], str]]:
    """{tensor name: (dtype, shape, sha256 of its bytes)} of a checked safetensors file,
    read once in file order: what a checkpoint's content hash covers."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        base = 8 + n
        out = {}
        spans = sorted((info["data_offsets"], key) for key, info in header.items()
                       if key != "__metadata__")
        for (begin, end), key in spans:
            f.seek(base + begin)
            h = hashlib.sha256()
            left = end - begin
            while left:
                chunk = f.read(min(left, 1 << 20))
                if not chunk:
                    raise ValueError(f"{path}: {key} is truncated")
                h.update(chunk)
                left -= len(chunk)
            out[key] = (header[key]["dtype"], list(header[key]["shape"]), h.hexdigest())
    return out
