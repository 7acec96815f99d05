"""The measurement protocol: a versioned, immutable spec whose canonical JSON is hashed.

Every result carries the sha256 of the protocol it was measured under. Two specs that differ
in anything that can change a figure (target weights, prompt sets, sampling, batch sizes,
speculation budgets, engine, hardware class) have different hashes.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace

# An engine version a protocol may pin: a release number, optionally with a local or
# pre-release tail ("0.31.0", "0.9.2rc1", "0.32.0+cpu"); it names a Celery queue too.
_VERSION_RE = re.compile(r"[0-9]+(\.[0-9]+){1,3}([a-z0-9.+-]{0,20})?")

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

# Loaded passes measured again per group when the protocol does not say
# (``max_loaded_remeasures``): two keeps a run's worst case near twice a group's passes while
# a contention burst of a few minutes is waited out (worker.measure).
DEFAULT_LOADED_REMEASURES = 2

# Keys added in version 3 of the format (adaptive passes, prompts per batch size), left out
# of the canonical JSON when unset so that older protocols' hashes do not change.
V3_KEYS = ("target_half_width", "max_repetitions", "cell_time_budget_s",
           "max_loaded_remeasures", "prompts_by_batch_size")

# Keys that may differ between protocol versions of one family (see ProtocolSpec.family_sha256):
# the version itself and the engine version it pins. Anything else changes what is measured.
FAMILY_FREE_KEYS = ("version", "engine_version")


def engine_queue(hardware: str, engine: str, engine_version: str | None) -> str:
    """The Celery queue that measures runs of this (hardware class, engine, engine version):
    the hardware class itself when no version is pinned (the deployment's default engine
    serves it), else e.g. ``cpu.vllm-0.31.0``. One rule: the site sends runs here and a
    worker consumes the queues of what its environment holds (leaderboard.queues)."""
    if not engine_version:
        return hardware
    return f"{hardware}.{engine}-{engine_version}"


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
    # Version 3 (each left out of the JSON when unset):
    # - adaptive passes: after ``repetitions`` passes (the minimum) a group keeps measuring
    #   passes until every drafter cell's speedup half-width (relative to the speedup; a
    #   baseline cell's throughput half-width) is at most ``target_half_width``, or the group
    #   has measured ``max_repetitions`` passes, or another pass would overrun
    #   ``cell_time_budget_s`` seconds of the group's passes (worker.measure.stop_reason).
    #   Unset target: ``repetitions`` passes exactly, as before.
    target_half_width: float | None = None
    max_repetitions: int | None = None
    cell_time_budget_s: float | None = None
    # - a pass measured while the host was loaded is measured again, at most this many
    #   times per group (DEFAULT_LOADED_REMEASURES when unset).
    max_loaded_remeasures: int | None = None
    # - {batch size: prompts}: the cells at that batch size measure only the first N of each
    #   task's prompts (a prefix of a stratified selection is stratified too). A prompt
    #   costs a request latency per pass at batch size 1 and about 1/b of one at b, so
    #   a protocol can take many prompts where they are cheap. Unset batch sizes: all.
    prompts_by_batch_size: dict = field(default_factory=dict)
    # The engine version the protocol pins (e.g. "0.31.0", the engine package's version):
    # its runs go to that version's queue (engine_queue). Unset (every protocol before
    # engine versions, left out of the JSON so their hashes do not change): the deployment's
    # default engine measures it and each run records the version it used.
    engine_version: str | None = None
    # Version 4 (left out of the JSON when unset): each cell's passes are split over this
    # many engine starts. The run measures every group once per start, in rounds, and
    # shuts down and starts every engine afresh between rounds (worker.measure), so what an
    # engine start fixes for its whole life (memory placement, thread and cache layout)
    # varies inside the run, and its interval and calibration see it, instead of being one
    # draw per run that only reruns reveal. ``repetitions``, ``max_repetitions`` and
    # ``cell_time_budget_s`` count a cell's passes and seconds over all its starts and are
    # split evenly between them (``per_start``). Unset: one start (every earlier version).
    engine_starts: int | None = None
    # Version 5 (left out of the JSON when unset): the engines of a group take turns of this
    # many seconds inside every group-pass (time slices), instead of measuring each cell's
    # whole pass in turn. Every cell's pass is sent at once; one engine computes while the
    # others are paused with their requests kept (vLLM's pause_generation, mode "keep"),
    # so each engine keeps b requests in flight and never drains between turns. A slowdown
    # of the machine that lasts longer than a few turns (another tenant of the host) then
    # falls on the baseline and the drafters alike and cancels in their ratio, where whole
    # passes (a minute each) caught it on one side. A cell's wall time, and each request's
    # latency and TTFT, count only its engine's turns (worker.cell.sliced_group_pass).
    # Unset: whole passes (every earlier version).
    interleave_s: float | None = None
    # Version 6 (left out of the JSON when unset; needs interleave_s): fair turns. Each turn
    # goes to the engine whose pass has made the fewest tokens so far (ties: the group's
    # order), so the group's passes end together instead of the slowest drafter computing
    # alone at the end; and an engine out of its turn is frozen (SIGSTOP on its engine core
    # processes after vLLM paused it) so that it takes no time from the core the engine in
    # its turn computes on (vLLM's engine core busy-polls its input queue for 1 s after its
    # last step). Every turn then measures its engine in the same conditions: the others
    # still, on the same machine. docs/measurement.md, "Fair turns".
    fair_turns: bool | None = None

    def __post_init__(self):
        problems = []
        version = self.engine_version
        if version is not None and not (isinstance(version, str)
                                        and _VERSION_RE.fullmatch(version)):
            problems.append(f"engine_version must be a release such as 0.31.0, not "
                            f"{self.engine_version!r}")
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
        problems += self._v3_problems()
        if self.batch_sizes and all(b >= 1 for b in self.batch_sizes):
            largest = max(self.batch_sizes)
            for t in self.tasks:
                if t.prompts < largest:
                    problems.append(f"task {t.task!r} has {t.prompts} prompts, fewer than the "
                                    f"largest batch size {largest}: its cells could not keep "
                                    f"{largest} requests in flight")
                    continue
                for b, cap in sorted(self.prompts_by_batch_size.items()):
                    if isinstance(cap, int) and self.cell_prompts(t, b) < b:
                        problems.append(f"task {t.task!r} has {self.cell_prompts(t, b)} "
                                        f"prompts at batch size {b} (prompts_by_batch_size): "
                                        f"its cells could not keep {b} requests in flight")
        if problems:
            raise ValueError("invalid protocol: " + "; ".join(problems))

    def _v3_problems(self) -> list[str]:
        problems = []
        t = self.target_half_width
        if t is not None and not (isinstance(t, (int, float)) and 0 < t < 1):
            problems.append("target_half_width must be a fraction between 0 and 1")
        if self.max_repetitions is not None and self.max_repetitions < self.repetitions:
            problems.append("max_repetitions must be at least repetitions")
        if self.cell_time_budget_s is not None and not self.cell_time_budget_s > 0:
            problems.append("cell_time_budget_s must be positive")
        if t is not None and self.max_repetitions is None and self.cell_time_budget_s is None:
            problems.append("a target_half_width needs max_repetitions or cell_time_budget_s "
                            "(a target the prompts cannot reach would measure forever)")
        if self.max_loaded_remeasures is not None and self.max_loaded_remeasures < 0:
            problems.append("max_loaded_remeasures must be >= 0")
        m = self.engine_starts
        if m is not None and not (isinstance(m, int) and not isinstance(m, bool) and m >= 1):
            problems.append("engine_starts must be a positive integer")
        elif m is not None and self.repetitions < m:
            problems.append(f"repetitions ({self.repetitions}) must be at least engine_starts "
                            f"({m}): every engine start measures at least one pass")
        turn = self.interleave_s
        if turn is not None and (isinstance(turn, bool) or not isinstance(turn, (int, float))
                                 or not 0 < turn <= 600):
            problems.append("interleave_s must be a number of seconds above 0, at most 600")
        if self.fair_turns is not None and not isinstance(self.fair_turns, bool):
            problems.append("fair_turns must be true or false")
        elif self.fair_turns and not self.interleave_s:
            problems.append("fair_turns needs interleave_s (turns are time slices)")
        for b, n in self.prompts_by_batch_size.items():
            if b not in self.batch_sizes:
                problems.append(f"prompts_by_batch_size names batch size {b}, not one of the "
                                f"protocol's")
            elif not (isinstance(n, int) and n >= 1):
                problems.append(f"prompts_by_batch_size[{b}] must be a positive integer")
        return problems

    @property
    def loaded_remeasure_limit(self) -> int:
        """Loaded passes a group measures again at most (DEFAULT_LOADED_REMEASURES unset)."""
        return (DEFAULT_LOADED_REMEASURES if self.max_loaded_remeasures is None
                else self.max_loaded_remeasures)

    @property
    def adaptive(self) -> bool:
        return self.target_half_width is not None

    @property
    def starts(self) -> int:
        """The engine starts each cell's passes are split over (1 when unset)."""
        return self.engine_starts or 1

    def per_start(self) -> ProtocolSpec:
        """The pass limits one engine start's round applies (``engine_starts``): the
        minimum and maximum passes and the time budget divided by the starts, the minimum
        and maximum rounded up (so the rounds together measure at least ``repetitions``).
        The spec itself with one start."""
        m = self.starts
        if m == 1:
            return self
        return replace(
            self, engine_starts=None, repetitions=-(-self.repetitions // m),
            max_repetitions=(None if self.max_repetitions is None
                             else max(-(-self.max_repetitions // m), -(-self.repetitions // m))),
            cell_time_budget_s=(None if self.cell_time_budget_s is None
                                else self.cell_time_budget_s / m))

    def cell_prompts(self, task, batch_size: int) -> int:
        """How many of `task`'s prompts (a TaskSpec or its name) the cells at `batch_size`
        measure: the first N of the task's selection (``prompts_by_batch_size``)."""
        if not isinstance(task, TaskSpec):
            task = next(t for t in self.tasks if t.task == task)
        cap = self.prompts_by_batch_size.get(batch_size)
        return task.prompts if cap is None else min(task.prompts, cap)

    def _v3_dict(self) -> dict:
        out = {key: getattr(self, key) for key in V3_KEYS[:4] if getattr(self, key) is not None}
        if "target_half_width" in out:
            out["target_half_width"] = float(out["target_half_width"])
        if "cell_time_budget_s" in out:
            out["cell_time_budget_s"] = float(out["cell_time_budget_s"])
        if self.prompts_by_batch_size:
            out["prompts_by_batch_size"] = {str(b): n for b, n in
                                            sorted(self.prompts_by_batch_size.items())}
        return out

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
            # Version 3: only the keys set (see V3_KEYS).
            **self._v3_dict(),
            **({"engine_version": self.engine_version} if self.engine_version else {}),
            # Version 4: only when set.
            **({"engine_starts": self.engine_starts} if self.engine_starts else {}),
            # Version 5: only when set.
            **({"interleave_s": float(self.interleave_s)} if self.interleave_s else {}),
            # Version 6: only when set.
            **({"fair_turns": True} if self.fair_turns else {}),
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
        if d.get("prompts_by_batch_size") is not None:   # JSON keys are strings
            d["prompts_by_batch_size"] = {int(b): n for b, n in
                                          d["prompts_by_batch_size"].items()}
        else:
            d.pop("prompts_by_batch_size", None)
        return cls(**d)

    @property
    def queue(self) -> str:
        """The Celery queue its runs go to (engine_queue)."""
        return engine_queue(self.hardware, self.engine, self.engine_version)

    def family_sha256(self) -> str:
        """The hash of everything but FAMILY_FREE_KEYS: protocol versions with one family
        hash measure the same thing (target, prompts, sampling, batch sizes, k, passes) and
        differ only by the engine version they pin, so a drafter's figures under them form
        its history across engine versions."""
        d = {k: v for k, v in self.to_dict().items() if k not in FAMILY_FREE_KEYS}
        return hashlib.sha256(canonical_json(d).encode()).hexdigest()

    def with_engine_version(self, engine_version: str, version: int) -> ProtocolSpec:
        """This spec pinned to another engine version, as protocol version `version`."""
        return ProtocolSpec.from_dict({**self.to_dict(), "engine_version": engine_version,
                                       "version": version})

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
