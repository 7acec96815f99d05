"""Red Hat's ``speculators`` format read as vLLM reads it: the config's structure checked by
vLLM's own ``SpeculatorsConfig`` (vllm/transformers_utils/configs/speculators), the
algorithm mapped to a vLLM method, and the flat draft config that vLLM builds from
``transformer_layer_config`` plus the algorithm's fields, so that each method's own size
rules apply to it. vLLM is imported in a sandboxed child (about 450 MiB and 5 s): the
process that validates never loads it. The child is
``python -m worker.checkpoint.speculators CONFIG``."""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

from worker.sandbox import GiB, Limits, SandboxError, fail, run_module, write_result

LIMITS = Limits(address_space=6 * GiB, cpu_seconds=60, wall_seconds=120, file_bytes=1 << 20)


def is_speculators(config) -> bool:
    return isinstance(config, dict) and config.get("speculators_config") is not None


def verifier_of(config: dict) -> str | None:
    v = config.get("speculators_config", {})
    v = v.get("verifier") if isinstance(v, dict) else None
    name = v.get("name_or_path") if isinstance(v, dict) else None
    return name if isinstance(name, str) else None


def read_as_vllm(config_path: Path) -> dict:
    """{"method": vLLM's method, "parallel_drafting": bool, "speculative_tokens": int,
    "flat": the draft config vLLM builds}. Raises ValueError with vLLM's reason."""
    try:
        return run_module("worker.checkpoint.speculators", [str(config_path)], LIMITS)
    except SandboxError as e:
        raise ValueError(e.reason) from None


def main(argv: list[str]) -> int:
    config = json.loads(Path(argv[0]).read_text())
    try:
        from vllm.transformers_utils.configs.speculators.algos import \
            SUPPORTED_SPECULATORS_TYPES
        from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
    except ImportError as e:
        return fail(f"this worker's vLLM cannot read speculators configs ({e})")
    kind = config.get("speculators_model_type")
    if kind not in SUPPORTED_SPECULATORS_TYPES:
        return fail(f"speculators_model_type {kind!r} is not one this vLLM loads (it loads "
                    f"{', '.join(sorted(SUPPORTED_SPECULATORS_TYPES))})")
    try:
        spec = SpeculatorsConfig.extract_vllm_speculative_config(copy.deepcopy(config))
        flat = SpeculatorsConfig.extract_transformers_pre_trained_config(copy.deepcopy(config))
    except (ValueError, TypeError, KeyError) as e:
        return fail(f"vLLM refuses this speculators config: {e}")
    write_result({"method": spec["method"],
                  "parallel_drafting": bool(spec.get("parallel_drafting")),
                  "speculative_tokens": spec.get("num_speculative_tokens"),
                  "flat": flat})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
