"""A drafter submitted by model-hub reference (`manage.py submit_drafter`,
leaderboard/services/intake.py, checked in the command), served by the stand-in hub
(tests/hub_standin.py through HF_ENDPOINT): the shipped EAGLE-3 head as its authors would
publish it in the speculators format, pinned to the commit the branch named at submission.
Its stored tensors and config are those of the same files uploaded (content hash), which
tests/test_published_formats_vllm.py measures to accept exactly what the shipped head does."""
import json
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.urls import reverse

from leaderboard.models import Drafter, Run
from worker.checkpoint import TargetFacts, validate_checkpoint

from . import factories as f
from . import published_formats as pf
from .test_hub import standin  # noqa: F401 (a fixture)

pytestmark = pytest.mark.django_db

SHIPPED = Path(__file__).resolve().parent.parent / "drafters" / "eagle3-demo-tasks-2k-v1-seed-0"
REPO = "smol-lab/SmolLM2-135M-speculator.eagle3"
VERIFIER = "HuggingFaceTB/SmolLM2-135M-Instruct"


DEMO_TARGET = TargetFacts(vocab_size=49152, hidden_size=576, num_layers=30)  # SmolLM2-135M


@pytest.fixture
def protocol():
    target = f.make_target(vocab_size=DEMO_TARGET.vocab_size,
                           hidden_size=DEMO_TARGET.hidden_size, num_layers=DEMO_TARGET.num_layers)
    return f.make_protocol(target, hardware="hub-test", ks=(3,))


def test_a_hub_reference_is_pinned_to_its_commit_fetched_checked_and_queued(
        standin, protocol, tmp_path, client, media):  # noqa: F811
    pf.speculators_eagle3(SHIPPED, tmp_path / "published", VERIFIER)
    files = {p.name: p.read_bytes() for p in (tmp_path / "published").iterdir()}
    first = standin.publish(REPO, files)
    call_command("submit_drafter", f"{REPO}@main", protocol=f"{protocol.slug}@{protocol.version}", method="eagle3")
    drafter = Drafter.objects.get()
    hub = drafter.intake["hub"]
    assert hub == {"repo_id": REPO, "revision": "main", "commit": first}
    assert drafter.intake["format"] == "speculators" and drafter.intake["verifier"] == VERIFIER
    assert sorted(drafter.files.values_list("name", flat=True)) == ["config.json",
                                                                    "model.safetensors"]
    # Neither the README nor the config class was fetched: only what is kept.
    assert [r.path for r in standin.gets(REPO, "README.md")] == []
    assert [r.path for r in standin.gets(REPO, "eagle3.py")] == []
    assert Run.objects.filter(drafter=drafter, state=Run.QUEUED).count() == 1
    # The same drafter as its files uploaded: same tensors, same config.
    local = validate_checkpoint(list(pf.uploads(tmp_path / "published")), "eagle3",
                                DEMO_TARGET, max_total_bytes=1 << 30)
    with local:
        assert local.content_sha256 == drafter.content_sha256
    page = client.get(reverse("drafter", args=[drafter.slug])).content.decode()
    assert REPO in page and first[:12] in page and "the commit measured" in page
    api = client.get(f"/api/drafters/{drafter.slug}").json()["drafter"]["intake"]
    assert api["hub"]["commit"] == first

    # The branch moves on: a new reference pins the new commit; the same bytes again
    # are the same drafter (refused as a duplicate under this protocol).
    config = json.loads(files["config.json"])
    config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 2
    second = standin.publish(REPO, dict(files, **{"config.json": json.dumps(config).encode()}))
    call_command("submit_drafter", REPO, protocol=f"{protocol.slug}@{protocol.version}", method="eagle3",
                 name="moved on")
    assert Drafter.objects.get(name="moved on").intake["hub"]["commit"] == second
    with pytest.raises(CommandError, match="already"):
        call_command("submit_drafter", f"{REPO}@{first}", protocol=f"{protocol.slug}@{protocol.version}",
                     method="eagle3", name="again")


def test_a_gated_or_unknown_reference_is_refused_and_stores_nothing(standin, protocol,  # noqa: F811
                                                                     tmp_path, settings, media):
    pf.speculators_eagle3(SHIPPED, tmp_path / "published", VERIFIER)
    standin.publish(REPO, {p.name: p.read_bytes() for p in (tmp_path / "published").iterdir()})
    standin.set_access(REPO, gated=True, tokens=("hf_right",))
    with pytest.raises(CommandError, match="SPECBOARD_HF_TOKEN"):
        call_command("submit_drafter", REPO, protocol=f"{protocol.slug}@{protocol.version}", method="eagle3")
    with pytest.raises(CommandError, match="repository"):
        call_command("submit_drafter", "smol-lab/nothing-here", protocol=f"{protocol.slug}@{protocol.version}",
                     method="eagle3")
    assert not Drafter.objects.exists() and not list(Path(media).rglob("*.safetensors"))
    settings.SPECBOARD_HF_TOKEN = "hf_right"
    call_command("submit_drafter", REPO, protocol=f"{protocol.slug}@{protocol.version}", method="eagle3")
    assert Drafter.objects.get().intake["hub"]["repo_id"] == REPO
