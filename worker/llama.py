"""A compact Llama forward in plain torch: the building blocks the reference engine, the
drafting proposers, the trained heads and the training recipes share.

It reads a Hugging Face checkpoint (config.json + safetensors) directly. Its own module so
that the drafting methods can build their models without importing an engine (data flows
one way: methods are read by the engines, never the reverse).

Speed (batch 1 on CPU is bound by the matrix products, about 80% of a forward): the loaded
model runs its projections through fused, frozen copies built once (``PackedLinear``: q/k/v
and gate/up fused, weights reordered for oneDNN), builds the attention mask and rotary
tables once per forward rather than per layer, and computes logits only where asked.

Layout of a batch: sequences are right-padded. A sequence's KV slot j holds its token at
position j, so position ids are slot indices and the attention mask is ``slot <= query
slot``; a padded input writes slots past the sequence's committed length, which are never
visible and are overwritten by its next forward. Rolling back is setting the length.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------- model

@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: tuple = ()

    @classmethod
    def from_hf(cls, hf: dict) -> "LlamaConfig":
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {hf['hidden_act']!r} (Llama uses silu)")
        # transformers 5 writes rope_parameters; older checkpoints rope_theta + rope_scaling.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        eos = hf.get("eos_token_id")
        heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=rope or None,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        )


def rope_inverse_frequencies(config: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies of rotary embeddings, with Llama's scaling variants."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":  # Llama 3.1: long wavelengths scaled down, short kept, smooth between
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError(f"rope type {kind!r} is not supported by the reference engine")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if x.dtype == torch.float32:  # one op, the same arithmetic as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()  # normalise in float32 as transformers does, even for bf16 weights
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def apply_rope(x, cos, signed_sin):
    """Rotary embedding, ``x * cos + cat(-x2, x1) * sin`` for halves x1, x2 of the head
    dimension, in four ops: rolling by half swaps the halves, and ``signed_sin`` (sin with
    its first half negated, from rope_tables) gives the first its sign; the same floats."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def _onednn_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and \
            hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and \
            hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


class PackedLinear:
    """One or more ``nn.Linear`` of the same input fused along their outputs, frozen, for
    inference (``Llama.pack``). On CPU in float32 the weight is reordered once into oneDNN's
    blocked layout: with one thread on the development machine (AMD EPYC, MKL 2024) that
    runs the model's matrix products 1.5x (one row) to 2.2x (four rows) faster than
    ``F.linear``, in float32 arithmetic. Inputs of fewer than ``MIN_ROWS`` rows are
    zero-padded to it: oneDNN's kernel for four rows is its fastest, and every row's result
    is then bit-identical whatever the number of rows (at one row it picks another kernel
    that sums in another order), so plain decoding and verification compute each position
    alike. Elsewhere (another device or dtype, no oneDNN) it is ``F.linear`` on the fused
    weight."""

    MIN_ROWS = 4
    ONEDNN = _onednn_available()

    def __init__(self, *linears: nn.Linear):
        weight = torch.cat([lin.weight.detach() for lin in linears])
        biases = [lin.bias for lin in linears]
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self.out_features = weight.shape[0]
        self.onednn = self.ONEDNN and weight.device.type == "cpu" and weight.dtype == torch.float32
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight) if self.onednn else weight

    def __call__(self, x):
        if not self.onednn:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, x.shape[-1])
        count = rows.shape[0]
        if count < self.MIN_ROWS:
            rows = F.pad(rows, (0, 0, 0, self.MIN_ROWS - count))
        out = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
        return out[:count].view(*x.shape[:-1], self.out_features)


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        self.packed_qkv = self.packed_o = None  # PackedLinear after pack()

    def pack(self):
        self.packed_qkv = PackedLinear(self.q_proj, self.k_proj, self.v_proj)
        self.packed_o = PackedLinear(self.o_proj)

    def forward(self, x, cos, signed_sin, cache_k, cache_v, write_rows, write_slots, read_rows,
                num_slots, mask):
        batch, length, _ = x.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        if self.packed_qkv is not None:
            qkv = self.packed_qkv(x).view(batch, length, heads + 2 * kv_heads, self.head_dim)
            # Queries and keys take the same rotation: one rope over both heads' slices.
            qk = apply_rope(qkv[:, :, :heads + kv_heads], cos, signed_sin)
            q, k, v = qk[:, :, :heads], qk[:, :, heads:], qkv[:, :, heads + kv_heads:]
        else:
            q = apply_rope(self.q_proj(x).view(batch, length, heads, self.head_dim), cos, signed_sin)
            k = apply_rope(self.k_proj(x).view(batch, length, kv_heads, self.head_dim), cos, signed_sin)
            v = self.v_proj(x).view(batch, length, kv_heads, self.head_dim)
        # Each sequence writes its new keys at its own slots (slot = position).
        cache_k[write_rows, write_slots] = k.to(cache_k.dtype)
        cache_v[write_rows, write_slots] = v.to(cache_v.dtype)
        if read_rows is None:  # every sequence of the cache takes part: a view, no copy
            keys, values = cache_k[:, :num_slots], cache_v[:, :num_slots]
        else:
            keys, values = cache_k[read_rows, :num_slots], cache_v[read_rows, :num_slots]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype),
            attn_mask=mask, enable_gqa=kv_heads != heads)
        out = out.transpose(1, 2).reshape(batch, length, -1)
        return self.o_proj(out) if self.packed_o is None else self.packed_o(out)


class MLP(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)
        self.packed_gate_up = self.packed_down = None  # PackedLinear after pack()

    def pack(self):
        self.packed_gate_up = PackedLinear(self.gate_proj, self.up_proj)
        self.packed_down = PackedLinear(self.down_proj)

    def forward(self, x):
        # Training (worker/heads.layer_train) differentiates through the nn.Linear weights;
        # the packed copies are for inference only.
        if self.packed_gate_up is None or torch.is_grad_enabled():
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = self.packed_gate_up(x).chunk(2, dim=-1)
        return self.packed_down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def pack(self):
        """Fused, frozen copies of the projections for inference (see PackedLinear)."""
        self.self_attn.pack()
        self.mlp.pack()

    def forward(self, x, cos, signed_sin, cache_k, cache_v, *cache_args):
        x = x + self.self_attn(self.input_layernorm(x), cos, signed_sin, cache_k, cache_v, *cache_args)
        return x + self.mlp(self.post_attention_layernorm(x))


def rope_tables(inv_freq, positions, dtype):
    """cos and signed sin [R, T, 1, head_dim] at ``positions`` [R, T], for apply_rope."""
    freqs = positions[..., None].float() * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    half = freqs.shape[-1]
    sin = angles.sin()
    sin[..., :half].neg_()
    return angles.cos().to(dtype)[:, :, None], sin.to(dtype)[:, :, None]


def attention_mask(positions, num_slots, dtype):
    """Additive mask [R, 1, T, slots]: query at position p sees slots 0..p of its own
    sequence. None when nothing is hidden (one query at the last slot of one sequence).
    Built once per forward in the form SDPA uses (it turns a bool mask into this, per layer)."""
    if positions.shape == (1, 1) and int(positions[0, 0]) == num_slots - 1:
        return None
    visible = torch.arange(num_slots, device=positions.device)[None, None, :] <= positions[:, :, None]
    mask = torch.zeros(visible.shape, dtype=dtype, device=positions.device)
    return mask.masked_fill_(~visible, float("-inf"))[:, None]


class KVCache:
    """Keys and values of a batch of sequences, [batch, slots, kv heads, head dim] per layer.

    ``lengths[b]`` counts the committed tokens of sequence b. A forward writes new tokens
    from that slot on but does not commit them: the caller sets the new length, which is
    how rejected drafts are rolled back (their slots are masked out and later overwritten).
    """

    def __init__(self, config: LlamaConfig, batch_size: int, max_slots: int, dtype, device):
        shape = (batch_size, max_slots, config.num_kv_heads, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.batch_size, self.max_slots = batch_size, max_slots

    def rollback(self, row: int, length: int):
        """Forget everything after the first ``length`` tokens of sequence ``row``."""
        self.lengths[row] = length


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)
        self.packed_lm_head = None  # PackedLinear after pack()

    @classmethod
    def from_pretrained(cls, path, dtype=torch.float32, device="cpu") -> "Llama":
        """Read config.json and every *.safetensors file of a Hugging Face Llama checkpoint."""
        from safetensors import safe_open

        path = Path(path)
        config = LlamaConfig.from_hf(json.loads((path / "config.json").read_text()))
        weights = {}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors file in {path}")
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    short = name.removeprefix("model.")
                    weights[short] = f.get_tensor(name).to(dtype=dtype, device=device)
        if config.tie_word_embeddings or "lm_head.weight" not in weights:
            weights["lm_head.weight"] = weights["embed_tokens.weight"]
        with torch.device("meta"):
            model = cls(config)
        model.load_state_dict(weights, strict=True, assign=True)
        model.inv_freq = rope_inverse_frequencies(config).to(device)  # meta buffers hold nothing
        if config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        return model.eval().pack()

    def pack(self) -> "Llama":
        """Build the fused, frozen projections that inference uses (PackedLinear): q/k/v and
        gate/up fused, weights reordered for oneDNN on CPU in float32. The nn.Linear weights
        stay as they are (state_dict, training, tied embeddings); pack again after changing
        them. Costs a second copy of the weights."""
        for layer in self.layers:
            layer.pack()
        self.packed_lm_head = PackedLinear(self.lm_head)
        return self

    def new_cache(self, batch_size: int, max_slots: int) -> KVCache:
        return KVCache(self.config, batch_size, max_slots, self.embed_tokens.weight.dtype,
                       self.embed_tokens.weight.device)

    def logits(self, hidden):
        """float32 logits of final hidden states (after the norm)."""
        head = self.lm_head if self.packed_lm_head is None else self.packed_lm_head
        return head(hidden).float()

    @torch.no_grad()
    def forward(self, input_ids, cache: KVCache, rows=None, logits_at=None, return_hidden=False,
                hidden_layers: tuple[int, ...] = ()):
        """Logits [R, T or P, vocab] in float32 for ``input_ids`` [R, T] appended to the cached
        tokens of the cache rows ``rows`` (all rows when None). ``logits_at`` [R, P] picks
        the input positions whose logits are wanted (all when None). Nothing is committed.
        ``return_hidden``: also return the last hidden states after the final norm, [R, T,
        hidden], for every input position (what EAGLE and Medusa heads read); off by
        default so plain decoding normalises only the positions it needs. With
        ``hidden_layers`` the hidden states returned are instead the residual stream after
        each of those numbers of decoder layers, concatenated [R, T, len * hidden]: vLLM's
        auxiliary hidden states, what an EAGLE-3 head reads (layer id L is the output of
        layer L - 1, 0 the embeddings)."""
        num_rows, length = input_ids.shape
        device = input_ids.device
        row_index = torch.arange(cache.batch_size, device=device) if rows is None else rows
        starts = cache.lengths[row_index]
        positions = starts[:, None] + torch.arange(length, device=device)  # [R, T]
        num_slots = int(starts.max()) + length
        if num_slots > cache.max_slots:
            raise ValueError(f"KV cache overflow: {num_slots} slots > {cache.max_slots}")
        x = self.embed_tokens(input_ids)
        mask = attention_mask(positions, num_slots, x.dtype)
        cos, signed_sin = rope_tables(self.inv_freq, positions, x.dtype)
        write_rows = row_index[:, None]
        taken = {}  # residual streams asked for by hidden_layers, by layers applied
        for i, layer in enumerate(self.layers):
            if hidden_layers and i in hidden_layers:
                taken[i] = x
            x = layer(x, cos, signed_sin, cache.k[i], cache.v[i], write_rows, positions, rows,
                      num_slots, mask)
        if return_hidden:
            last = self.norm(x)
            taken[len(self.layers)] = x
            hidden = torch.cat([taken[i] for i in hidden_layers], dim=-1) if hidden_layers else last
            if logits_at is not None:
                last = last.gather(1, logits_at[..., None].expand(-1, -1, x.shape[-1]))
            return self.logits(last), hidden
        if logits_at is not None:
            x = x.gather(1, logits_at[..., None].expand(-1, -1, x.shape[-1]))
        return self.logits(self.norm(x))
