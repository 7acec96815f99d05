"""The measurement protocol: a versioned, immutable spec whose canonical JSON is hashed.

Every result carries the sha256 of the protocol it was measured under. Two specs that differ
in anything that can change a figure (target weights, prompt sets, sampling, batch sizes,
speculation budgets, engine, hardware class) have different hashes.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

# How a prompt with several user turns is sent. Only the first turn is sent, through the
# target's chat template: later turns would need the model's own earlier answers, which
# differ between drafters only if the engine is not lossless, and would make the prompt
# depend on the run. This is written on the protocol page.
MULTI_TURN_FIRST_TURN = "first_turn"


@dataclass(frozen=True)
class TaskSpec:
    """One task of a protocol: the first `prompts` prompts of a prompt set (by id),
    optionally only those of some categories."""

    task: str
    prompt_set: str
    prompt_set_sha256: str
    prompts: int
    categories: tuple[str, ...] = ()

    def to_dict(self):
        d = asdict(self)
        d["categories"] = list(self.categories)
        return d


@dataclass(frozen=True)
class ProtocolSpec:
    slug: str
    version: int
    target: str
    target_sha256: str
    engine: str
    hardware: str
    tasks: tuple[TaskSpec, ...]
    temperatures: tuple[float, ...] = (0.0,)
    max_new_tokens: int = 128
    seed: int = 0
    batch_sizes: tuple[int, ...] = (1, 4, 8)
    ks: tuple[int, ...] = (2, 4)
    warmup_requests: int = 2
    repetitions: int = 1
    chat_template: bool = True
    multi_turn: str = MULTI_TURN_FIRST_TURN
    engine_args: dict = field(default_factory=dict)

    def __post_init__(self):
        problems = []
        if not self.tasks:
            problems.append("at least one task is needed")
        if any(b < 1 for b in self.batch_sizes) or not self.batch_sizes:
            problems.append("batch sizes must be positive integers")
        if any(k < 1 for k in self.ks) or not self.ks:
            problems.append("speculation budgets k must be positive integers")
        if any(t < 0 for t in self.temperatures) or not self.temperatures:
            problems.append("temperatures must be >= 0")
        if self.max_new_tokens < 1:
            problems.append("max_new_tokens must be >= 1")
        if self.repetitions < 1:
            problems.append("repetitions must be >= 1")
        if len({t.task for t in self.tasks}) != len(self.tasks):
            problems.append("task names must be unique")
        if problems:
            raise ValueError("invalid protocol: " + "; ".join(problems))

    def to_dict(self):
        return {
            "slug": self.slug,
            "version": self.version,
            "target": self.target,
            "target_sha256": self.target_sha256,
            "engine": self.engine,
            "hardware": self.hardware,
            "tasks": [t.to_dict() for t in self.tasks],
            "temperatures": [float(t) for t in self.temperatures],
            "max_new_tokens": self.max_new_tokens,
            "seed": self.seed,
            "batch_sizes": list(self.batch_sizes),
            "ks": list(self.ks),
            "warmup_requests": self.warmup_requests,
            "repetitions": self.repetitions,
            "chat_template": self.chat_template,
            "multi_turn": self.multi_turn,
            "engine_args": dict(self.engine_args),
        }

    @classmethod
    def from_dict(cls, d):
        d = dict(d)
        d["tasks"] = tuple(
            TaskSpec(**{**t, "categories": tuple(t.get("categories", ()))}) for t in d["tasks"]
        )
        for key in ("temperatures", "batch_sizes", "ks"):
            if key in d:
                d[key] = tuple(d[key])
        return cls(**d)

    def canonical_json(self) -> str:
        return canonical_json(self.to_dict())

    def sha256(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    def cells(self, with_drafter: bool):
        """Every cell of the grid in measurement order: (task, batch size, temperature, k).
        The baseline (no drafter) has k = 0."""
        ks = self.ks if with_drafter else (0,)
        return [
            Cell(task.task, b, float(t), k)
            for task in self.tasks
            for t in self.temperatures
            for b in self.batch_sizes
            for k in ks
        ]


@dataclass(frozen=True, order=True)
class Cell:
    task: str
    batch_size: int
    temperature: float
    k: int

    @property
    def key(self):
        return (self.task, self.batch_size, float(self.temperature), self.k)


def canonical_json(data) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
