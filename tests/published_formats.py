"""Checkpoints in the formats drafter authors publish, built by the tests from a folder in
SpecBoard's own layout (a config.json and model.safetensors): the exact config keys, file
names and tensor names of each published format, the same tensors.

- ``speculators_eagle3``: Red Hat's ``speculators`` layout (as RedHatAI/*-speculator.eagle3):
  ``speculators_config`` with the verifier, ``transformer_layer_config``, ``auto_map`` and
  the config class's ``.py`` file, ``layers.0.`` tensor names, a ``t2d`` map, a README.
- ``safeailab_bin``: the EAGLE authors' layout: the config as is, the tensors pickled by
  ``torch.save`` into ``pytorch_model.bin``.
- ``fasterdecoding_medusa``: FasterDecoding's layout: ``medusa_num_heads``,
  ``medusa_num_layers``, ``base_model_name_or_path`` and no ``hidden_size``; tensors
  ``{head}.{layer}.linear.weight`` in ``medusa_lm_head.pt`` (or ``.safetensors``).
- ``dflash_zlab``: a DFlash drafter as z-lab publishes it (``DFlashDraftModel``, Qwen3
  sizes, ``dflash_config {mask_token_id, target_layer_ids}``, ``layers.{i}.`` tensors with
  q/k norms, ``fc``, ``hidden_norm``, ``norm``; the target's embeddings and head shared),
  tiny random weights; ``speculators_dflash``: the same in the speculators layout
  (``aux_hidden_state_layer_ids``, one above each target layer id).
- ``peagle``: an EAGLE-3 head made a P-EAGLE one (``mask_token_id`` and a ``mask_hidden``
  tensor); ``speculators_peagle``: the speculators layout of it (``peagle``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

EAGLE3_HEAD_KEYS = ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
                    "norm_before_residual")


def _read(folder: Path):
    return json.loads((folder / "config.json").read_text()), load_file(folder / "model.safetensors")


def uploads(folder: Path):
    from worker.checkpoint import Upload

    return [Upload(p.name, p, p.stat().st_size) for p in sorted(folder.iterdir()) if p.is_file()]


def speculators_eagle3(src: Path, dest: Path, verifier: str, k: int = 3):
    config, tensors = _read(src)
    dest.mkdir(parents=True, exist_ok=True)
    layer = {key: v for key, v in config.items()
             if key not in EAGLE3_HEAD_KEYS and key not in ("architectures", "torch_dtype")}
    spec = {
        "architectures": ["Eagle3Speculator"],
        "auto_map": {"": "eagle3.Eagle3SpeculatorConfig"},
        "draft_vocab_size": config.get("draft_vocab_size", config["vocab_size"]),
        "eagle_aux_hidden_state_layer_ids": config.get("eagle_aux_hidden_state_layer_ids"),
        "has_no_defaults_at_init": False,
        # vLLM's speculators reader defaults it to True; the SafeAILab layout to False.
        "norm_before_residual": bool(config.get("norm_before_residual", False)),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                  "speculative_tokens": k, "verifier_accept_k": 1}],
            "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": verifier},
        },
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0.dev13",
        "target_hidden_size": config.get("target_hidden_size"),
        "torch_dtype": config.get("torch_dtype", "bfloat16"),
        "transformer_layer_config": layer,
        "transformers_version": "4.52.4",
    }
    (dest / "config.json").write_text(json.dumps(spec, indent=2))
    renamed = {key.replace("midlayer.", "layers.0."): v for key, v in tensors.items()}
    if "d2t" in tensors:   # speculators ships the inverse map too (vLLM skips it)
        t2d = torch.zeros(config["vocab_size"], dtype=torch.bool)
        ids = tensors["d2t"] + torch.arange(len(tensors["d2t"]))   # d2t holds offsets
        t2d[ids[(ids >= 0) & (ids < len(t2d))]] = True
        renamed["t2d"] = t2d
    save_file(renamed, dest / "model.safetensors", metadata={"format": "pt"})
    (dest / "eagle3.py").write_text("raise SystemExit('remote code ran')\n")
    (dest / "README.md").write_text("# speculator\n")
    (dest / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    return uploads(dest)


def safeailab_bin(src: Path, dest: Path):
    config, tensors = _read(src)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    torch.save(tensors, dest / "pytorch_model.bin")
    (dest / "README.md").write_text("# EAGLE\n")
    return uploads(dest)


def fasterdecoding_medusa(src: Path, dest: Path, suffix: str = ".pt", bias: bool = False):
    """The heads of a SpecBoard Medusa folder (``blocks.{h}.layers.{l}.weight``) under
    FasterDecoding's names; a shared ``lm_head`` and ``token_map`` stay as they are."""
    config, tensors = _read(src)
    dest.mkdir(parents=True, exist_ok=True)
    out = {}
    for key, value in tensors.items():
        parts = key.split(".")
        if parts[0] == "blocks":
            out[f"{parts[1]}.{parts[3]}.linear.{parts[4]}"] = value
            if bias and parts[4] == "weight":
                out[f"{parts[1]}.{parts[3]}.linear.bias"] = torch.zeros(value.shape[0],
                                                                        dtype=value.dtype)
        else:
            out[key] = value
    heads = next(v for key, v in config.items() if "num" in key and "heads" in key)
    published = {"base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
                 "medusa_num_heads": heads,
                 "medusa_num_layers": config.get("num_hidden_layers", 1),
                 "transformers_version": "4.34.1"}
    for key in ("original_lm_head", "truncated_vocab_size"):
        if key in config:
            published[key] = config[key]
    (dest / "config.json").write_text(json.dumps(published, indent=2))
    if suffix == ".pt":
        torch.save(out, dest / "medusa_lm_head.pt")
    else:
        save_file(out, dest / "medusa_lm_head.safetensors")
    return uploads(dest)


def dflash_zlab(dest: Path, *, hidden: int, vocab: int, target_layer_ids, layers: int = 2,
                heads: int = 2, kv_heads: int = 1, head_dim: int | None = None,
                intermediate: int = 64, mask_token_id: int = 0, seed: int = 0):
    """A tiny random DFlash drafter for a target of ``hidden`` and ``vocab``."""
    head_dim = head_dim or hidden // heads
    g = torch.Generator().manual_seed(seed)
    r = (lambda *shape: (torch.randn(*shape, generator=g) * 0.02).bfloat16())
    one = (lambda n: torch.ones(n, dtype=torch.bfloat16))
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
              "hidden_size": hidden, "intermediate_size": intermediate,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": head_dim, "num_hidden_layers": layers, "vocab_size": vocab,
              "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
              "rope_theta": 100000.0, "attention_bias": False, "tie_word_embeddings": False,
              "block_size": 4, "torch_dtype": "bfloat16",
              "dflash_config": {"mask_token_id": mask_token_id,
                                "target_layer_ids": list(target_layer_ids)}}
    tensors = {}
    for i in range(layers):
        p = f"layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": r(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": r(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": r(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": r(hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": one(head_dim),
            p + "self_attn.k_norm.weight": one(head_dim),
            p + "mlp.gate_proj.weight": r(intermediate, hidden),
            p + "mlp.up_proj.weight": r(intermediate, hidden),
            p + "mlp.down_proj.weight": r(hidden, intermediate),
            p + "input_layernorm.weight": one(hidden),
            p + "post_attention_layernorm.weight": one(hidden)})
    tensors.update({"fc.weight": r(hidden, hidden * len(target_layer_ids)),
                    "hidden_norm.weight": one(hidden), "norm.weight": one(hidden)})
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return uploads(dest)


def _speculators_config(algorithm: str, verifier: str, k: int, layer: dict, **fields) -> dict:
    return {"architectures": [f"{algorithm.capitalize()}Speculator"],
            "speculators_config": {
                "algorithm": algorithm, "default_proposal_method": "greedy",
                "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                      "speculative_tokens": k, "verifier_accept_k": 1}],
                "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": verifier}},
            "speculators_model_type": algorithm, "speculators_version": "0.3.0",
            "torch_dtype": "bfloat16", "transformer_layer_config": layer, **fields}


def speculators_dflash(src: Path, dest: Path, verifier: str, k: int = 3):
    """The z-lab drafter in ``src`` in the speculators layout."""
    config, tensors = _read(src)
    dflash = config["dflash_config"]
    layer = {key: v for key, v in config.items()
             if key not in ("architectures", "torch_dtype", "dflash_config", "block_size")}
    spec = _speculators_config("dflash", verifier, k, layer,
                               mask_token_id=dflash["mask_token_id"],
                               aux_hidden_state_layer_ids=[i + 1 for i in
                                                           dflash["target_layer_ids"]])
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(spec, indent=2))
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return uploads(dest)


def peagle(src: Path, dest: Path, mask_token_id: int = 0):
    """The EAGLE-3 head in ``src`` given what parallel drafting needs: a mask token and a
    zero ``mask_hidden`` of [1, target hidden size x layers read]."""
    config, tensors = _read(src)
    config["mask_token_id"] = mask_token_id
    width = (config.get("target_hidden_size") or config["hidden_size"]) * len(
        config.get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0])
    tensors["mask_hidden"] = torch.zeros(1, width, dtype=torch.bfloat16)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return uploads(dest)


def speculators_peagle(src: Path, dest: Path, verifier: str, k: int = 3):
    """The P-EAGLE head in ``src`` (made by ``peagle``) in the speculators layout."""
    speculators_eagle3(src, dest, verifier, k)
    config = json.loads((dest / "config.json").read_text())
    config.pop("auto_map")
    mask = config["transformer_layer_config"].pop("mask_token_id")
    config.update(speculators_model_type="peagle", architectures=["PeagleSpeculator"],
                  mask_token_id=mask)
    config["speculators_config"]["algorithm"] = "peagle"
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    (dest / "eagle3.py").unlink()
    return uploads(dest)
