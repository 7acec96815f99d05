"""Baseline drafter recipes. Each trains on the same shared data (the target's own
conversations and its hidden states, worker/training/data.py) and writes a folder the
engines load (config.json + model.safetensors) that passes worker/checkpoint.

- ``draft_model``: a small Llama made of the target's embeddings, first ``layers`` decoder
  layers, final norm and lm_head (tied as in the target), distilled on the target's
  next-token distributions (KL(target || draft)) over the answers. Embeddings and lm_head
  stay frozen (they are the target's and cost most of the compute).
- ``eagle``: a one-layer EAGLE-1 head (worker/heads.py) trained as in EAGLE-1: from the
  target's hidden state h[p] and token t[p+1] predict h[p+1]: smooth-L1 on the feature
  plus 0.1 x cross-entropy of its token distribution (through the target's lm_head)
  against the target's.
- ``eagle_multistep``: the same head, data and loss, with only the objective changed: the
  head is also unrolled ``unroll`` - 1 more steps on its own predicted features, with the
  attention of step s seeing real features up to p - s and its own predictions after, as
  drafting does (HASS-style training-time test). Costs about ``unroll`` times as much.
- ``medusa``: Medusa heads (ResBlocks sharing the target's lm_head, zero-initialised so
  they start as the target's own head); head i learns t[p+2+i] from h[p] by
  cross-entropy, weighted 0.8^i as in Medusa-1.
- ``medusa_reduced_vocab``: the same heads drafting over the ``draft_vocab`` most frequent
  answer tokens of the data (vLLM's ``truncated_vocab_size`` + ``token_map``): the cheap-
  drafting route, whose lm_head product shrinks about twelvefold at 4096 tokens.
- ``eagle3``: an EAGLE-3 head (worker/heads.py): three of the target's layers fused, one
  decoder layer, its own lm_head over the ``draft_vocab`` most frequent answer tokens (the
  ``d2t`` map vLLM reads), trained on the token alone (cross-entropy against the target's
  greedy token), unrolled ``unroll`` steps on its own outputs (training-time test).

Loss positions are the answer's tokens; the prompt is context only. Every softmax runs
over the training data's vocabulary (the tokens that occur in it, a few thousand of the
target's 49152): the labels are all in it, and the lm_head products, which dominate the
cost on a CPU, shrink by an order of magnitude. The saved drafters keep the full vocabulary.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from worker.llama import Llama, LlamaConfig, rope_tables
from worker.heads import Eagle3Head, EagleHead, MedusaHeads, layer_train

SAVE_DTYPE = torch.bfloat16  # as the demo target is stored; engines upcast


def _answer_mask(batch, width, offset):
    """[B, width] True where position p predicts token p + offset inside the answer."""
    p = torch.arange(width)[None, :]
    target = p + offset
    return (target >= batch["prompt_lens"][:, None]) & (target < batch["lengths"][:, None])


def _soft_cross_entropy(logits, target_logits):
    """Cross-entropy of logits against the target's distribution (KL up to a constant)."""
    return -(torch.softmax(target_logits, -1) * torch.log_softmax(logits, -1)).sum(-1).mean()


def frequent_answer_tokens(data, count: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The ``count`` most frequent answer tokens of the data (sorted ids) and the share of
    answer tokens they cover: a reduced draft vocabulary."""
    if data is None:
        raise ValueError("the reduced vocabulary is chosen from the training data")
    counts = data.answer_token_counts(vocab_size)
    top = torch.argsort(counts, descending=True, stable=True)[:count]
    top = top[counts[top] > 0].sort().values
    return top, float(counts[top].sum() / counts.sum())


class Recipe:
    name = ""
    method = ""
    summary = ""  # one line: what it trains (the recipe page and docs/recipes.md show it)
    defaults: dict = {}
    feature_layers: tuple[int, ...] = ()  # the target's hidden states it reads (data.py)
    # Optimizer steps by default, sized for the demo set (128 conversations, 32 batches a
    # pass; about 20 passes for the heads): with the data, the heads train in about an hour
    # on 2 busy cores.
    default_steps = 600
    # The recipe's own options (its constructor's keywords) that train_drafter may set.
    options: tuple[str, ...] = ()

    @classmethod
    def options_for(cls, ks, options: dict | None) -> dict:
        """The options to train with for a protocol measuring the budgets ks (defaults a
        protocol implies filled in); raises ValueError for options it cannot measure."""
        return dict(options or {})

    def __init__(self, target: Llama, target_hf: dict):
        self.target, self.target_hf = target, target_hf
        for p in target.parameters():
            p.requires_grad_(False)

    vocab = None   # token ids of the training data's vocabulary (set_vocabulary)
    remap = None   # full id -> index in vocab

    def set_vocabulary(self, vocab_ids: torch.Tensor, data=None):
        self.vocab = vocab_ids
        self.remap = torch.full((self.target.config.vocab_size,), -1, dtype=torch.long)
        self.remap[vocab_ids] = torch.arange(len(vocab_ids))

    def logits(self, x, lm_head_weight):
        """Logits over the data's vocabulary (all of it when none is set)."""
        w = lm_head_weight if self.vocab is None else lm_head_weight[self.vocab]
        return F.linear(x, w)

    def labels(self, ids):
        return ids if self.remap is None else self.remap[ids]

    def target_logits(self, hidden):
        return self.logits(hidden, self.target.lm_head.weight)

    def describe(self) -> dict:
        return {}


class DraftModelRecipe(Recipe):
    name = method = "draft_model"
    default_steps = 300
    options = ("layers",)
    summary = ("a small Llama: the target's embeddings, first layers, final norm and lm_head, "
               "distilled on the target's next-token distributions")
    defaults = {"layers": 4, "lr": 5e-4, "batch_size": 4}

    def __init__(self, target, target_hf, layers: int = 4):
        super().__init__(target, target_hf)
        if not 1 <= layers < target.config.num_layers:
            raise ValueError(f"layers must be in 1..{target.config.num_layers - 1}, got {layers}")
        self.layers = layers
        cfg = LlamaConfig.from_hf({**target_hf, "num_hidden_layers": layers})
        self.module = Llama(cfg)
        state = {k: v for k, v in target.state_dict().items()
                 if not k.startswith("layers.") or int(k.split(".")[1]) < layers}
        self.module.load_state_dict(state, strict=True)
        if cfg.tie_word_embeddings:
            self.module.lm_head.weight = self.module.embed_tokens.weight
        self.module.embed_tokens.weight.requires_grad_(False)
        self.module.lm_head.weight.requires_grad_(False)

    def loss(self, batch):
        ids, hidden = batch["ids"], batch["hidden"]
        m = self.module
        positions = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
        cos, signed_sin = rope_tables(m.inv_freq, positions, torch.float32)
        x = m.embed_tokens(ids)
        for layer in m.layers:
            x, _ = layer_train(layer, x, cos, signed_sin)
        mask = _answer_mask(batch, ids.shape[1], 1)  # position p predicts t[p + 1]
        logits = self.logits(m.norm(x[mask]), m.lm_head.weight)
        with torch.no_grad():
            target = self.target_logits(hidden[mask])
        loss = _soft_cross_entropy(logits, target)
        agree = (logits.argmax(-1) == target.argmax(-1)).float().mean()
        return loss, {"top1": float(agree)}

    def save(self, out_dir: Path):
        out_dir.mkdir(parents=True, exist_ok=True)
        from safetensors.torch import save_file

        config = {**self.target_hf, "num_hidden_layers": self.layers,
                  "torch_dtype": str(SAVE_DTYPE).removeprefix("torch.")}
        config.pop("dtype", None)
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        weights = {f"model.{k}": v for k, v in self.module.state_dict().items()
                   if not k.startswith("lm_head.")}
        if not self.module.config.tie_word_embeddings:
            weights["lm_head.weight"] = self.module.lm_head.weight
        save_file({k: v.detach().to(SAVE_DTYPE).contiguous() for k, v in weights.items()},
                  str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    def describe(self):
        return {"layers": self.layers}


class EagleRecipe(Recipe):
    name = method = "eagle"
    summary = ("a one-layer EAGLE-1 head: from the target's hidden state and the next token it "
               "predicts the next hidden state (feature regression + token loss)")
    defaults = {"lr": 1e-3, "batch_size": 4, "unroll": 1}
    cls_weight = 0.1  # EAGLE-1's weight of the token loss next to the feature regression

    def __init__(self, target, target_hf, unroll: int = 1):
        super().__init__(target, target_hf)
        if not 1 <= unroll <= 8:
            raise ValueError(f"unroll must be in 1..8, got {unroll}")
        self.unroll = unroll
        self.module = EagleHead(LlamaConfig.from_hf({**target_hf, "num_hidden_layers": 1}))
        # Small output projections: the head starts close to passing its fused input on.
        for layer in self.module.layers:
            nn.init.normal_(layer.self_attn.o_proj.weight, std=0.02 / (2 * len(self.module.layers)) ** 0.5)
            nn.init.normal_(layer.mlp.down_proj.weight, std=0.02 / (2 * len(self.module.layers)) ** 0.5)

    def loss(self, batch):
        ids, hidden = batch["ids"], batch["hidden"]
        b, t = ids.shape
        width = t - 1  # head position p reads t[p + 1] and h[p], predicts h[p + 1]
        embeds = self.target.embed_tokens(ids[:, 1:])
        feats, goal = hidden[:, :-1], hidden[:, 1:]
        positions = torch.arange(width)[None].expand(b, -1)
        valid = _answer_mask(batch, width, 2)  # h[p + 1] predicts t[p + 2], an answer token
        total, first_reg, cls_acc = 0.0, None, None
        past = [[] for _ in self.module.layers]
        out = None
        for s in range(self.unroll):
            inputs, mask = (feats, None) if s == 0 else _unrolled_inputs(out, width, s)
            out, kvs = self.module.train_forward(embeds, inputs, positions, mask, past)
            for layer_past, kv in zip(past, kvs):
                layer_past.append(kv)
            step_valid = valid & (torch.arange(width)[None] >= s)
            pred, real = out[step_valid], goal[step_valid]
            reg = F.smooth_l1_loss(pred, real)
            with torch.no_grad():
                target_logits = self.target_logits(real)
            logits = self.logits(pred, self.target.lm_head.weight)
            cls = _soft_cross_entropy(logits, target_logits)
            total = total + reg + self.cls_weight * cls
            if s == 0:
                first_reg = float(reg.detach())
                cls_acc = float((logits.argmax(-1) == target_logits.argmax(-1)).float().mean())
        return total / self.unroll, {"reg": first_reg, "top1": cls_acc}

    def save(self, out_dir: Path):
        self.module.save(out_dir, self.target_hf, SAVE_DTYPE)

    def describe(self):
        return {"unroll": self.unroll}


class EagleMultistepRecipe(EagleRecipe):
    name = "eagle_multistep"
    method = "eagle"
    options = ("unroll",)  # and eagle's default steps: only the objective differs
    summary = ("the EAGLE head, data and loss, unrolled on its own predicted features as when "
               "drafting (training-time test): the same parameters for more compute")
    defaults = {"lr": 1e-3, "batch_size": 4, "unroll": 3}

    def __init__(self, target, target_hf, unroll: int = 3):
        if unroll < 2:
            raise ValueError("eagle_multistep unrolls at least 2 steps (use the eagle recipe for 1)")
        super().__init__(target, target_hf, unroll=unroll)


def _unrolled_inputs(out: torch.Tensor, width: int, s: int):
    """Inputs and attention mask of unrolled step s >= 1: at p, the head's own output of the
    previous step at p - 1 (its prediction made there) in place of the target's feature."""
    inputs = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)
    return inputs, _unrolled_mask(width, s)


def _unrolled_mask(width: int, s: int) -> torch.Tensor:
    """Visibility [width, (s + 1) * width] for step s over the keys of steps 0..s: the query
    at p sees step-0 (real) keys at q <= p - s and the step-j key at q = p - s + j, which is
    what the head attends to at its (s + 1)-th draft from a context ending at p - s."""
    p = torch.arange(width)[:, None]
    q = torch.arange(width)[None, :]
    blocks = [q <= p - s] + [q == p - s + j for j in range(1, s + 1)]
    return torch.cat(blocks, dim=1)


class MedusaRecipe(Recipe):
    name = method = "medusa"
    options = ("heads",)

    @classmethod
    def options_for(cls, ks, options: dict | None) -> dict:
        """Medusa heads propose one token each, so the protocol's largest k needs as many
        heads: the default is that many (3 at least); fewer is refused before any training."""
        options = dict(options or {})
        max_k, heads = max(ks), options.get("heads")
        if heads is None:
            options["heads"] = max(3, max_k)
        elif heads < max_k:
            raise ValueError(f"measures k up to {max_k}, but {heads} Medusa heads "
                             f"propose at most {heads} tokens: give --heads {max_k} or more")
        return options
    summary = ("Medusa heads, one residual block per drafted token, sharing the target's lm_head: "
               "head i predicts the token i + 2 places ahead from one hidden state")
    defaults = {"lr": 1e-3, "batch_size": 4, "heads": 3, "head_layers": 1}
    decay = 0.8  # Medusa-1's weight of head i: 0.8^i

    def __init__(self, target, target_hf, heads: int = 3, head_layers: int = 1):
        super().__init__(target, target_hf)
        if not 1 <= heads <= 8:
            raise ValueError(f"heads must be in 1..8, got {heads}")
        cfg = target.config
        self.module = MedusaHeads(cfg.hidden_size, cfg.vocab_size, heads, head_layers)
        self.module.lm_head.weight = nn.Parameter(target.lm_head.weight.detach().clone(),
                                                  requires_grad=False)
        for block in self.module.blocks:
            for layer in block.layers:
                nn.init.zeros_(layer.weight)

    def loss(self, batch):
        ids, hidden = batch["ids"], batch["hidden"]
        t = ids.shape[1]
        total, weights, top1 = 0.0, 0.0, None
        for i, block in enumerate(self.module.blocks):
            mask = _answer_mask(batch, t, 2 + i)  # head i at p proposes t[p + 2 + i]
            if not mask.any():
                continue
            logits = self.logits(block(hidden[mask]), self.module.lm_head.weight)
            labels = self.labels(ids[:, 2 + i:][mask[:, :t - 2 - i]])
            known = labels >= 0   # -1: a token the heads cannot draft (a reduced vocabulary)
            if not known.any():
                continue
            ce = F.cross_entropy(logits, labels, ignore_index=-1)
            total = total + self.decay ** i * ce
            weights += self.decay ** i
            if i == 0:
                top1 = float((logits.argmax(-1) == labels).float().mean())
        return total / max(weights, 1e-9), {"top1": top1 or 0.0}

    def save(self, out_dir: Path):
        self.module.save(out_dir, SAVE_DTYPE)

    def describe(self):
        return {"heads": self.module.num_heads, "head_layers": self.module.num_layers}


class MedusaReducedVocabRecipe(MedusaRecipe):
    """Medusa heads that draft over the ``draft_vocab`` most frequent answer tokens of the
    training data only (vLLM's ``truncated_vocab_size`` and ``token_map``): the lm_head
    product, most of a head's cost on this target (49152 x 576 per head and token), shrinks
    by the same factor. A label outside that vocabulary cannot be drafted and is left out
    of the loss; the share of answer tokens it covers is reported."""

    name = "medusa_reduced_vocab"
    method = "medusa"
    options = ("heads", "draft_vocab")
    summary = ("the Medusa heads drafting over the data's most frequent answer tokens only "
               "(vLLM's truncated vocabulary): a much cheaper lm_head per drafted token")
    defaults = {**MedusaRecipe.defaults, "draft_vocab": 4096}

    def __init__(self, target, target_hf, heads: int = 3, head_layers: int = 1,
                 draft_vocab: int = 4096):
        super().__init__(target, target_hf, heads=heads, head_layers=head_layers)
        if not 1 <= draft_vocab < target.config.vocab_size:
            raise ValueError(f"draft_vocab must be in 1..{target.config.vocab_size - 1}, "
                             f"got {draft_vocab}")
        self.draft_vocab = draft_vocab
        self.coverage = None

    def set_vocabulary(self, vocab_ids, data=None):
        top, self.coverage = frequent_answer_tokens(data, self.draft_vocab,
                                                    self.target.config.vocab_size)
        super().set_vocabulary(top)
        full = self.module.lm_head.weight.detach()
        self.module.token_map = top.clone()
        self.module.lm_head = nn.Linear(full.shape[1], len(top), bias=False)
        self.module.lm_head.weight = nn.Parameter(full[top].clone(), requires_grad=False)

    def logits(self, x, lm_head_weight):
        # The lm_head is already the draft vocabulary's rows (the data's own, in order).
        return F.linear(x, lm_head_weight)

    def describe(self):
        return {**super().describe(), "draft_vocab": len(self.module.token_map),
                "answer_token_coverage": round(self.coverage, 4)}


class Eagle3Recipe(Recipe):
    """EAGLE-3 as its paper trains it, at this project's scale: the head reads the target's
    low, middle and high layers (vLLM's default for Llama targets: after 2, L/2 and L - 3
    of L layers), predicts tokens only (no feature regression), drafts over the data's most
    frequent answer tokens with its own lm_head (started from those rows of the target's),
    and is unrolled on its own outputs (training-time test, the attention as in
    ``eagle_multistep``). Labels are the target's greedy tokens, which the answers are."""

    name = method = "eagle3"
    options = ("unroll", "draft_vocab")
    summary = ("an EAGLE-3 head: three of the target's layers fused, one decoder layer and its "
               "own lm_head over the data's most frequent answer tokens, trained on tokens, "
               "unrolled on its own outputs")
    defaults = {"lr": 1e-3, "batch_size": 4, "unroll": 2, "draft_vocab": 4096}

    def __init__(self, target, target_hf, unroll: int = 2, draft_vocab: int = 4096):
        super().__init__(target, target_hf)
        if not 1 <= unroll <= 8:
            raise ValueError(f"unroll must be in 1..8, got {unroll}")
        if not 1 <= draft_vocab <= target.config.vocab_size:
            raise ValueError(f"draft_vocab must be in 1..{target.config.vocab_size}, "
                             f"got {draft_vocab}")
        layers = target.config.num_layers
        self.feature_layers = (2, layers // 2, layers - 3)
        self.unroll, self.draft_vocab, self.coverage = unroll, draft_vocab, None
        config = LlamaConfig.from_hf({**target_hf, "num_hidden_layers": 1})
        self.module = Eagle3Head(config, self.feature_layers, torch.arange(draft_vocab))
        scale = 0.02 / 2 ** 0.5   # small output projections, as the EAGLE recipe
        nn.init.normal_(self.module.midlayer.self_attn.o_proj.weight, std=scale)
        nn.init.normal_(self.module.midlayer.mlp.down_proj.weight, std=scale)
        with torch.no_grad():
            self.module.norm.weight.copy_(target.norm.weight)

    def set_vocabulary(self, vocab_ids, data=None):
        top, self.coverage = frequent_answer_tokens(data, self.draft_vocab,
                                                    self.target.config.vocab_size)
        super().set_vocabulary(top)
        self.module.draft_ids = top.clone()
        self.module.lm_head = nn.Linear(self.target.config.hidden_size, len(top), bias=False)
        self.module.lm_head.weight = nn.Parameter(self.target.lm_head.weight.detach()[top].clone())

    def loss(self, batch):
        ids, feats = batch["ids"], batch["hidden"]
        b, t = ids.shape
        width = t - 1  # position p reads t[p + 1] and the target's layers at p
        head = self.module
        embeds = self.target.embed_tokens(ids[:, 1:])
        positions = torch.arange(width)[None].expand(b, -1)
        goal = torch.zeros(b, width, dtype=torch.long)
        goal[:, :width - 1] = ids[:, 2:]          # ... and proposes t[p + 2]
        labels = self.labels(goal)
        valid = _answer_mask(batch, width, 2)
        total, top1, past, out = 0.0, None, [], None
        for s in range(self.unroll):
            inputs, mask = (head.fc(feats[:, :-1]), None) if s == 0 else \
                _unrolled_inputs(out, width, s)
            out, kv = head.train_forward(embeds, inputs, positions, mask, past)
            past.append(kv)
            step = valid & (torch.arange(width)[None] >= s)
            if not step.any():
                break
            logits = head.logits(out[step])
            total = total + F.cross_entropy(logits, labels[step], ignore_index=-1)
            if s == 0:  # a label outside the draft vocabulary is a miss
                top1 = float((head.draft_ids[logits.argmax(-1)] == goal[step]).float().mean())
        return total / self.unroll, {"top1": top1 or 0.0}

    def save(self, out_dir: Path):
        self.module.save(out_dir, self.target_hf, SAVE_DTYPE)

    def describe(self):
        return {"unroll": self.unroll, "draft_vocab": len(self.module.draft_ids),
                "feature_layers": list(self.feature_layers),
                "answer_token_coverage": None if self.coverage is None else round(self.coverage, 4)}


RECIPES = {r.name: r for r in (DraftModelRecipe, EagleRecipe, EagleMultistepRecipe, MedusaRecipe,
                               MedusaReducedVocabRecipe, Eagle3Recipe)}

def build_recipe(name: str, target: Llama, target_hf: dict, **options):
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; known: {', '.join(sorted(RECIPES))}")
    cls = RECIPES[name]
    return cls(target, target_hf, **options)


def load_target(target_dir) -> tuple[Llama, dict]:
    target_dir = Path(target_dir)
    hf = json.loads((target_dir / "config.json").read_text())
    return Llama.from_pretrained(target_dir, torch.float32), hf
