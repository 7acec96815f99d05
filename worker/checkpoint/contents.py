"""The contents of an extracted upload: every JSON file parses and asks for no remote code,
every safetensors header is sound (worker/safetensors_header.py) and no tensor is stored
twice, a sharded checkpoint's index agrees with its shards, and config.json (required at
the top level) passes the method's rules (its module in worker/methods)."""
from __future__ import annotations

import json
import math
from typing import Any

from worker.checkpoint.archives import Extraction, human_size
from worker.safetensors_header import FLOAT_DTYPES, check_safetensors_header

MAX_JSON_BYTES = 64 * 1024 * 1024


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


def check_contents(run: Extraction, method, target, rules_config: dict | None = None):
    """Check the extracted files for ``method`` (a worker.methods ``Method``) against the
    target's facts; the problems go to ``run``. ``rules_config``: what the method's rules
    read instead of config.json (a published format's flat view, worker/checkpoint/formats.py).
    Returns (config.json's object or None, parameter count: elements of floating-point
    tensors, tensor count)."""
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
                add("size", f"a {human_size(e.size)} JSON file is larger than the "
                    f"{human_size(MAX_JSON_BYTES)} accepted")
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
        run.add("(upload)", "files", f"no .safetensors file: a {method.name} drafter needs its "
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
        method.check_config(config if rules_config is None else rules_config, target,
                            tensors, adder(e))
    return config, params, len(tensors)


