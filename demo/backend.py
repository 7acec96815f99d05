"""The live demo's back end, without Gradio: what to offer (targets, drafters, prompts from
the database), engines loaded lazily and cached per target, the checks that give a person a
clear message (missing files, a prompt too long), streaming of a generation step by step,
and plain decoding of the same prompt (cached) for the speedup.

One generation runs at a time in the demo process (a lock around the engines, on top of
the Gradio queue's concurrency limit of 1), so the demo never takes more than one
generation's worth of CPU from the workers.
"""
from __future__ import annotations

import inspect
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from worker import methods

log = logging.getLogger(__name__)

# The methods the reference engine runs: ngram, draft_model, eagle (EAGLE-1 head), medusa.
# Others (eagle3, mtp) are measured by vLLM only; the demo lists none of them.
SUPPORTED_METHODS = methods.REFERENCE_METHODS
DEMO_DTYPE = "float32"


class DemoError(Exception):
    """A message for the person using the demo: what is wrong and what to do."""


# ---- what the demo offers (database reads) ------------------------------------------

def target_choices():
    """(label, slug) of every target."""
    from leaderboard.models import Target

    return [(f"{t.name} ({t.slug})", t.slug) for t in Target.objects.order_by("name")]


def drafter_queryset(target_slug):
    from leaderboard.models import Drafter

    return (Drafter.objects.filter(target__slug=target_slug, method__in=SUPPORTED_METHODS,
                                   review_state="approved")
            .order_by("name"))


def drafter_choices(target_slug):
    """(label, slug) of the drafters of a target whose method the reference engine runs."""
    return [(f"{d.name} [{d.method}]", d.slug) for d in drafter_queryset(target_slug)]


def prompt_groups():
    """(label, "set-slug/category") for each prompt set and category, with the count."""
    from django.db.models import Count

    from leaderboard.models import Prompt

    rows = (Prompt.objects.values("prompt_set__slug", "prompt_set__name", "category")
            .annotate(n=Count("id")).order_by("prompt_set__slug", "category"))
    return [(f"{r['prompt_set__name']} · {r['category']} ({r['n']})",
             f"{r['prompt_set__slug']}/{r['category']}") for r in rows]


def prompts_in_group(group: str):
    """(label, prompt id) of the prompts of one group, in file order."""
    from leaderboard.models import Prompt

    if not group or "/" not in group:
        return []
    set_slug, category = group.split("/", 1)
    out = []
    for p in Prompt.objects.filter(prompt_set__slug=set_slug, category=category).order_by("position"):
        first = " ".join(str(p.turns[0] if p.turns else "").split())
        out.append((f"#{p.external_id}: {first[:80]}{'…' if len(first) > 80 else ''}", p.pk))
    return out


def prompt_text(prompt_id) -> str:
    """The first turn of a prompt (the demo is single-turn)."""
    from leaderboard.models import Prompt

    p = Prompt.objects.filter(pk=prompt_id).first()
    return str(p.turns[0]) if p and p.turns else ""


# ---- files ------------------------------------------------------------------------------

def check_checkpoint(path, what: str) -> Path:
    """A checkpoint folder the reference engine can load (config.json and safetensors: a
    Llama target or draft model, an EAGLE or Medusa head), or a DemoError."""
    if not path:
        raise DemoError(f"{what} has no checkpoint folder set.")
    folder = Path(path)
    if not folder.is_dir():
        raise DemoError(f"{what}: checkpoint folder {folder} is missing on the demo host "
                        "(run `python manage.py setup_demo` here, or fix the path).")
    missing = [name for name in ("config.json",) if not (folder / name).is_file()]
    if not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise DemoError(f"{what}: checkpoint folder {folder} lacks {', '.join(missing)}.")
    return folder


def target_folder(target_slug) -> Path:
    from leaderboard.models import Target

    target = Target.objects.filter(slug=target_slug).first()
    if target is None:
        raise DemoError(f"There is no target {target_slug!r}; pick one from the list.")
    folder = check_checkpoint(target.path, f"target {target.name}")
    if not any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer.model")):
        raise DemoError(f"target {target.name}: {folder} has no tokenizer, so the demo cannot "
                        "encode a prompt.")
    return folder


@dataclass(frozen=True)
class DrafterChoice:
    slug: str
    name: str
    method: str
    path: str | None
    params: tuple  # sorted (key, value) pairs, hashable for the proposer cache


def resolve_drafter(drafter_slug, target_slug) -> DrafterChoice:
    """The drafter as the engine needs it; its files (if any) copied into a local folder."""
    from leaderboard.models import Drafter
    from leaderboard.services.runs import drafter_folder

    d = Drafter.objects.filter(slug=drafter_slug).select_related("target").first()
    if d is None:
        raise DemoError(f"There is no drafter {drafter_slug!r}; pick one from the list.")
    if d.target.slug != target_slug:
        raise DemoError(f"drafter {d.name} is for target {d.target.name}, not {target_slug}.")
    if d.method not in SUPPORTED_METHODS:
        raise DemoError(f"drafter {d.name}: the demo's reference engine does not run "
                        f"{d.method} drafters (it runs {', '.join(SUPPORTED_METHODS)}); "
                        f"the leaderboard measures {d.method} with vLLM.")
    path = None
    if d.files.exists():
        try:
            path = drafter_folder(d)
        except (OSError, ValueError) as e:
            raise DemoError(f"drafter {d.name}: its files cannot be read from the storage "
                            f"({type(e).__name__}: {e}).") from e
    if methods.get(d.method).needs_weights:
        check_checkpoint(path, f"drafter {d.name}")
    params = tuple(sorted((k, json.dumps(v)) for k, v in (d.params or {}).items()))
    return DrafterChoice(d.slug, d.name, d.method, path, params)


# ---- engines and proposers (lazy, cached) ---------------------------------------------

_engine_lock = threading.Lock()  # one generation (or load) at a time in this process
_engines: dict = {}
_proposers: dict = {}
_baselines: dict = {}


def set_threads(n: int):
    if n and n > 0:
        import torch

        torch.set_num_threads(n)


def engine_loaded(folder) -> bool:
    return str(Path(folder).resolve()) in _engines


def get_engine(folder):
    """The ReferenceEngine of a target folder, loaded once (float32) and warmed up."""
    key = str(Path(folder).resolve())
    if key in _engines:
        return _engines[key]
    with _engine_lock:
        if key not in _engines:
            from worker.engines.reference import ReferenceEngine

            started = time.perf_counter()
            try:
                engine = ReferenceEngine(key, dtype=DEMO_DTYPE)
            except (OSError, ValueError, KeyError, RuntimeError) as e:
                raise DemoError(f"the target at {key} cannot be loaded "
                                f"({type(e).__name__}: {e}).") from e
            # One short generation, so that the first measured one does not pay for warm-up.
            engine.generate([engine.encode_chat("Hi")], max_new_tokens=4)
            log.info("demo: loaded %s in %.1fs", key, time.perf_counter() - started)
            _engines[key] = engine
    return _engines[key]


def get_proposer(choice: DrafterChoice):
    """The drafter's proposer, loaded once: its parameters that the proposer takes (the
    others are vLLM settings), and a weighted drafter's checkpoint in float32 on the CPU."""
    key = (choice.method, choice.path, choice.params)
    if key not in _proposers:
        params = {k: json.loads(v) for k, v in choice.params}
        method = methods.get(choice.method)
        accepted = inspect.signature(method.proposer_class().__init__).parameters
        params = {k: v for k, v in params.items()
                  if k in accepted and k not in ("self", "path", "dtype", "device")}
        if method.needs_weights:
            params.update(dtype=DEMO_DTYPE, device="cpu")
        try:
            _proposers[key] = methods.make_proposer(choice.method, choice.path, **params)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise DemoError(f"drafter {choice.name} cannot be loaded "
                            f"({type(e).__name__}: {e}).") from e
    return _proposers[key]


def context_length(folder) -> int | None:
    """The target's context (max_position_embeddings of its config.json)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("max_position_embeddings")


def encode_prompt(engine, text: str, max_new_tokens: int, k: int, max_prompt_tokens: int,
                  max_prompt_chars: int = 0):
    """The prompt's token ids in the chat template, or a DemoError if it does not fit. Its
    length in characters is checked before anything tokenizes it: a 4 MiB prompt cost 14 s
    and ~800 MiB to tokenize only to be refused for its token count."""
    text = (text or "").strip()
    if not text:
        raise DemoError("Type a prompt, or pick one from a prompt set.")
    if max_prompt_chars and len(text) > max_prompt_chars:
        raise DemoError(f"The prompt is {len(text)} characters; the demo takes at most "
                        f"{max_prompt_chars}. Shorten it.")
    ids = engine.encode_chat(text)
    context = context_length(engine.path)
    if max_prompt_tokens and len(ids) > max_prompt_tokens:
        raise DemoError(f"The prompt is {len(ids)} tokens; the demo takes at most "
                        f"{max_prompt_tokens}. Shorten it.")
    if context and len(ids) + max_new_tokens + k > context:
        raise DemoError(f"The prompt is {len(ids)} tokens; with {max_new_tokens} new tokens "
                        f"(and {k} drafted) it exceeds the model context of {context} tokens. "
                        "Shorten the prompt or lower max new tokens.")
    return ids


# ---- streaming ------------------------------------------------------------------------

class _Stopped(Exception):
    pass


@dataclass
class Update:
    """What the stream yields: the traces since the last update, the seconds since the
    generation started, and at the end the SequenceResult (``result``) or an ``error``."""

    traces: list
    seconds: float
    result: object = None
    error: BaseException | None = None

    @property
    def done(self):
        return self.result is not None or self.error is not None


def stream_generation(engine, prompt_ids, proposer, k, max_new_tokens, temperature, seed=0):
    """Run one generation in a thread; yield an Update each time steps arrive (all that
    arrived since the last update, so a slow consumer never falls behind), and a last one
    with the result. Closing the generator stops the generation at its next step."""
    events: queue.Queue = queue.Queue()
    stop = threading.Event()
    started = []

    def on_step(trace):
        if stop.is_set():
            raise _Stopped()
        events.put(("step", trace, time.perf_counter() - started[0]))

    def work():
        with _engine_lock:
            started.append(time.perf_counter())
            try:
                results = engine.generate([list(prompt_ids)], proposer=proposer, k=k,
                                          max_new_tokens=max_new_tokens,
                                          temperature=temperature, seed=seed, on_step=on_step)
                events.put(("done", results[0], results[0].timings["wall"]))
            except _Stopped:
                events.put(("stopped", None, time.perf_counter() - started[0]))
            except BaseException as e:  # noqa: BLE001 - every failure reaches the consumer
                log.exception("demo generation failed")
                events.put(("error", e, time.perf_counter() - started[0]))

    thread = threading.Thread(target=work, name="demo-generation", daemon=True)
    thread.start()
    try:
        while True:
            batch = [events.get()]
            while True:
                try:
                    batch.append(events.get_nowait())
                except queue.Empty:
                    break
            traces = [payload for kind, payload, _ in batch if kind == "step"]
            kind, payload, seconds = batch[-1]
            if kind == "done":
                yield Update(traces, seconds, result=payload)
                return
            if kind == "error":
                yield Update(traces, seconds, error=payload)
                return
            if kind == "stopped":
                return
            yield Update(traces, seconds)
    finally:
        stop.set()


@dataclass
class Baseline:
    tokens_per_s: float
    output_ids: list
    seconds: float


def plain_decoding(engine, prompt_ids, max_new_tokens) -> Baseline:
    """Plain decoding (no drafter, greedy) of the same prompt, run once and cached per
    (target, prompt, max new tokens): the speedup's denominator."""
    from worker import metrics

    key = (str(engine.path), tuple(prompt_ids), int(max_new_tokens))
    if key not in _baselines:
        with _engine_lock:
            if key not in _baselines:
                result = engine.generate([list(prompt_ids)], proposer=None,
                                         max_new_tokens=max_new_tokens, temperature=0.0)[0]
                wall = result.timings["wall"]
                _baselines[key] = Baseline(
                    metrics.output_throughput(len(result.output_ids), wall),
                    list(result.output_ids), wall)
    return _baselines[key]


def cached_baseline(engine, prompt_ids, max_new_tokens) -> Baseline | None:
    return _baselines.get((str(engine.path), tuple(prompt_ids), int(max_new_tokens)))


def token_text(engine, token_id) -> str:
    """A vocabulary entry as text, for the step log (drafted tokens are not in the output)."""
    tok = engine.tokenizer
    return tok.decode([int(token_id)], skip_special_tokens=False) if tok is not None else str(token_id)


# ---- sharing the host with measurements ---------------------------------------------------

CONTENTION_NOTE = ("measured under contention: a leaderboard measurement was running on "
                   "this host, so these timings are not comparable")


def host_contended(lock_path, timeout_s: float, on_wait=None) -> bool:
    """Wait up to ``timeout_s`` for the host lock (worker.hostlock: a measurement holds it)
    to be free; ``on_wait()`` is called once if there is anything to wait for. True when a
    measurement still holds it (the demo then generates anyway and labels its timings)."""
    from worker import hostlock

    if not hostlock.is_held(lock_path):
        return False
    if on_wait:
        on_wait()
    return not hostlock.wait_until_free(lock_path, timeout_s)

