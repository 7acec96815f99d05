"""The measurement protocol: a versioned, immutable spec whose canonical JSON is hashed.

Every result carries the sha256 of the protocol it was measured under. Two specs that differ
in anything that can change a figure (target weights, prompt sets, sampling, batch sizes,
speculation budgets, engine, hardware class) have different hashes.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

# How a prompt with several user turns is sent. Only the first turn is sent, through the
# target's chat template: later turns would need the model's own earlier answers, which
# differ between drafters only if the engine is not lossless, and would make the prompt
# depend on the run. This is written on the protocol page.
MULTI_TURN_FIRST_TURN = "first_turn"

# How a task's N prompts are chosen from its prompt set (part of the hash):
# - "first": the first N prompts of the task's categories (all when none), in file order (v1).
# - "stratified": taken in turn from each of the task's categories (in the order the task
#   lists them; in order of first appearance in the file when it lists none), in file order
#   within a category; a category that runs out is skipped. Every named category is measured.
SELECTIONS = ("first", "stratified")

# How a drafter cell's speedup is referenced (part of the hash):
# - "paired": every drafter run measures the baseline (k=0) cells itself, interleaved with
#   its own cells pass by pass, and divides by them.
# - "shared": one baseline run per protocol, engine version and hardware class (v1).
BASELINES = ("paired", "shared")


@dataclass(frozen=True)
class TaskSpec:
    """One task of a protocol: `prompts` prompts of a prompt set, optionally only those of
    some categories, chosen by `selection` (see SELECTIONS)."""

    task: str
    prompt_set: str
    prompt_set_sha256: str
    prompts: int
    categories: tuple[str, ...] = ()
    selection: str = "first"

    def __post_init__(self):
        if self.selection not in SELECTIONS:
            raise ValueError(f"invalid protocol: task {self.task!r}: selection must be one of "
                             f"{', '.join(SELECTIONS)}, not {self.selection!r}")
        if self.prompts < 1:
            raise ValueError(f"invalid protocol: task {self.task!r} needs at least one prompt")

    def to_dict(self):
        d = asdict(self)
        d["categories"] = list(self.categories)
        if self.selection == "first":   # v1 meaning: left out so v1 hashes do not change
            del d["selection"]
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
    baseline: str = "paired"
    max_drift: float = 0.05

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
        if self.baseline not in BASELINES:
            problems.append(f"baseline must be one of {', '.join(BASELINES)}, "
                            f"not {self.baseline!r}")
        if not (isinstance(self.max_drift, (int, float)) and 0 < self.max_drift < 1):
            problems.append("max_drift must be a fraction between 0 and 1")
        if self.batch_sizes and all(b >= 1 for b in self.batch_sizes):
            largest = max(self.batch_sizes)
            for t in self.tasks:
                if t.prompts < largest:
                    problems.append(f"task {t.task!r} has {t.prompts} prompts, fewer than the "
                                    f"largest batch size {largest}: its cells could not keep "
                                    f"{largest} requests in flight")
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
            # Left out when shared (the v1 meaning), so v1 hashes do not change.
            **({"baseline": self.baseline, "max_drift": float(self.max_drift)}
               if self.baseline != "shared" else {}),
        }

    @classmethod
    def from_dict(cls, d):
        d = dict(d)
        d["tasks"] = tuple(
            TaskSpec(**{**t, "categories": tuple(t.get("categories", ()))}) for t in d["tasks"]
        )
        d.setdefault("baseline", "shared")   # every v1 protocol
        if d["baseline"] == "shared":
            d.pop("max_drift", None)
        for key in ("batch_sizes", "ks"):
            if key in d:
                d[key] = tuple(d[key])
        if "temperatures" in d:   # floats, as to_dict writes them: 0 and 0.0 are one cell
            d["temperatures"] = tuple(float(t) for t in d["temperatures"])
        return cls(**d)

    @property
    def task_names(self) -> tuple[str, ...]:
        return tuple(t.task for t in self.tasks)

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

    def run_cells(self, method: str):
        """The cells a run of `method` measures: the baseline its k=0 cells; a drafter its k
        cells, and under a paired protocol also the k=0 cells it divides by."""
        if method == "baseline":
            return self.cells(with_drafter=False)
        if self.baseline == "paired":
            return sorted(self.cells(with_drafter=False) + self.cells(with_drafter=True),
                          key=self._cell_rank)
        return self.cells(with_drafter=True)

    def _cell_rank(self, cell):
        names = [t.task for t in self.tasks]
        return (names.index(cell.task), list(self.temperatures).index(cell.temperature),
                list(self.batch_sizes).index(cell.batch_size), [0, *self.ks].index(cell.k))


@dataclass(frozen=True, order=True)
class Cell:
    task: str
    batch_size: int
    temperature: float
    k: int

    @classmethod
    def of(cls, row, k: int | None = None) -> Cell:
        """The cell of a row that names one: a Cell, a mapping (a cell dict, a record, a
        values() row) or an object with the four attributes (a Result). `k` overrides the
        row's (0: the baseline cell at the same place)."""
        if isinstance(row, Cell) and k is None:
            return row
        get = row.__getitem__ if isinstance(row, Mapping) else (lambda name: getattr(row, name))
        return cls(get("task"), get("batch_size"), float(get("temperature")),
                   get("k") if k is None else k)

    @property
    def key(self):
        """(task, batch size, temperature, k): how a cell is named in sets and dicts."""
        return (self.task, self.batch_size, float(self.temperature), self.k)


def cell_key(row) -> tuple:
    """`Cell.key` of a row that names a cell (see `Cell.of`)."""
    return Cell.of(row).key


def parse_version(text: str) -> int | None:
    """A version written in ASCII digits ("3"), else None: ``str.isdigit()`` also accepts
    "²" and other digits that ``int()`` refuses (a 500 on ``?protocol=demo@²``)."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 9 else None


def canonical_json(data) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
