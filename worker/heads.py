"""Drafting heads that read the target's hidden states, in the checkpoint layouts vLLM loads,
for the reference engine (worker/proposers.py) and the training recipes (worker/training).

EAGLE-1 (vLLM ``EagleLlamaForCausalLM``, model_executor/models/llama_eagle.py): config.json
is a Llama config (``architectures: ["LlamaForCausalLM"]``, vLLM renames it) with
``num_hidden_layers`` head layers; tensors ``fc.weight`` [hidden, 2 * hidden] and
``layers.i.*`` (layer 0 has no ``input_layernorm``: EAGLE feeds the fused features to the
attention directly). No ``embed_tokens`` and no ``lm_head``: vLLM then shares the target's,
and so does this module. At position p the head reads ``fc(cat(embed(t[p+1]), h[p]))``
where h[p] is the target's last hidden state (after the final norm) at p, and its output,
with no final norm, goes through the target's lm_head to propose t[p+2]; the next draft
step feeds that output back as the feature of position p+1.

EAGLE-3 (vLLM ``Eagle3LlamaForCausalLM``, llama_eagle3.py; ``Eagle3Head``, trained here and
served by vLLM only): ``architectures: ["LlamaForCausalLMEagle3"]``, tensors ``fc.weight``
[hidden, 3 * hidden] over the target's layers ``eagle_aux_hidden_state_layer_ids``,
``midlayer.*`` (its attention reads 2 x hidden), ``norm.weight``, its own ``lm_head.weight``
[draft_vocab_size, hidden] and ``d2t`` (target id - draft id).

Medusa (vLLM ``MedusaModel``, model_executor/models/medusa.py): config.json with
``hidden_size``, ``vocab_size``, ``num_heads``, ``num_hidden_layers`` (residual layers per
head) and ``original_lm_head: true`` (one lm_head shared by every head, here the target's
own, stored as ``lm_head.weight``); tensors ``blocks.i.layers.j.weight``. Head i reads the
target's hidden state h[p] and proposes t[p+2+i].
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from worker.llama import (DecoderLayer, KVCache, LlamaConfig, RMSNorm, apply_rope,
                          attention_mask, rope_inverse_frequencies, rope_tables)


def attention_train(attn, x, cos, signed_sin, mask=None, past=()):
    """A layer's attention without a KV cache, for training. ``past``: (keys, values) of
    earlier unrolled steps, placed before this input's own keys; ``mask`` [T, S] (True:
    visible) over those S keys, causal over the own keys when None. Returns the output and
    this input's (keys, values)."""
    b, t, _ = x.shape
    q = attn.q_proj(x).view(b, t, attn.num_heads, attn.head_dim)
    k = attn.k_proj(x).view(b, t, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(x).view(b, t, attn.num_kv_heads, attn.head_dim)
    q, k = apply_rope(q, cos, signed_sin), apply_rope(k, cos, signed_sin)
    keys = torch.cat([pk for pk, _ in past] + [k], dim=1)
    values = torch.cat([pv for _, pv in past] + [v], dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=mask, is_causal=mask is None, enable_gqa=attn.num_kv_heads != attn.num_heads)
    return attn.o_proj(out.transpose(1, 2).reshape(b, t, -1)), (k, v)


def layer_train(layer, x, cos, signed_sin, mask=None, past=()):
    """A decoder layer without a KV cache (see ``attention_train``)."""
    attn_out, kv = attention_train(layer.self_attn, layer.input_layernorm(x), cos, signed_sin,
                                   mask, past)
    x = x + attn_out
    return x + layer.mlp(layer.post_attention_layernorm(x)), kv


# ----------------------------------------------------------------------------- EAGLE

def eagle_config_from_target(target_hf: dict, num_layers: int = 1) -> dict:
    """config.json of an EAGLE-1 head for a Llama target: the target's Llama config with
    ``num_hidden_layers`` head layers (vLLM reads the head's sizes from it)."""
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
            "max_position_embeddings", "vocab_size", "hidden_act", "attention_bias", "mlp_bias",
            "bos_token_id", "eos_token_id", "pad_token_id")
    config = {k: target_hf[k] for k in keep if k in target_hf}
    config.update(architectures=["LlamaForCausalLM"], model_type="llama",
                  num_hidden_layers=num_layers, tie_word_embeddings=False,
                  torch_dtype="float32")
    return config


class EagleHead(nn.Module):
    """An EAGLE-1 head. ``embed_tokens`` and ``lm_head`` are the target's (not saved)."""

    method = "eagle"

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.layers[0].input_layernorm = nn.Identity()
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)

    @classmethod
    def from_pretrained(cls, path, dtype=torch.float32, device="cpu") -> "EagleHead":
        path = Path(path)
        hf = json.loads((path / "config.json").read_text())
        config = LlamaConfig.from_hf(hf)
        head = cls(config)
        weights = load_safetensors(path, dtype, device)
        extra = sorted(set(weights) - set(head.state_dict()) - {"embed_tokens.weight", "lm_head.weight"})
        if extra:
            raise ValueError(f"{path}: tensors an EAGLE-1 head does not have: {', '.join(extra[:5])}")
        head.load_state_dict({k: v for k, v in weights.items() if k in head.state_dict()}, strict=True)
        head = head.to(dtype=dtype, device=device).eval()
        for layer in head.layers:  # fused inference projections (reference.PackedLinear)
            layer.pack()
        return head

    def fuse(self, embeds, features):
        return self.fc(torch.cat((embeds, features), dim=-1))

    @torch.no_grad()
    def forward(self, embeds, features, cache: KVCache, rows=None):
        """Output features [R, T, hidden] of the head for fused inputs appended to the
        cached positions of ``rows`` (the reference Llama's cache conventions)."""
        x = self.fuse(embeds, features)
        num_rows, length, _ = x.shape
        device = x.device
        row_index = torch.arange(cache.batch_size, device=device) if rows is None else rows
        starts = cache.lengths[row_index]
        positions = starts[:, None] + torch.arange(length, device=device)
        num_slots = int(starts.max()) + length
        if num_slots > cache.max_slots:
            raise ValueError(f"EAGLE KV cache overflow: {num_slots} slots > {cache.max_slots}")
        mask = attention_mask(positions, num_slots, x.dtype)
        cos, signed_sin = rope_tables(self.inv_freq, positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, signed_sin, cache.k[i], cache.v[i], row_index[:, None], positions,
                      rows, num_slots, mask)
        return x

    def new_cache(self, batch_size, max_slots) -> KVCache:
        return KVCache(self.config, batch_size, max_slots, self.fc.weight.dtype, self.fc.weight.device)

    def train_forward(self, embeds, features, positions, mask=None, past=None):
        """Training: output features and each layer's (keys, values) for ``embeds`` and
        ``features`` [B, T, hidden]; ``past`` per layer: earlier unrolled steps' keys."""
        x = self.fuse(embeds, features)
        cos, signed_sin = rope_tables(self.inv_freq, positions, x.dtype)
        kvs = []
        for i, layer in enumerate(self.layers):
            x, kv = layer_train(layer, x, cos, signed_sin, mask, past[i] if past else ())
            kvs.append(kv)
        return x, kvs

    def save(self, out_dir: Path, target_hf: dict, dtype=torch.float32):
        from safetensors.torch import save_file

        out_dir.mkdir(parents=True, exist_ok=True)
        config = eagle_config_from_target(target_hf, self.config.num_layers)
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file({k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()},
                  str(out_dir / "model.safetensors"), metadata={"format": "pt"})


class Eagle3Head(nn.Module):
    """An EAGLE-3 head in vLLM's layout (``Eagle3LlamaForCausalLM``,
    model_executor/models/llama_eagle3.py), for training; vLLM serves it (the reference
    engine has no EAGLE-3 proposer).

    It reads the target's residual stream after ``aux_layers`` (vLLM's auxiliary hidden
    states, concatenated), fuses them with ``fc`` to one hidden state g[p], and runs one
    decoder layer (``midlayer``) whose attention takes cat(input_layernorm(embed(t[p+1])),
    hidden_norm(g[p])) (2 x hidden wide) with g[p] as the residual; a final ``norm`` and
    its own ``lm_head`` over a draft vocabulary give the proposal for t[p+2]. The output
    before the final norm is fed back as g of the next draft step. ``d2t[j]`` is target id
    minus draft id j, as vLLM reads it; ``embed_tokens`` is the target's (not saved)."""

    method = "eagle3"

    def __init__(self, config: LlamaConfig, aux_layers: tuple[int, ...], draft_ids: torch.Tensor):
        super().__init__()
        self.config, self.aux_layers = config, tuple(aux_layers)
        h = config.hidden_size
        self.fc = nn.Linear(len(self.aux_layers) * h, h, bias=False)
        self.midlayer = DecoderLayer(config)
        attn = self.midlayer.self_attn
        for name, heads in (("q_proj", attn.num_heads), ("k_proj", attn.num_kv_heads),
                            ("v_proj", attn.num_kv_heads)):
            setattr(attn, name, nn.Linear(2 * h, heads * attn.head_dim, bias=config.attention_bias))
        self.midlayer.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, len(draft_ids), bias=False)
        self.register_buffer("draft_ids", draft_ids.long().clone(), persistent=False)
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)

    def train_forward(self, embeds, hidden, positions, mask=None, past=()):
        """Training: the output before the final norm [B, T, hidden] and the layer's (keys,
        values), for token embeddings and g [B, T, hidden] (``fc`` of the target's features
        at the first step, the previous step's output after it); ``mask`` and ``past`` as
        in ``attention_train``."""
        layer = self.midlayer
        cos, signed_sin = rope_tables(self.inv_freq, positions, hidden.dtype)
        fused = torch.cat((layer.input_layernorm(embeds), layer.hidden_norm(hidden)), dim=-1)
        attn_out, kv = attention_train(layer.self_attn, fused, cos, signed_sin, mask, past)
        x = hidden + attn_out
        return x + layer.mlp(layer.post_attention_layernorm(x)), kv

    def logits(self, out):
        """Logits over the draft vocabulary for outputs of ``train_forward``."""
        return self.lm_head(self.norm(out))

    def save(self, out_dir: Path, target_hf: dict, dtype=torch.float32):
        from safetensors.torch import save_file

        out_dir.mkdir(parents=True, exist_ok=True)
        config = eagle_config_from_target(target_hf, 1)
        config.update(architectures=["LlamaForCausalLMEagle3"],
                      draft_vocab_size=len(self.draft_ids),
                      target_hidden_size=self.config.hidden_size,
                      eagle_aux_hidden_state_layer_ids=list(self.aux_layers),
                      torch_dtype=str(dtype).removeprefix("torch."))
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tensors = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()}
        tensors["d2t"] = (self.draft_ids - torch.arange(len(self.draft_ids))).contiguous()
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


# ----------------------------------------------------------------------------- Medusa

class ResidualBlock(nn.Module):
    """vLLM's Medusa ResidualBlock: x + silu(linear(x)) per layer."""

    def __init__(self, hidden: int, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(num_layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    """Medusa heads sharing one lm_head (``original_lm_head``): head i proposes the token
    i + 2 places after the position whose hidden state it reads.

    With a ``token_map`` (vLLM's truncated vocabulary) the lm_head holds only those rows of
    the target's: the heads draft over a few thousand frequent tokens instead of the whole
    vocabulary, and ``token_map[j]`` is the target id of draft id j."""

    method = "medusa"

    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int = 1,
                 token_map: torch.Tensor | None = None):
        super().__init__()
        self.hidden, self.vocab = hidden, vocab
        self.num_heads, self.num_layers = num_heads, num_layers
        self.blocks = nn.ModuleList(ResidualBlock(hidden, num_layers) for _ in range(num_heads))
        rows = vocab if token_map is None else len(token_map)
        self.lm_head = nn.Linear(hidden, rows, bias=False)
        self.token_map = None if token_map is None else token_map.long()

    @classmethod
    def from_pretrained(cls, path, dtype=torch.float32, device="cpu") -> "MedusaHeads":
        path = Path(path)
        hf = json.loads((path / "config.json").read_text())
        num_heads = next((v for k, v in hf.items() if "num" in k and "heads" in k), None)
        num_layers = next((v for k, v in hf.items() if "num" in k and "layers" in k), 1)
        if not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"{path / 'config.json'}: needs num_heads (the number of Medusa heads)")
        weights = load_safetensors(path, dtype, device)
        if "lm_head.weight" not in weights:
            if not hf.get("original_lm_head") and "lm_heads.0.weight" in weights:
                raise ValueError(f"{path}: heads with one lm_head each are not supported by the "
                                 "reference engine; save with original_lm_head (one shared lm_head)")
            weights["lm_head.weight"] = weights.pop("lm_heads.0.weight")
        token_map = weights.pop("token_map", None)
        vocab = hf.get("vocab_size") or weights["lm_head.weight"].shape[0]
        if token_map is not None:
            token_map = token_map.long()
            if weights["lm_head.weight"].shape[0] > len(token_map):  # vLLM slices it too
                weights["lm_head.weight"] = weights["lm_head.weight"][token_map]
        heads = cls(hf["hidden_size"], vocab, num_heads, num_layers, token_map=token_map)
        heads.load_state_dict({k.removeprefix("medusa_heads."): v for k, v in weights.items()}, strict=True)
        return heads.to(dtype=dtype, device=device).eval()

    def forward(self, hidden):
        """Logits [..., heads, draft vocabulary] for hidden states [..., hidden]."""
        return torch.stack([self.lm_head(block(hidden)) for block in self.blocks], dim=-2)

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.token_map is None else self.token_map[draft_ids]

    def target_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """Probabilities over the draft vocabulary spread onto the target's (zero elsewhere)."""
        if self.token_map is None:
            return probs
        full = probs.new_zeros(*probs.shape[:-1], self.vocab)
        full[..., self.token_map] = probs
        return full

    def save(self, out_dir: Path, dtype=torch.float32):
        from safetensors.torch import save_file

        out_dir.mkdir(parents=True, exist_ok=True)
        rows = self.lm_head.weight.shape[0]
        config = {"architectures": ["MedusaModel"], "model_type": "medusa",
                  "hidden_size": self.hidden, "vocab_size": self.vocab,
                  "num_heads": self.num_heads, "num_hidden_layers": self.num_layers,
                  "original_lm_head": True, "truncated_vocab_size": rows,
                  "torch_dtype": str(dtype).removeprefix("torch.")}
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tensors = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()}
        if self.token_map is not None:
            tensors["token_map"] = self.token_map.to(torch.int64).contiguous()
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def load_safetensors(path: Path, dtype, device) -> dict:
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {path}")
    weights = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                weights[name] = f.get_tensor(name).to(dtype=dtype, device=device)
    return weights
