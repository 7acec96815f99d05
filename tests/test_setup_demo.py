import pytest
from django.core.management import call_command

from leaderboard.models import Drafter, Prompt, PromptSet, Protocol, Target


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
    spec = protocol.spec_obj
    assert spec.hardware == "cpu" and [t.task for t in spec.tasks] == [
        "chat", "math-reasoning", "code"]
    assert spec.batch_sizes == (1, 4, 8) and spec.ks == (2, 4) and spec.max_new_tokens == 128
    assert [d[1] for d in first["drafters"]] == ["ngram-prompt-lookup"]
    target = Target.objects.get()
    assert (target.vocab_size, target.hidden_size, target.num_layers) == (49152, 576, 30)
    assert target.has_chat_template
    out = capsys.readouterr().out
    assert "[setup_demo] done" in out
