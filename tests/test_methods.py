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
                               "medusa", "mtp")
    assert methods.DRAFTER_CHOICES == [
        ("ngram", "n-gram prompt lookup"), ("draft_model", "draft model"), ("eagle", "EAGLE"),
        ("eagle3", "EAGLE-3"), ("medusa", "Medusa"), ("mtp", "multi-token prediction")]
    assert methods.DRAFTER_METHODS == tuple(m for m, _ in methods.DRAFTER_CHOICES)
    assert methods.WEIGHTED_METHODS == ("draft_model", "eagle", "eagle3", "medusa", "mtp")
    assert methods.CPU_METHODS == ("baseline", "ngram", "draft_model", "eagle", "eagle3", "medusa")
    assert methods.REFERENCE_METHODS == ("ngram", "draft_model", "eagle", "medusa")
    assert methods.NO_DRAFT_COST_METHODS == ("ngram",)
    assert methods.ALLOWED_PARAMS["ngram"] == ("prompt_lookup_min", "prompt_lookup_max")


@pytest.mark.django_db
def test_every_list_of_methods_in_the_site_is_the_registrys():
    from leaderboard import demo_engine, forms
    from leaderboard.api import common
    from leaderboard.models import Drafter
    from leaderboard.selectors import shapes

    assert Drafter.METHODS == methods.DRAFTER_CHOICES
    assert Drafter._meta.get_field("method").choices == methods.DRAFTER_CHOICES
    assert list(forms.SubmitForm().fields["method"].choices) == methods.DRAFTER_CHOICES
    assert common.METHODS == methods.DRAFTER_METHODS
    assert shapes.METHOD_LABELS == dict(methods.DRAFTER_CHOICES)
    assert demo_engine.SUPPORTED_METHODS == methods.REFERENCE_METHODS


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
    for name in ("draft_model", "eagle", "eagle3", "medusa", "mtp"):
        spec = DrafterSpec(name, str(tmp_path), {"draft_sample_method": "greedy"})
        assert methods.speculative_config(spec, 2) == {
            "method": name, "model": str(tmp_path), "num_speculative_tokens": 2,
            "draft_sample_method": "greedy"}
        with pytest.raises(ValueError, match="unknown parameter"):
            methods.speculative_config(DrafterSpec(name, str(tmp_path), {"n": 1}), 2)
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
