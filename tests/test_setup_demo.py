import pytest
from django.core.management import call_command

from leaderboard.models import Drafter, Prompt, PromptSet, Protocol, Target


def shipped_recipes() -> dict:
    """{folder: recipe} of the trained drafters shipped in the repository's drafters/."""
    import json

    from django.conf import settings

    return {f.name: json.loads((f / "training.json").read_text())["recipe"]
            for f in sorted(settings.SHIPPED_DRAFTERS_DIR.iterdir())
            if (f / "training.json").is_file()}


def snapshot():
    return {
        "targets": list(Target.objects.values_list("pk", "slug", "weights_sha256")),
        "prompt_sets": list(PromptSet.objects.values_list("pk", "slug", "source_sha256")),
        "prompts": Prompt.objects.count(),
        "protocols": list(Protocol.objects.values_list("pk", "slug", "version", "sha256")),
        "drafters": list(Drafter.objects.values_list("pk", "slug", "method")),
    }


@pytest.mark.django_db
def test_setup_demo_twice_gives_the_same_rows(demo_target_dir, capsys):
    call_command("setup_demo")
    first = snapshot()
    call_command("setup_demo")
    assert snapshot() == first
    assert first["targets"][0][1] == "smollm2-135m-instruct"
    assert {s for _, s, _ in first["prompt_sets"]} == {"mt-bench", "humaneval"}
    assert first["prompts"] == 80 + 164
    protocol = Protocol.objects.get()
    spec = protocol.spec
    assert spec.hardware == "cpu" and [t.task for t in spec.tasks] == [
        "chat", "math-reasoning", "code"]
    assert spec.batch_sizes == (1, 4, 8) and spec.ks == (2, 4) and spec.max_new_tokens == 128
    # the n-gram drafter and one drafter per folder shipped in drafters/, with its recipe
    shipped = shipped_recipes()
    assert "ngram-prompt-lookup" in [d[1] for d in first["drafters"]]
    trained = Drafter.objects.exclude(slug="ngram-prompt-lookup")
    assert sorted((d.training_details.get("shipped"), d.trained_by_recipe) for d in trained) == \
        sorted(shipped.items())
    target = Target.objects.get()
    assert (target.vocab_size, target.hidden_size, target.num_layers) == (49152, 576, 30)
    assert target.has_chat_template
    out = capsys.readouterr().out
    assert "[setup_demo] done" in out


@pytest.mark.django_db
def test_demo_protocol_v6_is_v5_with_fair_turns_and_keeps_v1_to_v5(demo_target_dir):
    from leaderboard.models import Run
    from leaderboard.services import setup

    rows = setup.setup_demo(progress=lambda m: None)
    v6 = rows["protocol"]
    spec = v6.spec
    assert (v6.version, spec.baseline, spec.repetitions, spec.engine_starts,
            spec.interleave_s, spec.fair_turns) == (6, "paired", 2, 2, 2.0, True)
    assert (spec.target_half_width, spec.max_repetitions, spec.cell_time_budget_s) == (
        0.05, 4, 150.0)
    # each engine start: one pass at least, two at most, half the time budget
    one_start = spec.per_start()
    assert (one_start.repetitions, one_start.max_repetitions, one_start.cell_time_budget_s,
            one_start.starts) == (1, 2, 75.0, 1)
    assert all(t.selection == "stratified" and t.prompts == 24 for t in spec.tasks)
    # 24 prompts a task at batch sizes 4 and 8, the first 8 of them at batch size 1
    assert [spec.cell_prompts(t, b) for t in spec.tasks for b in (1, 4, 8)] == [8, 24, 24] * 3
    # every named category is measured, at batch size 1 too (a stratified prefix)
    chosen = v6.task_prompts()
    assert {c: len(ids) for c, ids in chosen["chat"]["categories"].items()} == {
        "writing": 6, "roleplay": 6, "humanities": 6, "stem": 6}
    assert {c: len(ids) for c, ids in chosen["math-reasoning"]["categories"].items()} == {
        "math": 8, "reasoning": 8, "extraction": 8}
    first8 = [p.category for p in v6.prompts_of_task(spec.tasks[0])][:8]
    assert set(first8) == {"writing", "roleplay", "humanities", "stem"}
    queued = setup.queue_demo_runs(rows)
    # no separate baseline (paired); the n-gram run first, then the shipped drafters'
    assert [r.drafter_id is None for r in queued] == [False] * (1 + len(shipped_recipes()))
    assert queued[0].drafter.method == "ngram"
    # its progress counts every cell once per engine start
    assert queued[0].cells_total == 2 * len(spec.run_cells("ngram"))
    assert not Run.objects.filter(protocol=v6, drafter__isnull=True).exists()
    # existing v1 to v5 stay as they were
    v1, _ = setup.ensure_protocol(
        setup.demo_protocol_spec_v1(rows["target"], rows["prompt_sets"]), rows["target"])
    v2, _ = setup.ensure_protocol(
        setup.demo_protocol_spec_v2(rows["target"], rows["prompt_sets"]), rows["target"])
    v3, _ = setup.ensure_protocol(
        setup.demo_protocol_spec_v3(rows["target"], rows["prompt_sets"]), rows["target"])
    v4, _ = setup.ensure_protocol(
        setup.demo_protocol_spec_v4(rows["target"], rows["prompt_sets"]), rows["target"])
    v5, _ = setup.ensure_protocol(
        setup.demo_protocol_spec_v5(rows["target"], rows["prompt_sets"]), rows["target"])
    assert (v1.version, v1.spec.baseline, v1.spec.repetitions) == (1, "shared", 1)
    assert (v2.version, v2.spec.repetitions, v2.spec.tasks[0].prompts) == (2, 3, 8)
    assert not v2.spec.adaptive and "target_half_width" not in v2.spec_json
    assert (v3.version, v3.spec.starts) == (3, 1) and "engine_starts" not in v3.spec_json
    assert {k: v for k, v in v3.spec_json.items() if k != "version"} == {
        k: v for k, v in v4.spec_json.items() if k not in ("version", "engine_starts")}
    assert (v4.version, v4.spec.interleave_s) == (4, None)
    assert "interleave_s" not in v4.spec_json
    assert {k: v for k, v in v4.spec_json.items() if k != "version"} == {
        k: v for k, v in v5.spec_json.items() if k not in ("version", "interleave_s")}
    assert (v5.version, v5.spec.fair_turns) == (5, None) and "fair_turns" not in v5.spec_json
    assert {k: v for k, v in v5.spec_json.items() if k != "version"} == {
        k: v for k, v in v6.spec_json.items() if k not in ("version", "fair_turns")}
    assert setup.setup_demo(progress=lambda m: None)["protocol"].pk == v6.pk
    assert Protocol.objects.filter(slug=v6.slug).count() == 6
    # the protocol pages say how a group-pass is measured
    from django.test import Client
    from django.urls import reverse

    pages = {p.version: Client().get(reverse("protocol", args=[p.slug, p.version])).content
             .decode() for p in (v4, v5, v6)}
    assert 'id="interleave-s"' in pages[5] and "turns of <b>2.0 s</b>" in pages[5]
    assert 'id="interleave-s"' not in pages[4] and 'id="engine-starts"' in pages[4]
    assert 'id="fair-turns"' in pages[6] and 'id="fair-turns"' not in pages[5]


@pytest.mark.django_db
def test_acceptance_protocol_is_the_demo_at_batch_8_largest_k_one_pass(demo_target_dir):
    call_command("setup_demo")
    assert not Protocol.objects.filter(slug="demo-cpu-acceptance").exists()   # make run: none
    call_command("setup_demo", "--acceptance-protocol")
    call_command("setup_demo", "--acceptance-protocol")
    demo = Protocol.objects.get(slug="demo-cpu").spec
    check = Protocol.objects.get(slug="demo-cpu-acceptance")
    spec = check.spec
    assert (spec.batch_sizes, spec.ks, spec.repetitions, spec.version) == ((8,), (4,), 1, 1)
    # The same prompts, sampling and pairing as the demo protocol: comparable acceptance.
    assert (spec.tasks, spec.temperatures, spec.max_new_tokens, spec.seed, spec.baseline) == (
        demo.tasks, demo.temperatures, demo.max_new_tokens, demo.seed, demo.baseline)
    assert check.sha256 != Protocol.objects.get(slug="demo-cpu").sha256
