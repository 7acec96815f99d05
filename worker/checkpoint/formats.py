"""The formats drafter authors publish, brought to a layout vLLM loads, before the content
checks (worker/checkpoint/contents.py) run on the result:

- **speculators** (Red Hat's ``speculators`` library: ``speculators_config``,
  ``transformer_layer_config``): kept as published, since vLLM loads it; its structure and
  algorithm are read by vLLM's own code (worker/checkpoint/speculators.py) and each
  method's rules apply to the flat draft config vLLM builds from it. ``auto_map`` and the
  Python files it ships (its config class) are dropped with a note, never run. The
  verifier it names is recorded, with a warning when it is not the target.
- **SafeAILab EAGLE / EAGLE-3** (``pytorch_model.bin``, sharded or not) and
  **FasterDecoding Medusa** (``medusa_lm_head.pt``): the pickled weights are converted to
  safetensors in a sandboxed child (worker/checkpoint/convert.py) and the original is
  discarded. A FasterDecoding config (``medusa_num_heads``, ``medusa_num_layers``) has no
  ``hidden_size`` or ``vocab_size``: they are taken from the target, as the heads read the
  target's last hidden state and vLLM aligns the vocabulary; its residual blocks' biases are kept by ``medusa_fc_bias`` (vLLM builds them
  without bias otherwise and would drop the tensors silently).
- Extras that published checkpoints carry (names.EXTRA_FILES) were already dropped, unread,
  during extraction; they are listed in the notes.

``prepare`` returns an ``Intake``: the format recognised, what was converted from what,
and the notes shown on the drafter's page. Problems go to the extraction's list."""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from worker.checkpoint.convert import convert_weights
from worker.checkpoint.speculators import is_speculators, read_as_vllm, verifier_of
from worker.checkpoint.archives import Extraction
from worker.checkpoint.names import is_convertible_weights
from worker.prompts import file_sha256

SPECULATORS = "speculators"
SAFEAILAB = "pytorch_model.bin (SafeAILab EAGLE)"
FASTERDECODING_MEDUSA = "FasterDecoding Medusa"
SAFETENSORS = "safetensors"


@dataclass
class Intake:
    format: str = SAFETENSORS
    converted_from: dict[str, str] = field(default_factory=dict)  # stored name -> uploaded
    notes: list[str] = field(default_factory=list)
    verifier: str | None = None
    # The config the method's rules read, when it is not config.json itself (speculators:
    # the flat draft config vLLM builds). Not stored.
    rules_config: dict | None = field(default=None, repr=False)

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "rules_config"}


def converted_name(name: str) -> str:
    """The safetensors name of a pickled weights file (vLLM reads every *.safetensors)."""
    folder, _, base = name.rpartition("/")
    base = re.sub(r"^pytorch_model", "model", base)
    base = re.sub(r"\.(bin|pt)$", ".safetensors", base)
    return f"{folder}/{base}" if folder else base


def _rewrite(entry, value) -> None:
    """Replace a JSON entry's bytes by ``value`` (an edit made on the submitter's behalf)."""
    data = (json.dumps(value, indent=2) + "\n").encode()
    entry.path.write_bytes(data)
    entry.size, entry.sha256 = len(data), hashlib.sha256(data).hexdigest()


def _read_json(entry):
    try:
        return json.loads(entry.path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None   # contents.py reports it


def prepare(run: Extraction, method, target) -> Intake:
    """Bring a published format to vLLM's layout in place (see the module's docstring)."""
    intake = Intake()
    entries = {e.name: e for e in run.entries}
    for name in sorted(entries):
        if is_convertible_weights(name):
            _convert(run, entries, name, intake)
    config_entry = entries.get("config.json")
    config = _read_json(config_entry) if config_entry else None
    if is_speculators(config):
        intake.format = SPECULATORS
        _speculators(run, config_entry, config, method, target, intake)
    elif isinstance(config, dict) and any(k.startswith("medusa_num_") for k in config):
        intake.format = FASTERDECODING_MEDUSA
        _fasterdecoding_medusa(run, config_entry, config, target, intake)
    elif intake.converted_from:
        intake.format = SAFEAILAB
    for file, member, name in run.held_code:
        run.add(file, "extension", ".py is code: remote code (trust_remote_code) is not "
                "accepted; a drafter must use an architecture that vLLM has built in. Remove "
                "the file", member)
    if run.dropped:
        intake.notes.append(f"dropped, unread (vLLM does not use them): "
                            f"{', '.join(sorted(run.dropped))}")
    return intake


def _convert(run: Extraction, entries: dict, name: str, intake: Intake) -> None:
    e = entries[name]
    dest = converted_name(name)
    if dest in entries:
        run.add(e.source, "files", f"both {name} and {dest} were uploaded: upload one of them",
                e.member)
        return
    out = e.path.with_name(Path(dest).name + ".converting")
    try:
        convert_weights(e.path, out)
    except ValueError as ex:
        out.unlink(missing_ok=True)
        run.add(e.source, "weights", f"{name} {ex}", e.member)
        return
    final = e.path.with_name(Path(dest).name)
    out.rename(final)
    e.path.unlink()
    del entries[name]
    run.names.discard(name)
    e.path, e.name, e.raw_name = final, dest, dest
    e.size, e.sha256 = final.stat().st_size, file_sha256(final)
    entries[dest] = e
    run.names.add(dest)
    intake.converted_from[dest] = name
    intake.notes.append(f"converted from {name} (a pickle, read with torch.load("
                        "weights_only=True) in a sandbox) to {dest}; the pickle was discarded")
    # A sharded pickle's index names the converted shards.
    index = entries.get("pytorch_model.bin.index.json")
    if index is not None:
        value = _read_json(index)
        if isinstance(value, dict) and isinstance(value.get("weight_map"), dict):
            value["weight_map"] = {k: converted_name(v) if isinstance(v, str) else v
                                   for k, v in value["weight_map"].items()}
            _rewrite(index, value)
            new = index.path.with_name("model.safetensors.index.json")
            index.path.rename(new)
            del entries["pytorch_model.bin.index.json"]
            index.path, index.name, index.raw_name = new, "model.safetensors.index.json", new.name
            entries[index.name] = index


def _speculators(run: Extraction, entry, config: dict, method, target, intake: Intake) -> None:
    add = (lambda fld, msg: run.add(entry.source, fld, msg, entry.member))
    intake.verifier = verifier_of(config)
    if "auto_map" in config:
        config = {k: v for k, v in config.items() if k != "auto_map"}
        _rewrite(entry, config)
        intake.notes.append("auto_map removed from config.json: vLLM reads the speculators "
                            "format without the config class it names, which was never run")
    if run.held_code:
        intake.notes.append("dropped, never run: " + ", ".join(n for _, _, n in run.held_code))
        run.held_code = []
    if intake.verifier and not _names_target(intake.verifier, target):
        intake.notes.append(f"warning: the config names {intake.verifier} as its verifier; "
                            "SpecBoard measures it with this protocol's target")
    try:
        read = read_as_vllm(entry.path)
    except ValueError as e:
        add("speculators_config", str(e))
        return
    from worker.methods import DRAFTER_METHODS

    flat = read["flat"]
    # vLLM's method, in SpecBoard's registry: parallel EAGLE-3 drafting is P-EAGLE.
    kind = "peagle" if read["method"] == "eagle3" and read["parallel_drafting"] else read["method"]
    if kind == "peagle":
        # The speculators reader names P-EAGLE's own architectures (PeagleLlamaForCausalLM),
        # which vLLM loads only from this format: the rules read them as the EAGLE-3 ones.
        flat = dict(flat, architectures=[
            a.replace("Peagle", "Eagle3", 1) if a.startswith("Peagle") else a
            for a in flat.get("architectures") or []])
    if kind not in DRAFTER_METHODS:
        add("speculators_model_type", f"the checkpoint is a speculators {read['method']} "
            "drafter, a method vLLM has and SpecBoard does not measure yet")
    elif kind != method.name:
        add("speculators_model_type", f"the checkpoint is a speculators {kind} drafter, "
            f"submitted as {method.name}: choose the method {kind}")
    intake.rules_config = flat


def _names_target(verifier: str, target) -> bool:
    name = getattr(target, "name", None)
    return not name or verifier.rstrip("/").rsplit("/", 1)[-1].lower() == name.lower()


def _fasterdecoding_medusa(run: Extraction, entry, config: dict, target, intake: Intake) -> None:
    changed = dict(config)
    if config.get("hidden_size") is None:
        changed["hidden_size"] = target.hidden_size
        intake.notes.append(f"hidden_size {target.hidden_size} taken from the target "
                            "(a FasterDecoding Medusa config has none)")
    if config.get("vocab_size") is None:
        # vLLM gives such a config the target's vocabulary and, with it, resets
        # truncated_vocab_size to the full vocabulary: stated here, a reduced one survives.
        changed["vocab_size"] = target.vocab_size
        intake.notes.append(f"vocab_size {target.vocab_size} taken from the target")
    if "medusa_fc_bias" not in config and _has_block_bias(run):
        changed["medusa_fc_bias"] = True
        intake.notes.append("medusa_fc_bias set: the residual blocks carry biases")
    if changed != config:
        _rewrite(entry, changed)


def _has_block_bias(run: Extraction) -> bool:
    from worker.safetensors_header import read_header

    pattern = re.compile(r"^(medusa_heads\.)?\d+\.\d+\.linear\.bias$|^blocks\.\d+\.layers\.\d+\.bias$")
    for e in run.entries:
        if e.name.endswith(".safetensors"):
            header = read_header(e.path)
            if header and any(pattern.match(k) for k in header):
                return True
    return False
