"""Shared training data: conversations written by the target itself, hashed and versioned.

Without a prompt corpus the target writes the user turns: it is given its chat template's
user prefix (the system turn and ``<|im_start|>user\\n`` for SmolLM2) and samples until it
closes the turn; it then answers that question (greedy by default, so the data are the
target's own greedy outputs, which is what a greedy evaluation verifies against). A user
with prompts passes them as JSON lines instead. Sampling is seeded per sequence, questions
are deduplicated on their normalised text, and no user turn may be an evaluation prompt:
``forbidden`` maps normalised-text hashes to a label naming the prompt.

The dataset file is JSON lines, one conversation a line: ``id``, ``source`` (generated /
file), ``user``, ``assistant``, ``input_ids`` (the chat-template prompt and the answer, as
the target saw them) and ``prompt_len`` (where the answer starts). Its sha256 is the
dataset's identity. The target's last hidden states (after the final norm) for every token
are derived once per target into ``features-<sha>.safetensors`` next to it: every recipe
trains from them (EAGLE and Medusa read them; distillation takes the target's logits from
them through the target's lm_head).
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.hostlock import HostLock
from worker.prompts import file_sha256

SENTINEL = "\u2063SPECBOARD-USER-TURN\u2063"


class TrainingDataError(ValueError):
    """Bad training input; the message says what and where."""


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", str(text)).strip().lower()


def text_sha256(text: str) -> str:
    """The hash evaluation prompts and training user turns are compared by."""
    return hashlib.sha256(normalise(text).encode("utf-8")).hexdigest()


def check_not_evaluation(texts, forbidden: dict, where: str = "") -> None:
    """Refuse the first text that is an evaluation prompt, naming both."""
    for i, text in enumerate(texts):
        label = forbidden.get(text_sha256(text))
        if label:
            short = normalise(text)[:80]
            raise TrainingDataError(
                f"{where}prompt {i + 1} (\u201c{short}\u201d) is the evaluation prompt {label}: "
                "evaluation prompts are never used for training; remove it")


def json_lines(lines, where):
    """(line number, value) of each non-empty line of an open JSON-lines file, parsed only
    when asked for (a reader that stops early never parses the rest); a line that is not
    JSON raises TrainingDataError naming `where` and the line."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except ValueError as e:
            raise TrainingDataError(f"{where}, line {number}: not JSON ({e})") from None


def read_prompts_file(path) -> list[str]:
    """User prompts from JSON lines: each line a JSON string, or an object with ``prompt``,
    ``text``, ``question`` or ``turns`` (the first turn, as in Spec-Bench files)."""
    path = Path(path)
    if not path.is_file():
        raise TrainingDataError(f"{path}: no such file")
    out = []
    with open(path, encoding="utf-8") as f:
        for number, value in json_lines(f, path):
            if isinstance(value, dict):
                for key in ("prompt", "text", "question"):
                    if isinstance(value.get(key), str):
                        value = value[key]
                        break
                else:
                    turns = value.get("turns")
                    if isinstance(turns, list) and turns and isinstance(turns[0], str):
                        value = turns[0]
            if not isinstance(value, str) or not value.strip():
                raise TrainingDataError(f"{path}, line {number}: expected a non-empty string or an "
                                        "object with a prompt, text, question or turns field")
            out.append(value)
    if not out:
        raise TrainingDataError(f"{path}: no prompts")
    return out


def user_prefix_ids(tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user's text starts."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False)
    if SENTINEL not in text:
        raise TrainingDataError("the target's chat template does not show the user's text")
    return tokenizer.encode(text.split(SENTINEL)[0], add_special_tokens=False)


@dataclass
class GenerationSettings:
    n: int
    seed: int = 0
    max_question_tokens: int = 48
    max_answer_tokens: int = 192
    question_temperature: float = 1.0
    answer_temperature: float = 0.0
    batch_size: int = 16
    engine: str = "reference"   # which engine wrote it: "vllm" or "reference"
    # Openings of the user turn the target continues into its questions, taken in turn
    # (attempt i starts with question_starts[i % len]); none: it writes them from nothing.
    question_starts: tuple[str, ...] = ()

    def to_dict(self):
        d = dict(self.__dict__)
        # Left out when unused, so generations written before starts existed keep their key.
        if d["question_starts"]:
            d["question_starts"] = list(d["question_starts"])
        else:
            del d["question_starts"]
        return d


def generate_conversations(engine, settings: GenerationSettings, prompts=None, forbidden=None,
                           progress=None, checkpoint=None) -> tuple[list[dict], dict]:
    """Conversations of the target (any engine with ``encode_chat``, ``decode`` and a batch
    ``generate``: the reference engine or ``vllm_writer.VllmWriter``): its own questions,
    or ``prompts``, each answered by it. Returns (records, stats).

    Work goes in rounds of ``batch_size`` conversations: questions are sampled until the
    round is full, then answered together. With ``checkpoint`` (a folder) every finished
    round is appended there, and a later call with the same settings continues after the
    last one, so a long generation that is stopped loses at most one round. A larger ``n``
    with the same settings continues there too, and a smaller one takes the first ``n``:
    datasets of several sizes are then prefixes of one generation."""
    forbidden = forbidden or {}
    if engine.tokenizer is None:
        raise TrainingDataError(f"{engine.path} has no tokenizer: the target writes text")
    if prompts is not None:
        check_not_evaluation(prompts, forbidden)
    if prompts is not None and settings.question_starts:
        raise TrainingDataError("question starts are for questions the target writes; "
                                "prompts are answered as they are")
    source = "generated" if prompts is None else "file"
    with contextlib.ExitStack() as writing:
        if checkpoint is not None and kept_conversations(checkpoint) < settings.n:
            # This call appends rounds: one generation at a time per folder; a second one
            # waits, then continues from what the first left.
            writing.enter_context(generation_lock(checkpoint, f"generation of {settings.n} conversations"))
        state = _Progress.open(checkpoint, settings, source)
        return _generate(engine, settings, prompts, forbidden, progress, state, source)


def generation_lock(folder, what: str) -> HostLock:
    """The lock of a rounds folder (``writer.lock``): whoever appends rounds to it, or
    puts the shipped rounds into it, holds it; reads do not take it."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    return HostLock(Path(folder) / "writer.lock", log=lambda m: print(m, file=sys.stderr),
                    what=what, name="generation lock")


def kept_conversations(folder) -> int:
    """How many conversations a rounds folder holds, by its state (0 when it has none)."""
    meta = Path(folder) / "state.json"
    return json.loads(meta.read_text())["records"] if meta.is_file() else 0


def _generate(engine, settings, prompts, forbidden, progress, state, source):
    if prompts is not None:  # deduplicated in order; the rounds walk through them
        unique, keys = [], set()
        for text in prompts:
            key = text_sha256(text)
            if key in keys:
                continue
            keys.add(key)
            unique.append(text)
        state.stats["duplicates"] = len(prompts) - len(unique)
        prompts = unique[:settings.n]
    target_n = settings.n if prompts is None else len(prompts)
    started = time.monotonic() - state.stats.get("seconds", 0.0)
    while len(state.records) < target_n:
        want = min(settings.batch_size, target_n - len(state.records))
        if prompts is None:
            questions = _sample_questions(engine, settings, want, forbidden, state, progress)
        else:
            questions = prompts[len(state.records):len(state.records) + want]
        ids = [engine.encode_chat(q) for q in questions]
        results = engine.generate(ids, max_new_tokens=settings.max_answer_tokens,
                                  temperature=settings.answer_temperature,
                                  seed=settings.seed * 1_000_003 + 500_000 + len(state.records))
        rows = [{"id": len(state.records) + i, "source": source, "user": q,
                 "assistant": engine.decode(r.output_ids),
                 "input_ids": prompt_ids + list(r.output_ids), "prompt_len": len(prompt_ids),
                 "finish_reason": r.finish_reason}
                for i, (q, prompt_ids, r) in enumerate(zip(questions, ids, results))]
        state.stats["seconds"] = round(time.monotonic() - started, 1)
        state.add_round(rows)
        if progress:
            progress(("answers", len(state.records), target_n))
    stats = dict(state.stats, seconds=round(time.monotonic() - started, 1))
    stats["tokens"] = sum(len(r["input_ids"]) for r in state.records)
    stats["answer_tokens"] = sum(len(r["input_ids"]) - r["prompt_len"] for r in state.records)
    stats["answer_tokens_per_s"] = round(stats["answer_tokens"] / max(stats["seconds"], 1e-9), 1)
    return state.records, stats


class _Progress:
    """The records and counters of a generation, kept in a checkpoint folder when given:
    ``rounds.jsonl`` (the records, appended a round at a time) and ``state.json``
    (settings, the next question attempt, counters), written after the records."""

    def __init__(self, folder, settings, source):
        self.folder = Path(folder) if folder else None
        # n is left out: a larger n continues a smaller one's rounds, so datasets of
        # several sizes from one folder are prefixes of each other (a learning curve).
        self.settings = {k: v for k, v in settings.to_dict().items() if k != "n"}
        self.n = settings.n
        self.source = source
        self.records: list[dict] = []
        self.seen: set[str] = set()
        self.attempt = 0
        self.stats = {"questions_sampled": 0, "duplicates": 0, "unfinished": 0,
                      "evaluation_prompts": 0, "resumed_at": None}

    @classmethod
    def open(cls, folder, settings, source):
        """The generation kept in ``folder``. Writes only when this call will append (it
        then holds the generation lock); a smaller size only reads."""
        state = cls(folder, settings, source)
        if state.folder is None:
            return state
        state.folder.mkdir(parents=True, exist_ok=True)
        meta = state.folder / "state.json"
        if not meta.is_file():
            (state.folder / "rounds.jsonl").unlink(missing_ok=True)
            return state
        saved = json.loads(meta.read_text())
        if saved.get("settings") != state.settings or saved.get("source") != source:
            raise TrainingDataError(
                f"{state.folder} holds a generation with other settings ({saved.get('settings')}); "
                "remove it or use the same settings")
        # Only the rows the state counts: lines after them are a round written after the
        # last state, stopped in between (done again) or being appended by another
        # generation now (maybe half a line). Only a call that holds the generation lock and
        # will append cuts them from the file; a read never writes.
        path = state.folder / "rounds.jsonl"
        with open(path, encoding="utf-8") as f:
            rows = [row for _, row in itertools.islice(json_lines(f, path), saved["records"])]
            beyond = bool(f.readline())
        if beyond and state.n > len(rows):
            write_dataset(rows, state.folder / "rounds.jsonl")
        state.stats.update(saved["stats"], resumed_at=len(rows))
        state.attempt = saved["attempt"]
        if len(rows) > state.n:
            # A smaller dataset from a larger generation: its first n conversations. The
            # counters describe the whole generation, so they are not kept.
            rows = rows[:state.n]
            share = state.n / saved["records"]
            state.stats = {"prefix_of": saved["records"], "resumed_at": len(rows),
                           "seconds": round(saved["stats"].get("seconds", 0.0) * share, 1),
                           "seconds_prorated": True}
            state.folder = None   # read only: nothing of this call is appended
        state.records = rows
        state.seen = {text_sha256(r["user"]) for r in rows}
        return state

    def add_round(self, rows):
        self.records.extend(rows)
        if self.folder is None:
            return
        with open(self.folder / "rounds.jsonl", "a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        tmp = self.folder / "state.json.part"
        tmp.write_text(json.dumps({"settings": self.settings, "source": self.source,
                                   "records": len(self.records), "attempt": self.attempt,
                                   "stats": self.stats}))
        tmp.replace(self.folder / "state.json")


def _sample_questions(engine, settings, want, forbidden, state, progress) -> list[str]:
    """``want`` new distinct finished questions, continuing the seeded attempts."""
    prefix = user_prefix_ids(engine.tokenizer)
    starts = list(settings.question_starts) or [""]
    start_ids = [engine.tokenizer.encode(t, add_special_tokens=False) for t in starts]
    stats, questions = state.stats, []
    batch = settings.batch_size
    max_attempts = 20 * settings.n + 4 * batch  # a target that cannot write questions stops here
    while len(questions) < want:
        if state.attempt >= max_attempts:
            raise TrainingDataError(
                f"the target wrote only {len(state.records) + len(questions)} distinct finished "
                f"questions in {state.attempt} attempts (duplicates {stats['duplicates']}, "
                f"unfinished {stats['unfinished']}); ask for fewer (--n) or pass --prompts FILE")
        # Sequence i samples from seed + i, so attempt numbers give reproducible questions.
        begun = [(state.attempt + i) % len(starts) for i in range(batch)]
        results = engine.generate([prefix + start_ids[j] for j in begun],
                                  max_new_tokens=settings.max_question_tokens,
                                  temperature=settings.question_temperature,
                                  seed=settings.seed * 1_000_003 + state.attempt)
        state.attempt += batch
        for j, r in zip(begun, results):
            stats["questions_sampled"] += 1
            text = (starts[j] + r.text).strip()
            if r.finish_reason != "eos" or len(r.text.strip()) < 8:
                stats["unfinished"] += 1
                continue
            key = text_sha256(text)
            if key in forbidden:  # never train on an evaluation prompt, even one it wrote
                stats["evaluation_prompts"] += 1
                continue
            if key in state.seen:
                stats["duplicates"] += 1
                continue
            state.seen.add(key)
            questions.append(text)
            if len(questions) == want:
                break
        if progress:
            progress(("questions", len(state.records) + len(questions), settings.n))
    return questions


def write_dataset(records, path) -> str:
    """Write the JSON-lines file; returns its sha256."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n")
    tmp.rename(path)
    return file_sha256(path)


def read_dataset(path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise TrainingDataError(f"{path}: the training data file is missing")
    records = []
    with open(path, encoding="utf-8") as f:
        for number, r in json_lines(f, path):
            try:
                ids, prompt_len = r["input_ids"], r["prompt_len"]
            except (KeyError, TypeError):
                raise TrainingDataError(f"{path}, line {number}: not a training record "
                                        "(input_ids and prompt_len)") from None
            if not (isinstance(ids, list) and 0 < prompt_len < len(ids)):
                raise TrainingDataError(f"{path}, line {number}: needs a prompt and an answer")
            records.append(r)
    if not records:
        raise TrainingDataError(f"{path}: no conversations")
    return records


def mix_conversations(parts: list[tuple[str, list[dict]]], forbidden=None) -> tuple[list[dict], dict]:
    """One dataset of several: ``parts`` are (name, records) of one target. They are
    interleaved in proportion (part p's j-th conversation sits at (j + 1/2) / len(p)), so
    every prefix of the mix, and its last N held out by ``--heldout``, holds each part's
    share. A conversation whose user turn an earlier one has is dropped, and so is an
    evaluation prompt (a prompt set may have come after the part was written). Each record
    keeps its fields, with ``id`` its place in the mix and ``mixed_from`` "NAME #ID"."""
    forbidden = forbidden or {}
    if len(parts) < 2:
        raise TrainingDataError("a mix needs at least two datasets")
    order = sorted(((j + 0.5) / len(records), p, j)
                   for p, (_, records) in enumerate(parts) for j in range(len(records)))
    seen, out = set(), []
    stats = {"parts": [{"name": name, "n": len(records)} for name, records in parts],
             "duplicates": 0, "evaluation_prompts": 0}
    for _, p, j in order:
        name, record = parts[p][0], parts[p][1][j]
        key = text_sha256(record.get("user") or json.dumps(record["input_ids"][:record["prompt_len"]]))
        if key in forbidden:
            stats["evaluation_prompts"] += 1
            continue
        if key in seen:
            stats["duplicates"] += 1
            continue
        seen.add(key)
        out.append(dict(record, id=len(out), mixed_from=f"{name} #{record.get('id', j)}"))
    # All tokens are the stored row's own count; the answer tokens are what a drafter learns.
    stats["answer_tokens"] = sum(len(r["input_ids"]) - r["prompt_len"] for r in out)
    return out, stats


@dataclass
class TrainingData:
    """Token ids and the target's hidden states of every conversation, in memory."""

    sha256: str
    ids: list[torch.Tensor]       # [T] long, per conversation
    prompt_lens: list[int]
    hidden: torch.Tensor          # [all tokens, hidden] (bfloat16 on disk and here)
    offsets: list[int]            # conversation i is hidden[offsets[i]:offsets[i+1]]
    user_texts: list[str]

    def __len__(self):
        return len(self.ids)

    @property
    def tokens(self):
        return self.offsets[-1] - self.offsets[0]

    def split(self, heldout: int) -> tuple["TrainingData", "TrainingData"]:
        """(the first n - heldout conversations, the last heldout), sharing the hidden states:
        the held-out part is never trained on, so a drafter's figures on it are on unseen
        conversations of the same distribution."""
        if not 0 < heldout < len(self):
            raise TrainingDataError(f"cannot hold out {heldout} of {len(self)} conversations")
        cut = len(self) - heldout

        def part(a, b):
            return TrainingData(self.sha256, self.ids[a:b], self.prompt_lens[a:b], self.hidden,
                                self.offsets[a:b + 1], self.user_texts[a:b])
        return part(0, cut), part(cut, len(self))

    def answer_token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token id occurs in the answers (what drafters propose)."""
        answers = torch.cat([ids[p:] for ids, p in zip(self.ids, self.prompt_lens)])
        return torch.bincount(answers, minlength=vocab_size)

    def vocabulary(self) -> torch.Tensor:
        """The token ids that occur in the data, sorted."""
        return torch.unique(torch.cat(self.ids))

    def batch(self, indices):
        """Right-padded ids [B, T], hidden [B, T, H] float32, lengths and prompt lengths."""
        lengths = [len(self.ids[i]) for i in indices]
        width = max(lengths)
        ids = torch.zeros(len(indices), width, dtype=torch.long)
        hidden = torch.zeros(len(indices), width, self.hidden.shape[1])
        for row, i in enumerate(indices):
            ids[row, :lengths[row]] = self.ids[i]
            hidden[row, :lengths[row]] = self.hidden[self.offsets[i]:self.offsets[i + 1]].float()
        return {"ids": ids, "hidden": hidden, "lengths": torch.tensor(lengths),
                "prompt_lens": torch.tensor([self.prompt_lens[i] for i in indices])}


def features_path(dataset_path: Path, target_sha256: str, layers: tuple[int, ...] = ()) -> Path:
    which = "-layers-" + "-".join(map(str, layers)) if layers else ""
    return Path(dataset_path).with_name(f"features-{target_sha256[:16]}{which}.safetensors")


def load_training_data(dataset_path, target_model, target_sha256: str, batch_size: int = 8,
                       progress=None, layers: tuple[int, ...] = ()) -> TrainingData:
    """The dataset with the target's hidden states, computed once and cached next to it:
    the last ones (after the final norm), or with ``layers`` the residual stream after
    each of those numbers of layers, concatenated (an EAGLE-3 head's input)."""
    from safetensors.torch import load_file, save_file

    dataset_path = Path(dataset_path)
    sha = file_sha256(dataset_path)
    records = read_dataset(dataset_path)
    ids = [torch.tensor(r["input_ids"], dtype=torch.long) for r in records]
    cache = features_path(dataset_path, target_sha256, layers)
    hidden = None
    if cache.is_file():
        stored = load_file(str(cache))
        meta_ok = stored.get("dataset_sha256") is not None and bytes(
            stored["dataset_sha256"].tolist()).decode() == sha
        if meta_ok and stored["hidden"].shape[0] == sum(len(t) for t in ids):
            hidden = stored["hidden"]
    if hidden is None:
        hidden = compute_hidden_states(target_model, ids, batch_size, progress, layers)
        tmp = cache.with_suffix(".part")
        save_file({"hidden": hidden.contiguous(),
                   "dataset_sha256": torch.tensor(list(sha.encode()), dtype=torch.uint8)}, str(tmp))
        tmp.rename(cache)
    offsets = [0]
    for t in ids:
        offsets.append(offsets[-1] + len(t))
    return TrainingData(sha, ids, [r["prompt_len"] for r in records], hidden, offsets,
                        [r.get("user", "") for r in records])


@torch.no_grad()
def compute_hidden_states(model, ids, batch_size=8, progress=None,
                          layers: tuple[int, ...] = ()) -> torch.Tensor:
    """The target's last hidden states (after the final norm) for every token, bfloat16; with
    ``layers``, its residual stream after those numbers of layers, concatenated."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths pad less
    out = [None] * len(ids)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        width = max(len(ids[i]) for i in chunk)
        batch = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, i in enumerate(chunk):
            batch[row, :len(ids[i])] = ids[i]
        cache = model.new_cache(len(chunk), width)
        _, hidden = model(batch, cache, logits_at=torch.zeros(len(chunk), 1, dtype=torch.long),
                          return_hidden=True, hidden_layers=tuple(layers))
        for row, i in enumerate(chunk):
            out[i] = hidden[row, :len(ids[i])].to(torch.bfloat16)
        if progress:
            progress(("features", min(start + batch_size, len(order)), len(order)))
    return torch.cat(out)
