"""The reference engine: batched speculative decoding in plain torch.

A compact Llama forward that reads a Hugging Face checkpoint (config.json + safetensors)
directly, a KV cache that rolls back rejected tokens by moving a per-sequence length, and a
decoding loop in which every sequence of the batch accepts its own number of drafted tokens
per step. Greedy output equals the target's own greedy output; sampling uses standard
speculative rejection sampling, so outputs follow the target's distribution. Every step is
traced per sequence (drafted tokens, accepted prefix, bonus token, time per phase).

Speed (batch 1 on CPU is bound by the matrix products, about 80% of a forward): the loaded
model runs its projections through fused, frozen copies built once (``PackedLinear``: q/k/v
and gate/up fused, weights reordered for oneDNN), builds the attention mask and rotary
tables once per forward rather than per layer, and computes logits only where asked.

Layout of a batch: sequences are right-padded. A sequence's KV slot j holds its token at
position j, so position ids are slot indices and the attention mask is ``slot <= query
slot``; a padded input writes slots past the sequence's committed length, which are never
visible and are overwritten by its next forward. Rolling back is setting the length.

Timing phases (seconds, time.perf_counter, contiguous so they add up to the wall time):
drafting (the proposer, draft-model prefill included), verification (every target forward,
the prefill of step 0 included), sampling (acceptance and rejection sampling), other
(batch assembly, bookkeeping, detokenisation, the on_step callback).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
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


# ----------------------------------------------------------------------------- tracing

PHASES = ("drafting", "verification", "sampling", "other")


@dataclass
class StepTrace:
    """One step of one sequence. ``accepted`` counts the drafted tokens the target accepted
    (a prefix of ``drafted``); ``bonus`` is the target's own token that follows them (the
    correction after a rejection, or the bonus when all were accepted), None when the
    sequence ended (EOS) inside the accepted drafts. ``emitted`` is what the step appended
    to the output, never past an EOS. ``times`` is the whole batch step's phase breakdown
    (seconds), shared by the sequences in that step. Step 0 is the prefill: no draft."""

    step: int
    seq: int
    drafted: list[int]
    accepted: int
    bonus: int | None
    emitted: list[int]
    times: dict
    finished: bool = False

    def to_dict(self):
        return {"step": self.step, "seq": self.seq, "drafted": self.drafted,
                "accepted": self.accepted, "bonus": self.bonus, "emitted": self.emitted,
                "times": self.times, "finished": self.finished}


@dataclass
class SequenceResult:
    """One sequence of a generation. ``timings`` (seconds): the phases of every batch step
    this sequence took part in, and ``wall``, from the start of ``generate`` to the end of
    the step that finished it (its latency); the phases add up to ``wall``."""

    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    steps: list[StepTrace]
    timings: dict
    ttft: float = 0.0
    finish_reason: str = "length"  # "eos" or "length"

    def to_dict(self):
        return {"prompt_ids": self.prompt_ids, "output_ids": self.output_ids, "text": self.text,
                "timings": self.timings, "ttft": self.ttft, "finish_reason": self.finish_reason,
                "steps": [s.to_dict() for s in self.steps]}


class PhaseClock:
    """Splits wall time into contiguous phases: each lap charges the time since the last lap."""

    def __init__(self):
        self.last = time.perf_counter()
        self.step = dict.fromkeys(PHASES, 0.0)

    def lap(self, phase: str):
        now = time.perf_counter()
        self.step[phase] += now - self.last
        self.last = now

    def take_step(self) -> dict:
        times, self.step = self.step, dict.fromkeys(PHASES, 0.0)
        return times


# ----------------------------------------------------------------------------- sampling

def verify_greedy(target_logits, drafted):
    """Longest prefix of ``drafted`` equal to the target's argmax, and the target's token after it."""
    target_tokens = target_logits.argmax(-1).tolist()
    accepted = 0
    while accepted < len(drafted) and drafted[accepted] == target_tokens[accepted]:
        accepted += 1
    return accepted, target_tokens[accepted]


def verify_sampling(target_probs, drafted, draft_probs, generator):
    """Speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023).

    Draft token x_i is accepted with probability min(1, p_i(x) / q_i(x)); at the first
    rejection the next token comes from norm(max(0, p_i - q_i)); when all are accepted a
    bonus token comes from p_n. ``draft_probs`` None means a deterministic proposer (q is
    one-hot, so accept with probability p_i(x) and resample from p_i without x).
    Returns (accepted count, next token)."""
    for i, token in enumerate(drafted):
        p = target_probs[i]
        q_token = 1.0 if draft_probs is None else float(draft_probs[i, token])
        u = float(torch.rand((), generator=generator))
        if u * q_token < float(p[token]):  # u < p/q without dividing by a zero q
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q numerically: any sample of p will do
            residual = p
        return i, int(torch.multinomial(residual, 1, generator=generator))
    return len(drafted), int(torch.multinomial(target_probs[len(drafted)], 1, generator=generator))


def sample_token(logits, temperature, generator):
    if temperature == 0:
        return int(logits.argmax(-1))
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


# ----------------------------------------------------------------------------- engine

@dataclass
class _Sequence:
    index: int
    prompt_ids: list[int]
    max_new_tokens: int
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    steps: list = field(default_factory=list)
    timings: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    finished: bool = False
    finish_reason: str = "length"
    text: str = ""
    wall: float = 0.0
    ttft: float = 0.0

    @property
    def tokens(self):
        return self.prompt_ids + self.output_ids


class ReferenceEngine:
    """A Llama-family target in plain torch, with speculative decoding by any proposer of
    ``worker.proposers``."""

    def __init__(self, target_path, dtype="float32", device="cpu"):
        self.path = Path(target_path)
        self.dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        self.device = torch.device(device)
        self.model = Llama.from_pretrained(self.path, self.dtype, self.device)
        self.config = self.model.config
        self.tokenizer = _load_tokenizer(self.path)
        self.eos_ids = set(self.config.eos_token_ids) | _generation_eos_ids(self.path)
        if not self.eos_ids and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_ids = {self.tokenizer.eos_token_id}

    def encode_chat(self, user_text: str) -> list[int]:
        """Token ids of one user turn in the target's chat template, generation prompt added."""
        if self.tokenizer is None:
            raise RuntimeError(f"{self.path} has no tokenizer")
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": user_text}], tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    @torch.inference_mode()  # no autograd bookkeeping at all (caches are made inside)
    def generate(self, prompts, proposer=None, k=4, max_new_tokens=64, temperature=0.0, seed=0,
                 eos_ids=None, on_step=None) -> list[SequenceResult]:
        """Decode a batch of prompts (lists of token ids) together.

        ``proposer``: None for plain decoding (one token per step), else a proposer from
        ``worker.proposers.make_proposer`` drafting up to ``k`` tokens per step.
        ``max_new_tokens``: an int, or one per prompt. ``eos_ids``: the target's when None.
        Sequence i samples from its own generator seeded with ``seed + i``, so its output
        does not depend on the rest of the batch. ``on_step(trace)`` is called with each
        sequence's StepTrace after every step."""
        clock = PhaseClock()
        started = clock.last
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if temperature < 0:
            raise ValueError("temperature must be >= 0 (0 is greedy)")
        eos = set(self.eos_ids if eos_ids is None else eos_ids)
        budgets = max_new_tokens if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(prompts)
        seqs = [_Sequence(i, list(map(int, p)), int(budgets[i]),
                          torch.Generator().manual_seed(seed + i)) for i, p in enumerate(prompts)]
        k = k if proposer is not None else 0
        max_slots = max(len(p) for p in prompts) + max(budgets) + k + 2
        cache = self.model.new_cache(len(seqs), max_slots)
        if proposer is not None:
            proposer.start(self, len(seqs), max_slots + k, temperature)
        # Heads that read the target's hidden states (EAGLE, Medusa) get those of the newly
        # committed positions with each propose call; plain decoding never computes them.
        with_hidden = bool(getattr(proposer, "uses_hidden_states", False))
        pending_hidden = [[] for _ in seqs]  # per sequence: [n, hidden] chunks not yet passed

        def finish_step(step, traces):
            # The traces share the step's times dict, which the callback sees before this
            # step's "other" is final: the callback and the bookkeeping belong to that step.
            times = clock.step
            for trace in traces:
                trace.times = times
            clock.lap("other")
            if on_step is not None:
                for trace in traces:
                    on_step(trace)
            clock.lap("other")
            clock.take_step()
            for trace in traces:
                seq = seqs[trace.seq]
                for phase in PHASES:
                    seq.timings[phase] += times[phase]
                if step == 0:
                    seq.ttft = clock.last - started
                if trace.finished:
                    seq.wall = clock.last - started

        # Step 0, the prefill: every prompt at once, right-padded; logits of its last token.
        lengths = torch.tensor([len(s.prompt_ids) for s in seqs], device=self.device)
        input_ids = _right_pad([s.prompt_ids for s in seqs], self.device)
        clock.lap("other")
        if with_hidden:
            logits, hidden = self.model(input_ids, cache, logits_at=(lengths - 1)[:, None],
                                        return_hidden=True)
            logits = logits[:, 0]
            for s in seqs:
                pending_hidden[s.index].append(hidden[s.index, :len(s.prompt_ids)])
        else:
            logits = self.model(input_ids, cache, logits_at=(lengths - 1)[:, None])[:, 0]
        clock.lap("verification")
        first = [sample_token(logits[s.index], temperature, s.generator) for s in seqs]
        clock.lap("sampling")
        cache.lengths.copy_(lengths)
        traces = [self._append(s, [], 0, token, step=0, eos=eos) for s, token in zip(seqs, first)]
        finish_step(0, traces)

        step = 0
        while True:
            active = [s for s in seqs if not s.finished]
            if not active:
                break
            step += 1
            # Draft at most what the budget leaves room for besides the target's own token.
            want = [min(k, s.max_new_tokens - len(s.output_ids) - 1) for s in active]
            drafts = [([], None)] * len(active)
            clock.lap("other")
            if proposer is not None and any(want):
                extra = {}
                if with_hidden:
                    # Target hidden states of the context positions the proposer has not
                    # seen yet (it keeps its own cache of the earlier ones).
                    extra["hidden_states"] = [torch.cat(pending_hidden[s.index]) for s in active]
                    for s in active:
                        pending_hidden[s.index] = []
                drafts = proposer.propose([s.index for s in active], [s.tokens for s in active],
                                          want, [s.generator for s in active], **extra)
                drafts = [(list(d[0])[:n], None if d[1] is None else d[1][:n])
                          for d, n in zip(drafts, want)]
            clock.lap("drafting")
            # The last emitted token (not yet in the cache) followed by each sequence's draft.
            rows_input = [[s.output_ids[-1]] + list(d[0]) for s, d in zip(active, drafts)]
            rows = None if len(active) == len(seqs) else torch.tensor([s.index for s in active])
            input_ids = _right_pad(rows_input, self.device)
            clock.lap("other")
            if with_hidden:
                logits, hidden = self.model(input_ids, cache, rows=rows, return_hidden=True)
            else:
                logits = self.model(input_ids, cache, rows=rows)
            clock.lap("verification")
            results = []
            if temperature == 0:
                for s, (drafted, _), row_logits in zip(active, drafts, logits):
                    results.append(verify_greedy(row_logits[:len(drafted) + 1], list(drafted)))
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                for s, (drafted, q), row_probs in zip(active, drafts, probs):
                    results.append(verify_sampling(row_probs, list(drafted), q, s.generator))
            clock.lap("sampling")
            traces = []
            for i, (s, (drafted, _), (accepted, bonus)) in enumerate(zip(active, drafts, results)):
                # Committed: the last token and the accepted drafts; the bonus is next input.
                cache.rollback(s.index, len(s.tokens) + accepted)
                if with_hidden:  # the committed positions: the last token and accepted drafts
                    pending_hidden[s.index].append(hidden[i, :accepted + 1])
                traces.append(self._append(s, list(drafted), accepted, bonus, step, eos))
            finish_step(step, traces)

        return [SequenceResult(
            prompt_ids=s.prompt_ids, output_ids=s.output_ids, text=s.text, steps=s.steps,
            timings={**s.timings, "wall": s.wall}, ttft=s.ttft, finish_reason=s.finish_reason,
        ) for s in seqs]

    def _append(self, seq: _Sequence, drafted, accepted, bonus, step, eos) -> StepTrace:
        """Emit the accepted drafts and the bonus token, stopping at EOS or the budget."""
        emitted, ended_in_draft = [], False
        for i, token in enumerate(drafted[:accepted] + [bonus]):
            if len(seq.output_ids) + len(emitted) >= seq.max_new_tokens:
                break
            emitted.append(token)
            if token in eos:
                seq.finished, seq.finish_reason = True, "eos"
                if i < accepted:  # the EOS was a draft: what follows was never generated
                    accepted, bonus, ended_in_draft = i + 1, None, True
                break
        seq.output_ids.extend(emitted)
        if len(seq.output_ids) >= seq.max_new_tokens:
            seq.finished = True
        trace = StepTrace(step=step, seq=seq.index, drafted=drafted, accepted=accepted,
                          bonus=None if ended_in_draft else bonus, emitted=emitted, times={},
                          finished=seq.finished)
        seq.steps.append(trace)
        if seq.finished:
            seq.text = self.decode(seq.output_ids)
        return trace


def _right_pad(rows, device, pad=0):
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [pad] * (width - len(r)) for r in rows], dtype=torch.long,
                        device=device)


def _load_tokenizer(path: Path):
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _generation_eos_ids(path: Path) -> set:
    file = path / "generation_config.json"
    if not file.is_file():
        return set()
    eos = json.loads(file.read_text()).get("eos_token_id")
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])
