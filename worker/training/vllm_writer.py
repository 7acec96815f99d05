"""The target writing training data through vLLM, the engine of record.

``VllmWriter`` offers what ``data.generate_conversations`` asks of an engine (a tokenizer,
``encode_chat``, ``decode`` and a batch ``generate``) with vLLM's offline ``LLM``: every
sequence of a batch is handed over at once and the engine keeps them in flight with
continuous batching, instead of the reference engine's fixed batches. The engine runs with
the protocol's defaults for the hardware class (dtype, eager mode, no prefix caching) and
the same chat template, so its greedy answers are the outputs a measurement verifies
against. Sequence ``i`` of a call samples with seed ``seed + i``, as the reference engine does.
The engine starts at the first ``generate``: a generation whose kept rounds already hold
every conversation asked for never starts it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


WRITER_KV_CACHE_GIB = 4
WRITER_STEP_TOKENS = 16384


@dataclass
class WrittenSequence:
    output_ids: list[int]
    text: str
    finish_reason: str   # "eos" or "length", the reference engine's words


class VllmWriter:
    def __init__(self, target_dir, hardware: str = "cpu", seed: int = 0, engine_args=None):
        import os

        from worker.engines.vllm_engine import apply_engine_env, default_engine_args

        # A round of 256 sequences needs about 60k tokens of KV cache (46 kB a token in
        # float32 on this target); with the measuring default of 1 GiB vLLM preempts, and
        # a preempted seeded request fails on CPU ("CPU Generator does not use offset").
        # A caller's VLLM_CPU_KVCACHE_SPACE wins; engine() sets it for the writer's own
        # engine only.
        self.kv_cache_gib = os.environ.get("VLLM_CPU_KVCACHE_SPACE") or str(WRITER_KV_CACHE_GIB)
        apply_engine_env(hardware)   # before the engine starts: its core reads it

        args = default_engine_args(hardware)
        # A seeded request whose prompt is split over two steps (chunked prefill) fails on
        # CPU the same way: a step's token budget that holds a whole round's question
        # prompts (256 x 24 tokens here) keeps every prefill whole.
        args["max_num_batched_tokens"] = WRITER_STEP_TOKENS
        args.update(engine_args or {})
        args.update(model=str(Path(target_dir)), seed=seed)
        self.path = Path(target_dir)
        self.engine_args = args
        self.llm = None
        from worker.measure import load_tokenizer

        self.tokenizer = load_tokenizer(self.path)

    def engine(self):
        """The vLLM engine, started on first use."""
        if self.llm is None:
            import os

            from vllm import LLM

            # The engine core reads the KV cache size when it is spawned: set for this start
            # and put back, so that engines started later in the process (a measurement)
            # get their own.
            before = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = self.kv_cache_gib
            try:
                self.llm = LLM(**self.engine_args)
            finally:
                if before is None:
                    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
                else:
                    os.environ["VLLM_CPU_KVCACHE_SPACE"] = before
        return self.llm

    def encode_chat(self, user_text: str) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": user_text}], tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def generate(self, prompts, max_new_tokens=64, temperature=0.0, seed=0) -> list[WrittenSequence]:
        from vllm import SamplingParams

        # Greedy needs no seed (and a seeded request costs a generator of its own).
        params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature,
                                 seed=seed + i if temperature > 0 else None,
                                 skip_special_tokens=True)
                  for i in range(len(prompts))]
        outputs = self.engine().generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                                    use_tqdm=False)
        return [WrittenSequence(list(o.outputs[0].token_ids), o.outputs[0].text,
                                "eos" if o.outputs[0].finish_reason == "stop" else "length")
                for o in outputs]

    def shutdown(self):
        engine = getattr(self.llm, "llm_engine", None)
        if engine is not None and hasattr(engine, "shutdown"):
            engine.shutdown()
        self.llm = None
