"""Engines the worker measures with. vLLM (``worker.engines.vllm_engine``) is the engine of
record for leaderboard numbers; the plain-torch reference engine lives beside it.

Importing this package is cheap: each engine module imports its engine lazily.
"""
import importlib

ENGINES = {
    "vllm": "worker.engines.vllm_engine",
}


def engine_module(name: str):
    """The module that drives engine ``name`` (a protocol's ``engine`` field)."""
    try:
        return importlib.import_module(ENGINES[name])
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known engines: {', '.join(ENGINES)}") from None
