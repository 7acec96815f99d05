"""Prompt-set files: parsing and hashing. Formats:

- ``spec-bench``: JSON lines, ``question_id`` (int), ``category`` (str), ``turns`` (a list
  of user turns), optional ``reference``. The EAGLE prompt files have the same shape.
- ``mt-bench``: FastChat's ``question.jsonl``, the same shape as spec-bench.
- ``humaneval``: JSON lines (optionally gzipped), ``task_id``, ``prompt`` and the test
  fields; each becomes one single-turn prompt of category ``coding``.

A malformed file is refused as a whole with the line number and what is wrong.
"""
from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

FORMATS = ("spec-bench", "mt-bench", "humaneval")


class PromptFileError(ValueError):
    def __init__(self, path, line, message):
        self.path, self.line, self.message = str(path), line, message
        where = f"{self.path}, line {line}" if line else self.path
        super().__init__(f"{where}: {message}")


@dataclass
class ParsedPrompt:
    external_id: str
    category: str
    turns: list[str]
    reference: list | None = None
    extra: dict = field(default_factory=dict)


@dataclass
class ParsedPromptFile:
    path: str
    format: str
    sha256: str
    prompts: list[ParsedPrompt]

    def categories(self):
        out = {}
        for p in self.prompts:
            out[p.category] = out.get(p.category, 0) + 1
        return out


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_lines(path: Path):
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise PromptFileError(path, 0, f"not a readable gzip file ({e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise PromptFileError(path, line, "is not UTF-8 text") from None
    return text.splitlines()


def _records(path: Path):
    for number, line in enumerate(_read_lines(path), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptFileError(path, number, f"is not valid JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise PromptFileError(path, number, "must be a JSON object")
        yield number, record


def _parse_question(path, number, record):
    missing = [k for k in ("question_id", "category", "turns") if k not in record]
    if missing:
        raise PromptFileError(path, number, f"missing field(s) {', '.join(missing)}")
    qid = record["question_id"]
    if isinstance(qid, bool) or not isinstance(qid, (int, str)) or str(qid).strip() == "":
        raise PromptFileError(path, number, "question_id must be an integer or a non-empty string")
    if not isinstance(record["category"], str) or not record["category"].strip():
        raise PromptFileError(path, number, "category must be a non-empty string")
    turns = record["turns"]
    if not isinstance(turns, list) or not turns:
        raise PromptFileError(path, number, "turns must be a non-empty list of strings")
    for i, turn in enumerate(turns, start=1):
        if not isinstance(turn, str) or not turn.strip():
            raise PromptFileError(path, number, f"turn {i} must be a non-empty string")
    reference = record.get("reference")
    return ParsedPrompt(str(qid), record["category"].strip(), turns, reference)


def _parse_humaneval(path, number, record):
    for key in ("task_id", "prompt"):
        if not isinstance(record.get(key), str) or not record[key].strip():
            raise PromptFileError(path, number, f"{key} must be a non-empty string")
    extra = {k: record[k] for k in ("entry_point", "canonical_solution", "test") if k in record}
    return ParsedPrompt(record["task_id"], "coding", [record["prompt"]], None, extra)


def parse_prompt_file(path, fmt: str) -> ParsedPromptFile:
    path = Path(path)
    if fmt not in FORMATS:
        raise PromptFileError(path, 0, f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    if not path.is_file():
        raise PromptFileError(path, 0, "no such file")
    parse = _parse_humaneval if fmt == "humaneval" else _parse_question
    prompts, seen = [], {}
    for number, record in _records(path):
        prompt = parse(path, number, record)
        if prompt.external_id in seen:
            raise PromptFileError(
                path, number,
                f"duplicate id {prompt.external_id!r} (first on line {seen[prompt.external_id]})")
        seen[prompt.external_id] = number
        prompts.append(prompt)
    if not prompts:
        raise PromptFileError(path, 0, "holds no prompts")
    return ParsedPromptFile(str(path), fmt, file_sha256(path), prompts)


def sort_key(external_id: str):
    """Numeric ids sort as numbers, others (HumanEval/12) by their numeric tail."""
    tail = external_id.rsplit("/", 1)[-1]
    number = tail.isascii() and tail.isdigit()   # "²".isdigit() is true, int("²") fails
    return (0, int(tail), external_id) if number else (1, 0, external_id)


def select_task_prompts(prompts, categories, n: int, selection: str = "first") -> list:
    """The n prompts a task measures. ``prompts`` have ``.external_id`` and ``.category``
    and come in file order; ``categories`` are the task's (empty: every category).

    - ``first``: the first n prompts of those categories, in file order.
    - ``stratified``: taken in turn from each category (in the task's listed order, or in
      order of first appearance in the file when it lists none), in file order within a
      category; a category that runs out is skipped. With 10 prompts in each of 4 categories
      and n = 8, each category gives 2.

    Raises ValueError when fewer than n prompts qualify."""
    wanted = list(dict.fromkeys(categories or ()))
    pool = [p for p in prompts if not wanted or p.category in wanted]
    if len(pool) < n:
        raise ValueError(f"the task needs {n} prompts; the prompt set has {len(pool)}"
                         + (f" in categories {sorted(wanted)}" if wanted else ""))
    if selection == "first":
        return pool[:n]
    if selection != "stratified":
        raise ValueError(f"unknown prompt selection {selection!r}")
    by_category: dict[str, list] = {}
    for p in pool:
        by_category.setdefault(p.category, []).append(p)
    order = wanted or list(by_category)
    queues = [list(by_category.get(c, [])) for c in order]
    chosen = []
    while len(chosen) < n:
        for q in queues:
            if q and len(chosen) < n:
                chosen.append(q.pop(0))
    return chosen
