"""The reference engine: batched speculative decoding in plain torch.

The target runs on the compact Llama forward of worker/llama.py (a Hugging Face checkpoint
read directly), with a KV cache that rolls back rejected tokens by moving a per-sequence
length, and a decoding loop in which every sequence of the batch accepts its own number of drafted tokens
per step. Greedy output equals the target's own greedy output; sampling uses standard
speculative rejection sampling, so outputs follow the target's distribution. Every step is
traced per sequence (drafted tokens, accepted prefix, bonus token, time per phase).

Speed and the layout of a batch: see worker/llama.py.

Timing phases (seconds, time.perf_counter, contiguous so they add up to the wall time):
drafting (the proposer, draft-model prefill included), verification (every target forward,
the prefill of step 0 included), sampling (acceptance and rejection sampling), other
(batch assembly, bookkeeping, detokenisation, the on_step callback).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from worker.llama import DTYPES, Llama

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
