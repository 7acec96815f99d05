"""Proposers for the reference engine: one per method behind one small interface, as in
vLLM's ``v1/spec_decode``.

A proposer drafts tokens for the sequences of a batch; the engine verifies them against
the target. Interface:

- ``start(engine, batch_size, max_slots, temperature)`` before a generation (allocate
  state, forget the previous generation);
- ``propose(rows, contexts, num_tokens, generators) -> list[Draft]``: for each sequence
  still running (``rows`` are its indices in the batch, ``contexts`` its prompt and output
  so far), up to ``num_tokens`` drafted tokens. ``Draft.probs`` is the proposal
  distribution q over the target's vocabulary for each drafted token ([n, vocab]); None
  means the proposer is deterministic (q is one-hot), which rejection sampling handles.

A proposer learns what the target accepted from the next call's contexts, so there is no
separate commit call: a stateful proposer (the draft model) compares its cached tokens with
the new context and rolls back its own KV cache to their common prefix.

Proposers that read the target's hidden states set ``uses_hidden_states = True``; the
engine then computes them during verification and passes ``hidden_states=[...]`` to
``propose``: per sequence, [m, hidden] for the context positions the proposer has not been
given yet (the prompt at first, then the last token and the accepted drafts of each step).

Methods: ``ngram`` (prompt lookup), ``draft_model`` (a smaller Llama sharing the
tokenizer), ``eagle`` (an EAGLE-1 head) and ``medusa`` (Medusa heads), the last two in the
layouts of worker/heads.py. Each method's module in worker/methods names its proposer here;
``worker.methods.make_proposer`` builds one. EAGLE-3 (three fused hidden layers and a
d2t/t2d vocabulary map) and MTP (layers inside the target's own checkpoint) have none: the
vLLM engine measures them.
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from worker.llama import DTYPES, Llama
from worker.heads import EagleHead, MedusaHeads


class Draft(NamedTuple):
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), target vocab]; None: deterministic


def draft_token(logits, temperature, generator, probs: list) -> int:
    """One drafted token from a proposer's logits: the argmax at temperature 0, else a
    sample from q = softmax(logits / T), with q appended to ``probs`` for rejection
    sampling."""
    if temperature == 0:
        return int(logits.argmax())
    q = torch.softmax(logits / temperature, dim=-1)
    probs.append(q)
    return int(torch.multinomial(q, 1, generator=generator))


def draft_loop(todo, num_tokens, generators, temperature, first_logits, next_logits) -> dict:
    """The drafting loop of the autoregressive proposers: from each drafting sequence's
    logits, draft one token (draft_token), then run the next draft forward only for the
    sequences that want more: ``next_logits(live, keep, step)`` gets the sequences still
    drafting, their places in the previous step and the previous step's tokens, and
    returns their logits. Returns {sequence index: Draft} for ``todo``."""
    tokens = {i: [] for i in todo}
    probs = {i: [] for i in todo}
    live, logits = list(todo), first_logits
    while live:
        step = []
        for i, row_logits in zip(live, logits):
            token = draft_token(row_logits, temperature, generators[i], probs[i])
            tokens[i].append(token)
            step.append(token)
        keep = [j for j, i in enumerate(live) if len(tokens[i]) < num_tokens[i]]
        if not keep:
            break
        live = [live[j] for j in keep]
        logits = next_logits(live, keep, step)
    return {i: Draft(tokens[i], torch.stack(probs[i]) if probs[i] else None) for i in todo}


class NgramProposer:
    """Prompt lookup: find the longest n-gram (prompt_lookup_max down to prompt_lookup_min
    tokens) that ends the context and also occurs earlier in it, and propose the tokens that
    followed its earliest occurrence (as transformers' prompt lookup does). Deterministic.
    Both bounds are given: ``make_proposer`` fills them by n-gram's one rule
    (worker/methods/ngram.py ``lookup_bounds``)."""

    method = "ngram"

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.min_n, self.max_n = int(prompt_lookup_min), int(prompt_lookup_max)

    def start(self, engine, batch_size, max_slots, temperature):
        pass

    def propose(self, rows, contexts, num_tokens, generators):
        return [Draft(self.lookup(context, n) if n > 0 else []) for context, n in zip(contexts, num_tokens)]

    def lookup(self, context: list[int], num_tokens: int) -> list[int]:
        for n in range(min(self.max_n, len(context) - 1), self.min_n - 1, -1):
            suffix = context[-n:]
            # Occurrences that start before the suffix itself and leave a token to propose.
            for start in range(len(context) - n):
                if context[start:start + n] == suffix:
                    follow = context[start + n:start + n + num_tokens]
                    if follow:
                        return follow
        return []


class DraftModelProposer:
    """A smaller Llama sharing the target's tokenizer, drafting autoregressively with its own
    KV cache. Greedy at temperature 0; otherwise samples from q = softmax(logits / T) with
    the sequence's generator and returns q for rejection sampling."""

    method = "draft_model"

    def __init__(self, path, dtype: str = "float32", device: str = "cpu"):
        self.path = Path(path)
        self.model = Llama.from_pretrained(self.path, DTYPES[dtype], device)
        self.device = torch.device(device)
        self.cache = None

    def start(self, engine, batch_size, max_slots, temperature):
        self.target_vocab = engine.config.vocab_size
        self.temperature = temperature
        self.cache = self.model.new_cache(batch_size, max_slots + 1)
        self.cached_ids = [[] for _ in range(batch_size)]  # tokens whose KV the cache holds
        self.synced = [0] * batch_size  # a prefix known to equal the context (never drafts)

    def propose(self, rows, contexts, num_tokens, generators):
        drafts = [Draft([]) for _ in rows]
        todo = [i for i, n in enumerate(num_tokens) if n > 0]
        if not todo:
            return drafts
        # Catch up: roll the cache back to what it shares with the context (this drops
        # rejected drafts), then feed the rest (the bonus token, or the whole prompt at first).
        catch_up = []
        for i in todo:
            row, context = rows[i], contexts[i]
            common = self._common_prefix(row, context)
            self.cache.rollback(row, common)
            catch_up.append(context[common:])
            self.cached_ids[row] = list(context)
            self.synced[row] = len(context)
        row_index = torch.tensor([rows[i] for i in todo], device=self.device)
        last = torch.tensor([len(c) - 1 for c in catch_up], device=self.device)
        logits = self.model(_right_pad(catch_up, self.device), self.cache, rows=row_index,
                            logits_at=last[:, None])[:, 0]
        self.cache.lengths[row_index] += last + 1

        def next_logits(live, keep, step):
            row_index = torch.tensor([rows[i] for i in live], device=self.device)
            new_ids = torch.tensor([[step[j]] for j in keep], device=self.device)
            logits = self.model(new_ids, self.cache, rows=row_index)[:, 0]
            self.cache.lengths[row_index] += 1
            for i, j in zip(live, keep):
                self.cached_ids[rows[i]].append(step[j])
            return self._to_target_vocab(logits)

        drafted = draft_loop(todo, num_tokens, generators, self.temperature,
                             self._to_target_vocab(logits), next_logits)
        return [drafted.get(i, draft) for i, draft in enumerate(drafts)]

    def _common_prefix(self, row, context) -> int:
        cached, common = self.cached_ids[row], self.synced[row]
        while common < min(len(cached), len(context)) and cached[common] == context[common]:
            common += 1
        return min(common, len(context) - 1)  # keep one token to feed: it gives the logits

    def _to_target_vocab(self, logits):
        """Draft logits over the target's vocabulary (a draft vocabulary may be padded)."""
        vocab = self.target_vocab
        if logits.shape[-1] >= vocab:
            return logits[..., :vocab]
        pad = logits.new_full((*logits.shape[:-1], vocab - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], dim=-1)


class EagleProposer:
    """An EAGLE-1 head over the target's hidden states, drafting autoregressively with its
    own KV cache: the head's position p reads the target's hidden state at p and the token
    at p + 1; each draft step feeds the head's own output feature back. Positions are
    committed with the target's real hidden states only (drafted positions are overwritten
    at the next call), as vLLM does. Greedy at temperature 0; otherwise samples from
    q = softmax(logits / T) and returns q."""

    method = "eagle"
    uses_hidden_states = True

    def __init__(self, path, dtype: str = "float32", device: str = "cpu"):
        self.path = Path(path)
        self.head = EagleHead.from_pretrained(self.path, DTYPES[dtype], device)
        self.device = torch.device(device)

    def start(self, engine, batch_size, max_slots, temperature):
        target = engine.model
        if target.config.hidden_size != self.head.config.hidden_size:
            raise ValueError(f"the EAGLE head's hidden size {self.head.config.hidden_size} differs "
                             f"from the target's {target.config.hidden_size}")
        self.embed, self.logits = target.embed_tokens, target.logits  # shared, as in vLLM
        self.temperature = temperature
        self.cache = self.head.new_cache(batch_size, max_slots + 1)

    def propose(self, rows, contexts, num_tokens, generators, hidden_states=None):
        if hidden_states is None:
            raise ValueError("the EAGLE proposer needs the target's hidden states")
        dtype = self.head.fc.weight.dtype
        target_dtype = self.embed.weight.dtype
        drafts = [Draft([]) for _ in rows]
        # Commit the new positions: head position p reads token p + 1 and the target's h[p].
        row_index = torch.tensor(rows, device=self.device)
        starts = self.cache.lengths[row_index].tolist()
        new_tokens, new_feats = [], []
        for context, start, feats in zip(contexts, starts, hidden_states):
            if start + len(feats) != len(context) - 1:
                raise RuntimeError(f"EAGLE proposer out of step: {start} cached positions + "
                                   f"{len(feats)} new hidden states for a context of {len(context)}")
            new_tokens.append(context[start + 1:])
            new_feats.append(feats)
        width = max(len(t) for t in new_tokens)
        ids = _right_pad(new_tokens, self.device)
        feats = torch.zeros(len(rows), width, self.head.config.hidden_size, dtype=dtype, device=self.device)
        for i, f in enumerate(new_feats):
            feats[i, :len(f)] = f.to(dtype)
        out = self.head(self.embed(ids).to(dtype), feats, self.cache, rows=row_index)
        lengths = torch.tensor([len(t) for t in new_tokens], device=self.device)
        self.cache.lengths[row_index] += lengths
        committed = self.cache.lengths[row_index].clone()
        feature = out[torch.arange(len(rows)), lengths - 1]  # [R, hidden]: predicts token n
        todo = [i for i, n in enumerate(num_tokens) if n > 0]
        feature = feature[todo]

        def next_logits(live, keep, step):
            nonlocal feature
            sub = torch.tensor([rows[i] for i in live], device=self.device)
            ids = torch.tensor([[step[j]] for j in keep], device=self.device)
            out = self.head(self.embed(ids).to(dtype), feature[keep][:, None], self.cache, rows=sub)
            self.cache.lengths[sub] += 1
            feature = out[:, 0]
            return self.logits(feature.to(target_dtype))

        drafted = draft_loop(todo, num_tokens, generators, self.temperature,
                             self.logits(feature.to(target_dtype)) if todo else [], next_logits)
        self.cache.lengths[row_index] = committed  # drafted positions are never committed
        return [drafted.get(i, draft) for i, draft in enumerate(drafts)]


class MedusaProposer:
    """Medusa heads: from the target's hidden state at the last committed position (the one
    that gave the last emitted token), head i proposes the token i + 1 places after it.
    One forward of the heads per step, no state. Top-1 at temperature 0; otherwise each
    head's token is sampled from q = softmax(logits / T), returned for rejection sampling."""

    method = "medusa"
    uses_hidden_states = True

    def __init__(self, path, dtype: str = "float32", device: str = "cpu"):
        self.path = Path(path)
        self.heads = MedusaHeads.from_pretrained(self.path, DTYPES[dtype], device)
        self.device = torch.device(device)

    def start(self, engine, batch_size, max_slots, temperature):
        if engine.config.hidden_size != self.heads.hidden:
            raise ValueError(f"the Medusa heads' hidden size {self.heads.hidden} differs from "
                             f"the target's {engine.config.hidden_size}")
        self.temperature = temperature
        self.last = [None] * batch_size  # the newest hidden state of each sequence

    def propose(self, rows, contexts, num_tokens, generators, hidden_states=None):
        if hidden_states is None:
            raise ValueError("the Medusa proposer needs the target's hidden states")
        for row, feats in zip(rows, hidden_states):
            if len(feats):
                self.last[row] = feats[-1]
        drafts = [Draft([]) for _ in rows]
        todo = [i for i, n in enumerate(num_tokens) if n > 0]
        if not todo:
            return drafts
        dtype = self.heads.lm_head.weight.dtype
        logits = self.heads(torch.stack([self.last[rows[i]] for i in todo]).to(dtype)).float()
        heads = self.heads
        for j, i in enumerate(todo):
            n = min(num_tokens[i], heads.num_heads)
            if self.temperature == 0:
                drafts[i] = Draft(heads.target_ids(logits[j, :n].argmax(-1)).tolist())
            else:
                q = torch.softmax(logits[j, :n] / self.temperature, dim=-1)
                picked = torch.cat([torch.multinomial(q[h], 1, generator=generators[i])
                                    for h in range(n)])
                drafts[i] = Draft(heads.target_ids(picked).tolist(), heads.target_probs(q))
        return drafts


def _right_pad(rows, device, pad=0):
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [pad] * (width - len(r)) for r in rows], dtype=torch.long,
                        device=device)
