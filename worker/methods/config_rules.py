"""Rules for an uploaded checkpoint's config.json that several methods share; each method's
``check_config`` (in its module) picks the ones that apply, in this order: architecture,
sizes, vocabulary, then the method's own rules, then the hidden size the head reads.
``add(field, message)`` receives each problem; ``target`` has vocab_size, hidden_size and
num_layers."""
from __future__ import annotations

from worker.safetensors_header import INTEGER_DTYPES, is_int

MAX_LAYERS = 200


def positive_int(cfg: dict, key: str, add, required: bool = True, upper: int | None = None):
    """cfg[key] if it is a positive integer of at most ``upper``, else None (and a problem,
    unless it is absent and not required)."""
    v = cfg.get(key)
    if v is None:
        if required:
            add(key, f"missing: config.json needs a positive integer {key}")
        return None
    if not is_int(v) or v < 1:
        add(key, f"must be a positive integer, got {v!r}")
        return None
    if upper is not None and v > upper:
        add(key, f"{v} is more than {upper}: not a plausible drafter")
        return None
    return v


def check_architectures(cfg: dict, method: str, allowed, allowed_text: str, add,
                        optional: bool = False) -> None:
    """``architectures`` is a non-empty list of names that ``allowed(name)`` accepts;
    ``optional``: it may be absent (vLLM then picks the method's default)."""
    archs = cfg.get("architectures")
    if archs is None and optional:
        return
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        add("architectures", f"must be a non-empty list of names; for {method} use one of: "
            f"{allowed_text}")
        return
    for a in archs:
        if not allowed(a):
            add("architectures", f"{a!r} is not a {method} architecture vLLM can load "
                f"without remote code; use one of: {allowed_text}")


def check_decoder_sizes(cfg: dict, add):
    """Sane sizes of a decoder stack: 1 <= num_hidden_layers <= MAX_LAYERS, attention heads
    dividing hidden_size, key/value heads dividing attention heads. Returns hidden_size
    (None if unusable)."""
    hidden = positive_int(cfg, "hidden_size", add, upper=1 << 16)
    positive_int(cfg, "num_hidden_layers", add, upper=MAX_LAYERS)
    heads = positive_int(cfg, "num_attention_heads", add, upper=1024)
    kv = positive_int(cfg, "num_key_value_heads", add, required=False, upper=1024)
    positive_int(cfg, "intermediate_size", add, required=False)
    positive_int(cfg, "head_dim", add, required=False, upper=4096)
    if hidden and heads and hidden % heads:
        add("num_attention_heads", f"{heads} does not divide hidden_size {hidden}")
    if heads and kv and heads % kv:
        add("num_key_value_heads", f"{kv} does not divide num_attention_heads {heads}")
    return hidden


def check_vocab(cfg: dict, target, add, optional: bool = False, hint: str = "") -> None:
    """``vocab_size`` equals the target's (the drafter uses the target's tokenizer);
    ``optional``: it may be absent; ``hint`` is added to the mismatch message."""
    vocab = cfg.get("vocab_size")
    if vocab is None and optional:
        return
    if not is_int(vocab):
        add("vocab_size", f"must be an integer equal to the target's vocabulary size "
            f"({target.vocab_size}), got {vocab!r}")
    elif vocab != target.vocab_size:
        add("vocab_size", f"{vocab} differs from the target's vocabulary size "
            f"({target.vocab_size}): the drafter must use the target's tokenizer{hint}")


def check_draft_vocab(cfg: dict, key: str, tensor: str, target, tensors: dict, add) -> None:
    """A drafter over a smaller vocabulary: ``cfg[key]`` (its size) is in 1..the target's,
    and below the target's it needs an integer ``tensor`` of shape [size] that maps its ids
    to the target's (EAGLE-3's ``d2t``, Medusa's ``token_map``)."""
    size = cfg.get(key)
    if size is None:
        return
    if not is_int(size) or size < 1 or size > target.vocab_size:
        add(key, f"must be an integer in 1..{target.vocab_size} (the target's vocabulary), "
            f"got {size!r}")
        return
    if size == target.vocab_size:
        return
    found = [k for k in tensors if k == tensor or k.endswith("." + tensor)]
    if not found:
        add(tensor, f"{key} {size} differs from the target's vocabulary ({target.vocab_size}) "
            f"but no {tensor} tensor maps draft ids to target ids: include the {tensor} "
            f"tensor of shape [{key}]")
    for k in found:
        dtype, shape = tensors[k]
        if shape != [size] or dtype not in INTEGER_DTYPES:
            add(k, f"{tensor} must be an integer tensor of shape [{size}] ({key}), "
                f"got {dtype} {shape}")


def check_decoder_head(cfg: dict, target, add, method: str, allowed, allowed_text: str) -> None:
    """The whole rule set of a decoder head over the target's hidden states (EAGLE-1, MTP):
    its architecture, sane decoder sizes, the target's vocabulary and hidden size."""
    check_architectures(cfg, method, allowed, allowed_text, add)
    hidden = check_decoder_sizes(cfg, add)
    check_vocab(cfg, target, add)
    if hidden:
        check_reads_target_hidden(method, "hidden_size", hidden, target, add)


def check_reads_target_hidden(method: str, key: str, value, target, add) -> None:
    """A head that reads the target's hidden states declares the target's hidden size."""
    if value != target.hidden_size:
        add(key, f"{value} differs from the target's hidden size ({target.hidden_size}): "
            f"the {method} head reads the target's hidden states, so they must match")
