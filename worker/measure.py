"""Measure a drafter (or the baseline) under a protocol on vLLM: the cells of the grid
(task x temperature x batch size x k), each with the figures of worker.metrics, the output
tokens and the raw per-request records. Measuring one cell pass and a cell's figures is
worker.cell; this module is the run: engines, the order of passes, resuming, the CLI.

How a run is measured
- One engine per speculation budget k (vLLM fixes num_speculative_tokens when it builds the
  engine); the baseline has one engine (k = 0). ``spec.warmup_requests`` requests, not
  counted, follow each engine start.
- Repetitions are *passes*: pass r of a cell sends every prompt of its task once, with at
  most b requests in flight (b = batch size, a client-side concurrency limit over one engine,
  as ``vllm bench serve --max-concurrency b``). A cell's figures sum over its passes. A
  protocol's ``prompts_by_batch_size`` gives the cells of a batch size only the first N of
  the task's prompts (where a prompt is expensive: batch size 1).
- Loaded passes are measured again (``measure_group``): a group-pass in which any cell's
  pass was loaded (worker.hostload: others on the machine or on the engine's cores) is
  measured again whole, with the same repetition index, up to the protocol's
  ``loaded_remeasure_limit`` per group; the loaded one is dropped from the figures and
  counted (``remeasured_passes``).
- Adaptive passes (a protocol with ``target_half_width``): after ``repetitions`` passes a
  group measures more until its half-widths reach the target, its time budget would be
  overrun or ``max_repetitions`` is reached (``stop_reason``; the cells record which in
  ``passes_stop``). Without a target: exactly ``repetitions`` passes ("fixed").
- A *group* is the cells that share (task, temperature, batch size) and are measured side by
  side. Under a paired protocol a drafter run's group is the baseline cell (k = 0) and one
  cell per k: for each pass r, the baseline's pass r, then each k's pass r, so drift and
  load hit both sides; every engine (baseline + one per k) stays alive for the whole run.
  Otherwise (the baseline's own run, or a drafter under a shared baseline) a group is one
  cell, measured with all its passes on its k's engine; engines are started k by k, as in
  protocol v1. ``measurement_order`` gives the cells in the order they are yielded.
- Time slices (a protocol with ``interleave_s``, version 5): a group-pass sends every cell's
  pass at once and its engines compute in turns of that many seconds, the others paused
  with their requests kept (worker.cell.sliced_group_pass); a cell's times count its
  engine's turns only. A slowdown of the machine lasting more than a few turns then falls
  on every side of the ratio, and no engine drains between turns. With ``fair_turns``
  (version 6) each turn goes to the engine behind in tokens and the others are frozen, so
  a group's passes end together and every turn has its core to itself.
- A group's cells are yielded when its last pass ends (baseline first). On resume a group
  with any cell not in ``job.skip`` is measured again whole and all its cells are yielded
  (a drafter cell always divides by the baseline passes measured beside it).
- Order (``measurement_groups_for``): the *first comparison* comes first, then the rest in
  grid order (task, temperature, batch size). The first comparison is the first task and
  temperature at the largest batch size: its passes are the shortest of the run (every
  prompt of a task goes in flight b at a time, so a pass lasts about prompts / b request
  latencies), so a newcomer's leaderboard gets a complete paired comparison (baseline and
  every k, every pass) minutes after the worker starts. Only the order changes: every cell
  keeps all its passes and its pairing.
- Prompts: only the first user turn is sent (protocol multi_turn "first_turn"), through the
  target's chat template when ``spec.chat_template``; the token ids are sent to the engine.
- Sampling: temperature T, max_tokens = spec.max_new_tokens, the target's EOS ids stop a
  request. At T > 0 each request has its own seed, derived from spec.seed, the prompt id
  and the pass (so a cell is reproducible and the same prompt gets the same seed at every
  batch size and k). At T = 0 decoding is greedy and no seed is needed.
- With ``host_lock_path`` the run holds the host lock (worker.hostlock) for the whole
  measurement; each pass samples the host's other load (worker.hostload).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator

from worker.cell import (FIGURE_KEYS, CellResult, PromptItem, cell_result,  # noqa: F401
                         measure_pass, pass_records, request_seed, request_spec_counts,
                         run_concurrent, sliced_group_pass)
from worker.methods import (check_supported, drafter_engine_args, speculative_config,
                            synthetic_acceptance_config, validate_drafter_files)
from worker.protocol import MULTI_TURN_FIRST_TURN, Cell, ProtocolSpec, cell_key


@dataclass
class DrafterSpec:
    method: str        # baseline, ngram, draft_model, eagle, eagle3, medusa, mtp
    path: str | None = None
    params: dict = field(default_factory=dict)


@dataclass
class MeasureJob:
    spec: ProtocolSpec
    target_path: str
    drafter: DrafterSpec
    prompts: dict[str, list[PromptItem]]   # task name -> the protocol's prompts
    skip: frozenset = frozenset()          # Cell.key tuples already measured
    # vLLM's synthetic acceptance at this mean AL for every k (a calibration of the
    # break-even map, GPU only: worker.methods.synthetic_acceptance_config)
    synthetic_acceptance_length: float | None = None
    # The protocol's between-run variance of the log-speedup (the site's newest
    # ProtocolCalibration; None before one): adaptive passes stop on the interval the
    # leaderboard ranks by (group_half_widths).
    between_run_variance: float | None = None


# --------------------------------------------------------------------------- engine info

def is_paired(job) -> bool:
    """A drafter run under a paired protocol measures its own baseline cells."""
    return job.drafter.method != "baseline" and job.spec.baseline == "paired"


def _speculative_configs(job) -> dict:
    """Speculative config per engine k (None: the baseline engine, k = 0)."""
    if job.drafter.method == "baseline":
        return {0: None}
    configs = {k: speculative_config(job.drafter, k) for k in job.spec.ks}
    if job.synthetic_acceptance_length is not None:
        configs = {k: synthetic_acceptance_config(c, job.synthetic_acceptance_length,
                                                  job.spec.hardware)
                   for k, c in configs.items()}
    return {0: None, **configs} if is_paired(job) else configs


def engine_info(job) -> dict:
    """What the run records about its engine, without starting it."""
    from worker.engines import vllm_engine as ve

    versions = ve.package_versions()
    return {
        "engine": ve.ENGINE_NAME,
        "engine_version": versions["vllm"],
        "versions": versions,
        "hardware_description": ve.hardware_description(job.spec.hardware),
        "engine_args": ve.resolve_engine_args(job.spec, job.target_path),
        "engine_env": ve.engine_env(job.spec.hardware),
        # What the drafter's engines take on top of engine_args (worker/methods).
        "drafter_engine_args": drafter_engine_args(job.drafter),
        "speculative_configs": {str(k): v for k, v in _speculative_configs(job).items()},
        "per_request_spec_decode_metrics": "none" if job.drafter.method == "baseline"
        else "detailed",
        "baseline": "paired" if is_paired(job) else
        ("own" if job.drafter.method == "baseline" else "shared"),
    }


def first_comparison(spec: ProtocolSpec) -> tuple:
    """(task, temperature, batch size) of the cells a run measures first: the protocol's
    first task and temperature at its largest batch size, the shortest passes of the run
    (see the module docstring)."""
    return (spec.tasks[0].task, float(spec.temperatures[0]), max(spec.batch_sizes))


def measurement_groups_for(spec: ProtocolSpec, method: str,
                           skip=frozenset()) -> list[list[Cell]]:
    """The groups of cells a run of `method` ("baseline" for the baseline) measures side by
    side, in order: the first comparison's group first, then grid order (under an unpaired
    protocol a group is one cell, and the cells go k by k, one engine at a time, the first
    comparison's cell first within each k). A group whose cells are all in `skip` is left
    out. The run (``measurement_groups``) and the site (what a run measures next) both
    call this."""
    first = first_comparison(spec)

    def is_later(cell):
        return (cell.task, float(cell.temperature), cell.batch_size) != first

    if method != "baseline" and spec.baseline == "paired":
        groups = {}
        for cell in spec.run_cells(method):
            groups.setdefault((cell.task, cell.temperature, cell.batch_size), []).append(cell)
        ordered = sorted(groups.values(), key=lambda g: is_later(g[0]))  # stable sort
        return [cells for cells in ordered if any(c.key not in skip for c in cells)]
    with_drafter = method != "baseline"
    cells = [c for c in spec.cells(with_drafter=with_drafter) if c.key not in skip]
    ks = list(spec.ks) if with_drafter else [0]
    return [[c] for c in sorted(cells, key=lambda c: (ks.index(c.k), is_later(c)))]


def measurement_groups(job) -> list[list[Cell]]:
    """The groups of cells iter_cells measures side by side, in order (see the module
    docstring); a group whose cells are all in ``job.skip`` is left out."""
    return measurement_groups_for(job.spec, job.drafter.method, job.skip)


def measurement_order(job) -> list[Cell]:
    """The cells iter_cells measures, in the order it yields them (skipped cells left out,
    except those of a group that is measured again whole)."""
    return [c for group in measurement_groups(job) for c in group]


# --------------------------------------------------------------------------- prompts

def load_tokenizer(target_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(target_path))


def render_prompt(tokenizer, item: PromptItem, chat_template: bool) -> list[int]:
    """Token ids of a prompt's first user turn, through the chat template if asked."""
    turn = item.turns[0]
    if chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the protocol applies the chat template, but the target's "
                             "tokenizer has none")
        text = tokenizer.apply_chat_template([{"role": "user", "content": turn}],
                                             add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(turn)["input_ids"])


def eos_token_ids(tokenizer, target_path) -> set[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = Path(target_path) / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(int(v) for v in (value if isinstance(value, list) else [value])
                   if v is not None)
    return ids


async def _warm_up(engine, spec, prompt_ids: list[list[int]], tag: str):
    if spec.warmup_requests <= 0 or not prompt_ids:
        return
    requests = [(prompt_ids[i % len(prompt_ids)],
                 {"temperature": 0.0, "max_tokens": spec.max_new_tokens, "n": 1},
                 f"warmup|{tag}|{i}") for i in range(spec.warmup_requests)]
    await run_concurrent(engine, requests, max(spec.batch_sizes))


# --------------------------------------------------------------------------- the run

def validate_job(job: MeasureJob):
    spec = job.spec
    if spec.engine != "vllm":
        raise ValueError(f"this worker measures with vllm; the protocol asks for {spec.engine!r}")
    if spec.multi_turn != MULTI_TURN_FIRST_TURN:
        raise ValueError(f"multi_turn {spec.multi_turn!r} is not supported "
                         f"(only {MULTI_TURN_FIRST_TURN!r})")
    check_supported(job.drafter.method, spec.hardware)
    _speculative_configs(job)          # parameter errors before anything starts
    validate_drafter_files(job.drafter)
    for task in spec.tasks:
        items = job.prompts.get(task.task)
        if not items:
            raise ValueError(f"no prompts for task {task.task!r}")
        for item in items:
            if not item.turns:
                raise ValueError(f"prompt {item.id!r} of task {task.task!r} has no turns")


class _Engines:
    """The run's engines by k: started on demand, shut down when no longer needed. With a
    pool (worker.engines.pool, the test suite's) they are taken from it and given back
    instead, except after a failure."""

    def __init__(self, job, info, loop, warm_ids, log, pool=None):
        from worker.engines.vllm_engine import VllmEngine

        self._cls, self.job, self.loop, self.log = VllmEngine, job, loop, log
        self.pool = pool
        self.configs = _speculative_configs(job)
        self.args, self.warm_ids = info["engine_args"], warm_ids
        self.drafter_args = info["drafter_engine_args"]
        self.alive: dict = {}

    def _start(self, args, config):
        if self.pool is not None:
            engine, reused = self.pool.take(args, config, self.job.spec.hardware)
            return engine, reused
        engine = self._cls(args, config, self.job.spec.hardware)
        try:
            self.loop.run_until_complete(engine.start())
        except BaseException:
            engine.shutdown()
            raise
        return engine, False

    def _release(self, engine, failed=False):
        if self.pool is not None and not failed:
            self.pool.give_back(engine)
        else:
            engine.shutdown()

    def need(self, ks):
        for k in [k for k in self.alive if k not in ks]:
            self._release(self.alive.pop(k))
        for k in ks:
            if k in self.alive:
                continue
            spec = self.job.spec
            what = f"{self.job.drafter.method} k={k}" if k else "the baseline"
            self.log(f"starting vLLM for {what} ...")
            t0 = time.monotonic()
            args = {**self.args, **self.drafter_args} if k else self.args
            engine, reused = self._start(args, self.configs[k])
            self.alive[k] = engine
            self.loop.run_until_complete(_warm_up(engine, spec, self.warm_ids, f"k{k}"))
            self.log(f"engine ready in {time.monotonic() - t0:.0f} s "
                     f"({spec.warmup_requests} warm-up requests done"
                     f"{'; a pooled engine, already running' if reused else ''})")
        return self.alive

    def shutdown(self, failed=False, fresh=False):
        """Shut every engine down (a pool's are given back, unless the run ``failed``).
        ``fresh``: before the next engine start of a run (ProtocolSpec.engine_starts), so a
        pool's are shut down too and ``need`` starts new ones."""
        while self.alive:
            _, engine = self.alive.popitem()
            try:
                self._release(engine, failed or fresh)
            except Exception as e:  # noqa: BLE001 - do not hide the original error
                self.log(f"engine shutdown failed: {e}")


def _sampler(hardware: str):
    """A pass's host-load sampler. On a CPU class the engine computes on the CPU, so
    every core it may use counts as its own when it pins none (worker.hostload)."""
    from worker.hostload import HostLoadSampler
    from worker.methods import is_cpu_hardware

    return HostLoadSampler(all_cores_when_unpinned=is_cpu_hardware(hardware))


def iter_cells(job: MeasureJob, log=print, host_lock_path=None,
               engine_pool=None) -> Iterator[CellResult | dict]:
    """Yield {"type": "started", **engine_info(job)}, then one CellResult per measured cell
    (measurement_order(job)). Owns the engines: shut down when done, on an exception, or
    when the generator is closed; with ``engine_pool`` (worker.engines.pool.EnginePool: the
    test suite's, never a site worker's) taken from it and given back when done. With
    ``host_lock_path`` holds worker.hostlock.HostLock for the whole measurement."""
    validate_job(job)
    info = engine_info(job)
    yield {"type": "started", **info}
    groups = measurement_groups(job)
    with contextlib.ExitStack() as lock:
        if host_lock_path:
            from worker.hostlock import HostLock

            lock.enter_context(HostLock(host_lock_path, log=log))
        if groups:
            yield from _measure_groups(job, info, groups, log, engine_pool)


# --------------------------------------------------------------------------- a group's passes

def relative_half_width(point, low, high) -> float | None:
    """The larger half-width of an interval relative to its point (what the leaderboard
    shows as ``± x``); None without an interval."""
    if point is None or low is None or high is None or not point:
        return None
    return max(high - point, point - low) / abs(point)


def group_half_widths(records: dict, between_run_variance: float | None = None
                      ) -> list[float | None]:
    """Relative half-widths a group is judged by, from each cell's records so far
    ({Cell: [records]}): every drafter cell's speedup over the group's baseline cell, by
    the interval the leaderboard ranks by (the site's services.runs.speedup_with_interval):
    with the protocol's ``between_run_variance`` (calibrated) the rerun interval
    (worker.calibration.rerun_interval: the passes with the prompts held fixed, plus the
    variance), else the interval across prompts (worker.intervals.speedup_interval). A
    group without both (a baseline run, a drafter under a shared baseline) is judged by
    its cells' throughput intervals."""
    from worker import calibration, intervals

    base = next((recs for cell, recs in records.items() if cell.k == 0), None)
    drafters = [recs for cell, recs in records.items() if cell.k > 0]
    if base is not None and drafters and between_run_variance is not None:
        widths = []
        for recs in drafters:
            d_thr, b_thr = intervals.throughput(recs), intervals.throughput(base)
            point = d_thr / b_thr if d_thr and b_thr else None
            widths.append(relative_half_width(point, *calibration.rerun_interval(
                point, intervals.speedup_passes_standard_error(recs, base),
                between_run_variance)))
        return widths
    if base is not None and drafters:
        return [relative_half_width(*intervals.speedup_interval(recs, base))
                for recs in drafters]
    return [relative_half_width(intervals.throughput(recs), *intervals.throughput_interval(recs))
            for recs in records.values()]


def stop_reason(spec: ProtocolSpec, passes: int, elapsed_s: float, next_pass_s: float,
                half_widths=None) -> str | None:
    """Why a group stops after `passes` kept passes (None: measure another):
    - fewer than ``spec.repetitions``: never (the minimum);
    - no ``target_half_width``: "fixed" (exactly ``repetitions`` passes);
    - every half-width at most the target: "target" (a None half-width -- no interval yet --
      has not reached it);
    - ``max_repetitions`` passes measured: "max";
    - another pass (``next_pass_s``, the mean of the group's passes so far) would take
      the group's ``elapsed_s`` over ``cell_time_budget_s``: "budget"."""
    if passes < spec.repetitions:
        return None
    if not spec.adaptive:
        return "fixed"
    widths = list(half_widths or [])
    if widths and all(w is not None and w <= spec.target_half_width for w in widths):
        return "target"
    if spec.max_repetitions is not None and passes >= spec.max_repetitions:
        return "max"
    if (spec.cell_time_budget_s is not None
            and elapsed_s + next_pass_s > spec.cell_time_budget_s):
        return "budget"
    return None


@dataclass
class GroupPasses:
    passes: dict          # Cell -> [PassResult] kept (repetitions 0..n-1, in order)
    remeasured: dict      # Cell -> [PassResult] dropped because the host was loaded
    stop: str             # stop_reason's answer


def _group_name(group) -> str:
    c = group[0]
    ks = ", ".join(f"k={x.k}" if x.k else "baseline" for x in group)
    return f"{c.task} b={c.batch_size} T={c.temperature:g} ({ks})"


def measure_group(group: list[Cell], spec: ProtocolSpec, measure, records_of, log=print,
                  clock=time.monotonic, between_run_variance: float | None = None,
                  earlier: GroupPasses | None = None, measure_together=None) -> GroupPasses:
    """The passes of one group. ``measure(cell, repetition) -> PassResult`` measures one
    pass; ``records_of(cell, pass) -> [records]`` gives its per-request records.
    ``measure_together(group, repetition) -> {cell: PassResult}``, when given, measures a
    group-pass instead, its cells' passes side by side (time slices: interleave_s).

    A group-pass is pass r of every cell of the group, in the group's order. When any of
    its passes was loaded (``PassResult.loaded``: worker.hostload), the whole group-pass is
    measured again with the same repetition index r -- the pairing of the cells' passes
    stays -- and the loaded one is dropped from the figures (kept in ``remeasured``), at
    most ``spec.loaded_remeasure_limit`` times per group; past that a loaded group-pass is
    kept (its cells stay ``loaded``). Then ``stop_reason`` decides whether to measure
    another pass (adaptive passes: the half-widths are computed only when it may stop on
    them, by ``group_half_widths`` with the protocol's ``between_run_variance``).

    ``earlier``: the group's passes from earlier engine starts (ProtocolSpec.engine_starts;
    ``spec`` is then the start's ``per_start`` limits). They are kept, this start's passes
    continue their repetition indices, the half-widths judge all of them together, and the
    minimum, maximum, time budget and remeasure limit count this start's passes only."""
    passes = {cell: list(earlier.passes[cell]) if earlier else [] for cell in group}
    remeasured = {cell: list(earlier.remeasured[cell]) if earlier else [] for cell in group}
    records = {cell: [r for p in passes[cell] for r in records_of(cell, p)]
                     if spec.adaptive else [] for cell in group}
    first = len(passes[group[0]])
    limit = spec.loaded_remeasure_limit
    again, kept_s, t0 = 0, [], clock()
    while True:
        rep, t_pass = len(passes[group[0]]), clock()
        results = (measure_together(group, rep) if measure_together else
                   {cell: measure(cell, rep) for cell in group})
        loaded = [(cell, p) for cell, p in results.items() if p.loaded]
        if loaded and again < limit:
            again += 1
            detail = "; ".join(
                f"k={c.k}: others {p.host_load or 0:.2f} cores on the machine"
                + (f", {p.engine_core_load:.2f} on the engine's cores {list(p.engine_cores)}"
                   if p.engine_core_load is not None else "") for c, p in loaded)
            log(f"pass {rep + 1} of {_group_name(group)} was loaded ({detail}): measuring it "
                f"again ({again} of at most {limit} for this group)")
            for cell, p in results.items():
                remeasured[cell].append(p)
            continue
        for cell, p in results.items():
            passes[cell].append(p)
            if spec.adaptive:   # only an adaptive group judges its records as it goes
                records[cell] += records_of(cell, p)
        kept_s.append(clock() - t_pass)
        n = rep + 1 - first
        widths = (group_half_widths(records, between_run_variance)
                  if spec.adaptive and n >= spec.repetitions else None)
        stop = stop_reason(spec, n, clock() - t0, sum(kept_s) / len(kept_s), widths)
        if stop:
            if spec.adaptive:
                shown = ", ".join("-" if w is None else f"{w:.1%}" for w in widths or [])
                log(f"{_group_name(group)}: {rep + 1} passes, half-widths {shown} "
                    f"(stopped: {stop})")
            return GroupPasses(passes, remeasured, stop)


def _measure_groups(job, info, groups, log, pool=None):

    spec = job.spec
    tokenizer = load_tokenizer(job.target_path)
    eos_ids = eos_token_ids(tokenizer, job.target_path)
    prompt_ids = {task: {item.id: render_prompt(tokenizer, item, spec.chat_template)
                         for item in items} for task, items in job.prompts.items()}
    warm_ids = [ids for task in spec.tasks for ids in prompt_ids[task.task].values()]
    prefix_caching = bool(info["engine_args"].get("enable_prefix_caching"))

    def cell_prompts(cell):
        """The cell's prompts: the first N of its task's (spec.prompts_by_batch_size)."""
        return job.prompts[cell.task][:spec.cell_prompts(cell.task, cell.batch_size)]

    # A pool's engines serve from the pool's loop, which outlives this measurement.
    loop = pool.loop if pool is not None else asyncio.new_event_loop()
    starts, per_start = spec.starts, spec.per_start()
    total, done, t_start = sum(len(g) for g in groups) * starts, 0, time.monotonic()
    earlier: dict = {}      # group index -> GroupPasses of the earlier engine starts
    engines, failed = None, True
    try:
        engines = _Engines(job, info, loop, warm_ids, log, pool)
        for start in range(starts):
            if start:
                log(f"engine start {start + 1} of {starts}: starting every engine afresh")
                engines.shutdown(fresh=True)
            for index, group in enumerate(groups):
                alive = engines.need(sorted(_speculative_configs(job)) if is_paired(job)
                                     else [group[0].k])

                def one_pass(cell, rep, alive=alive):
                    return measure_pass(alive[cell.k], cell, spec, cell_prompts(cell),
                                        prompt_ids[cell.task], rep, cell.k > 0,
                                        _sampler(spec.hardware))

                def measure(cell, rep, start=start):
                    return replace(loop.run_until_complete(one_pass(cell, rep)),
                                   engine_start=start)

                def sliced(cells, rep, alive=alive, start=start):
                    passes = loop.run_until_complete(sliced_group_pass(
                        cells, {c: alive[c.k] for c in cells}, lambda c: one_pass(c, rep),
                        spec.interleave_s, fair=bool(spec.fair_turns)))
                    return {c: replace(p, engine_start=start) for c, p in passes.items()}

                measured = earlier[index] = measure_group(
                    group, per_start, measure,
                    lambda cell, p: pass_records(cell, p, eos_ids, cell.k > 0), log,
                    between_run_variance=job.between_run_variance,
                    earlier=earlier.get(index),
                    measure_together=sliced if spec.interleave_s and len(group) > 1 else None)
                for cell in group:
                    engine = alive[cell.k]
                    actual = getattr(engine, "prefix_caching", None)
                    result = cell_result(cell, measured.passes[cell], eos_ids, cell.k > 0,
                                         prefix_caching if actual is None else actual,
                                         len(cell_prompts(cell)), measured.stop,
                                         measured.remeasured[cell])
                    done += 1
                    log(_cell_line(result, done, total, start, starts))
                    yield result
        failed = False
    except GeneratorExit:   # the caller stopped early (a cancelled run): the engines are fine
        failed = False
        raise
    finally:
        if engines is not None:
            engines.shutdown(failed)
        if pool is None:    # a pool's loop keeps its engines' tasks: the pool closes it
            from worker.engines.vllm_engine import close_event_loop

            close_event_loop(loop)
        log(f"measured {done} of {total} cells{' (over engine starts)' if starts > 1 else ''}"
            f" in {time.monotonic() - t_start:.0f} s")


def _cell_line(result, done, total, start, starts) -> str:
    """The log line of a measured cell (after each engine start's round when the protocol
    has several: the figures so far, stored and replaced after the next round)."""
    cell, f = result.cell, result.figures
    al = f["acceptance_length"]
    return (f"cell {done}/{total} {cell.task} b={cell.batch_size} "
            f"T={cell.temperature:g} k={cell.k}: {f['generated_tokens']} tokens in "
            f"{f['wall_seconds']:.1f} s ({f['output_throughput'] or 0:.1f} tok/s"
            f" over {f['repetitions']} passes"
            + (f", engine start {start + 1} of {starts}" if starts > 1 else "") + ")"
            + (f", AL {al:.2f}, tokens/step {f['tokens_per_step']:.2f}"
               if al is not None else "")
            + (f"; {f['remeasured_passes']} loaded pass(es) measured again"
               if f["remeasured_passes"] else "")
            + ("; still loaded" if f["loaded"] else "")
            + ("" if result.checks["ok"] else
               f"; checks failed: {'; '.join(result.checks['failed'])}"))


# --------------------------------------------------------------------------- protocol files

def select_prompts(parsed, task) -> list[PromptItem]:
    """The task's prompts, chosen by worker.prompts.select_task_prompts (its selection rule)."""
    from worker.prompts import select_task_prompts

    try:
        chosen = select_task_prompts(parsed.prompts, task.categories, task.prompts,
                                     task.selection)
    except ValueError as e:
        raise ValueError(f"task {task.task!r}: {parsed.path}: {e}") from None
    return [PromptItem(p.external_id, list(p.turns)) for p in chosen]


def load_protocol_file(path):
    """A protocol file: ProtocolSpec.to_dict() plus ``"prompts": {task: {"path": FILE,
    "format": "spec-bench" | "mt-bench" | "humaneval"}}`` (paths relative to the protocol
    file). A task's prompt_set_sha256, when set, must match the file.
    Returns (spec, {task: [PromptItem]})."""
    from worker.prompts import parse_prompt_file

    path = Path(path)
    data = json.loads(path.read_text())
    sources = data.pop("prompts", None)
    if not isinstance(sources, dict):
        raise ValueError(f"{path}: needs a 'prompts' mapping task -> {{path, format}}")
    spec = ProtocolSpec.from_dict(data)
    prompts = {}
    for task in spec.tasks:
        src = sources.get(task.task)
        if not isinstance(src, dict) or "path" not in src or "format" not in src:
            raise ValueError(f"{path}: prompts for task {task.task!r} need 'path' and 'format'")
        file = Path(src["path"])
        file = file if file.is_absolute() else path.parent / file
        parsed = parse_prompt_file(file, src["format"])
        if task.prompt_set_sha256 and task.prompt_set_sha256 != parsed.sha256:
            raise ValueError(f"{file}: sha256 {parsed.sha256} differs from the protocol's "
                             f"{task.prompt_set_sha256} for task {task.task!r}")
        prompts[task.task] = select_prompts(parsed, task)
    return spec, prompts


# --------------------------------------------------------------------------- CLI

def add_cli_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("--target", required=True, help="target checkpoint folder")
    parser.add_argument("--drafter", required=True, metavar="METHOD[:DIR]",
                        help="baseline, ngram, or METHOD:DIR for a method with weights")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="drafter parameter (VALUE read as JSON if it parses)")
    parser.add_argument("--protocol", required=True, help="protocol JSON file")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--resume", action="store_true",
                        help="keep the cells already in OUT/cells.json and measure the rest")
    parser.add_argument("--synthetic-acceptance-length", type=float, default=None,
                        metavar="AL", help="GPU only: vLLM's synthetic acceptance at this mean "
                        "acceptance length (a calibration of the break-even map; the outputs "
                        "are not the target's)")


def parse_drafter(text: str, params: list[str]) -> DrafterSpec:
    method, _, path = text.partition(":")
    parsed = {}
    for p in params:
        key, sep, value = p.partition("=")
        if not sep or not key:
            raise ValueError(f"--param must be KEY=VALUE, got {p!r}")
        try:
            parsed[key] = json.loads(value)
        except ValueError:
            parsed[key] = value
    return DrafterSpec(method, path or None, parsed)


def _cell_row(result: CellResult) -> dict:
    c = result.cell
    return {"task": c.task, "batch_size": c.batch_size, "temperature": c.temperature,
            "k": c.k, **result.figures, "checks": result.checks}


def _write_json(path: Path, data):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _eta(seconds):
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s"


def cli(args, engine_pool=None) -> int:
    """``python -m worker measure``: measure a protocol file's grid into ``args.out``
    (``engine_pool``: the test suite's, see iter_cells)."""
    try:
        spec, prompts = load_protocol_file(args.protocol)
        drafter = parse_drafter(args.drafter, args.param)
    except (OSError, ValueError, TypeError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cells_path, requests_path = out / "cells.json", out / "requests.jsonl.gz"
    rows = []
    if args.resume and cells_path.is_file():
        rows = json.loads(cells_path.read_text())
    elif requests_path.exists():
        requests_path.unlink()
    # a row stored after an earlier engine start's round only is measured again
    skip = frozenset(cell_key(r) for r in rows
                     if (r.get("engine_starts") or 1) >= spec.starts)
    job = MeasureJob(spec, str(args.target), drafter, prompts, skip,
                     getattr(args, "synthetic_acceptance_length", None))
    try:
        total = len(measurement_order(job)) * spec.starts
        done, t0 = 0, time.monotonic()
        for event in iter_cells(job, log=lambda m: print(f"  {m}", flush=True),
                                engine_pool=engine_pool):
            if isinstance(event, dict):
                _write_json(out / "run.json", {
                    "protocol": spec.to_dict(), "protocol_sha256": spec.sha256(),
                    "target": str(args.target), "drafter": drafter.__dict__, **event})
                print(f"measuring {total} cells"
                      f"{f' (over {spec.starts} engine starts)' if spec.starts > 1 else ''}"
                      f" with {event['engine']} "
                      f"{event['engine_version']} on {event['hardware_description']}",
                      flush=True)
                continue
            # A group measured again whole yields cells already in rows: replace them.
            rows = [r for r in rows if cell_key(r) != event.cell.key]
            rows.append(_cell_row(event))
            _write_json(cells_path, rows)
            if event.figures["engine_starts"] >= spec.starts:   # a cell's last round: all
                with gzip.open(requests_path, "at") as f:        # of its records
                    for r in event.records:
                        f.write(json.dumps(r) + "\n")
            done += 1
            elapsed = time.monotonic() - t0
            eta = elapsed / done * (total - done)
            c = event.cell
            print(f"[{done}/{total}] {c.task} b={c.batch_size} T={c.temperature:g} k={c.k} "
                  f"done; elapsed {_eta(elapsed)}, ETA {_eta(eta)}", flush=True)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"wrote {cells_path} ({len(rows)} cells) and {requests_path}", flush=True)
    return 0


def cell_figures(counts, output_lengths: list[int], ttfts: list, latencies: list,
                 wall_seconds: float) -> dict:
    """The protocol-v1 figures of a cell from its counts and per-request timings (the
    analyses' synthetic cells use it); a worker's cells come from worker.cell.cell_result."""
    from worker import metrics

    generated = sum(output_lengths)
    tpots = [metrics.tpot(lat, t, n) if t is not None else None
             for lat, t, n in zip(latencies, ttfts, output_lengths)]
    ttft_s, tpot_s = metrics.summary(ttfts), metrics.summary(tpots)
    return {
        "requests": len(output_lengths),
        "generated_tokens": generated,
        "wall_seconds": wall_seconds,
        **metrics.acceptance_figures(counts),
        "output_throughput": metrics.output_throughput(generated, wall_seconds),
        **{f"ttft_{q}": ttft_s[q] for q in ("mean", "p50", "p90", "p99")},
        **{f"tpot_{q}": tpot_s[q] for q in ("mean", "p50", "p90", "p99")},
    }
