"""Pickled weights of a published format converted to safetensors, in a sandboxed child
(worker/sandbox.py): ``torch.load(weights_only=True)`` (PyTorch's restricted unpickler:
tensors and plain containers only, no code runs), every value must be a tensor, then
``safetensors.torch.save_file``. The parent calls ``convert_weights``; the child is
``python -m worker.checkpoint.convert SOURCE DEST``."""
from __future__ import annotations

import sys
from pathlib import Path

from worker.sandbox import GiB, Limits, SandboxError, fail, run_module, write_result

# Room for Python and torch (about 1 GiB of address space) beside the weights, which are
# memory-mapped where the format allows it and read whole otherwise.
BASE_ADDRESS_SPACE = 2 * GiB


def limits_for(source: Path) -> Limits:
    size = source.stat().st_size
    return Limits(address_space=BASE_ADDRESS_SPACE + 2 * size, cpu_seconds=120 + size // (8 << 20),
                  wall_seconds=300 + size / (8 << 20), file_bytes=size + (64 << 20))


def convert_weights(source: Path, dest: Path, limits: Limits | None = None) -> dict:
    """Convert ``source`` (a pickle) into ``dest`` (safetensors). Returns {"tensors": n}.
    Raises ValueError with a sentence for the submitter."""
    try:
        return run_module("worker.checkpoint.convert", [str(source), str(dest)],
                          limits or limits_for(source))
    except SandboxError as e:
        Path(dest).unlink(missing_ok=True)   # a partial file is never kept
        raise ValueError(f"could not be converted to safetensors: {e.reason}") from None


def _load(source: str) -> dict:
    import torch

    try:
        state = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        state = torch.load(source, map_location="cpu", weights_only=True)  # legacy format
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not state:
        raise ValueError(f"holds a {type(state).__name__}, not a dictionary of tensors")
    bad = [str(k) for k, v in state.items() if not isinstance(k, str)
           or not isinstance(v, torch.Tensor)]
    if bad:
        raise ValueError(f"holds entries that are not named tensors: {', '.join(bad[:5])}")
    return state


def main(argv: list[str]) -> int:
    source, dest = argv
    try:
        state = _load(source)
    except Exception as e:  # noqa: BLE001 - one sentence for the submitter, not a traceback
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "Weights only load failed" in reason or "weights_only" in str(e):
            reason = ("it holds objects other than tensors, which are never unpickled: save "
                      "only the state dict (tensors)")
        return fail(f"cannot read the weights: {reason[:300]}")
    from safetensors.torch import save_file

    # Tensors that share storage (tied weights) are stored once each.
    save_file({k: v.detach().contiguous().clone() for k, v in state.items()}, dest,
              metadata={"format": "pt"})
    write_result({"tensors": len(state)})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
