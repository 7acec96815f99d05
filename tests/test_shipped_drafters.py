"""Trained drafters shipped with the repository (leaderboard/services/shipping.py): a folder
of config.json + model.safetensors + training.json becomes a drafter through the upload
path, once; a bad folder is refused with what to fix and stores nothing; setup_demo
--queue-runs queues them after the n-gram run; ship_drafter writes such a folder from a
trained drafter's stored files and record.

The checkpoints are real Medusa heads (worker.heads.MedusaHeads) written into temporary
folders: the tiny test target's size for the service tests, the demo target's hidden size
(with a 64-token draft vocabulary, to stay small) for setup_demo."""
import json
from pathlib import Path

import pytest
import torch
from django.core.files.storage import default_storage
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from leaderboard.models import Drafter, DrafterFile, Run, TrainingDataset
from leaderboard.services import shipping
from leaderboard.services.training import register_drafter, trained_drafter
from worker.heads import MedusaHeads

from .factories import make_drafter, make_protocol, make_target

DATA_SHA = "ab" * 32


def training_json(for_target, **changes):
    record = {"recipe": "medusa_reduced_vocab", "method": "medusa", "target": for_target.slug,
              "target_sha256": for_target.weights_sha256, "data_slug": "demo-chat-1k",
              "data_version": 1, "data_sha256": DATA_SHA, "data_conversations": 1024,
              "data_tokens": 210000, "data_answer_tokens": 150000, "data_seconds": 812.5,
              "seed": 3, "steps": 600, "seconds": 401.25, "first_loss": 8.5, "final_loss": 1.75,
              "tokens": 120000, "settings": {"steps": 600, "batch_size": 4, "lr": 0.001},
              "options": {"heads": 4, "head_layers": 1, "draft_vocab": 64}}
    record.update(changes)
    return record


def write_heads(folder: Path, hidden, vocab, heads=4, seed=0, token_map=None, record=None):
    torch.manual_seed(seed)
    module = MedusaHeads(hidden, vocab, heads, token_map=token_map)
    module.save(folder, torch.bfloat16)
    if record is not None:
        (folder / "training.json").write_text(json.dumps(record))
    return folder


@pytest.fixture
def site(settings, tmp_path):
    target = make_target()  # hidden 16, vocab 64
    protocol = make_protocol(target, slug="ship-test", hardware="cpu", ks=(2, 4))
    return target, protocol


def media_files(settings):
    root = Path(settings.MEDIA_ROOT)
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


@pytest.mark.django_db
def test_a_shipped_drafter_is_registered_once_with_its_training_record(site, tmp_path, settings):
    target, protocol = site
    root = tmp_path / "drafters"
    write_heads(root / "medusa-demo-1k", 16, 64, record=training_json(target))
    (root / "README.md").parent.mkdir(exist_ok=True)
    (root / "README.md").write_text("what goes here\n")  # a file beside the folders: ignored

    report = shipping.register_shipped_drafters(protocol, root)
    assert (len(report.registered), report.present, report.refused) == (1, [], [])
    d = report.registered[0]
    assert (d.method, d.trained_by_recipe, d.owner, d.training_seed) == (
        "medusa", "medusa_reduced_vocab", None, 3)
    assert d.training_data is None and d.training_data_sha256 == DATA_SHA
    assert d.training_seconds == 401.25
    assert d.training_details["shipped"] == "medusa-demo-1k"
    assert d.training_details["data_conversations"] == 1024
    assert d.training_details["options"]["heads"] == 4
    # The checkpoint files only: training.json describes them and is not part of the hash.
    assert sorted(d.files.values_list("name", flat=True)) == ["config.json", "model.safetensors"]
    assert not Run.objects.filter(drafter=d).exists()   # queued by setup_demo --queue-runs

    # Twice: nothing new.
    again = shipping.register_shipped_drafters(protocol, root)
    assert (again.registered, [x.pk for x in again.present]) == ([], [d.pk])
    assert Drafter.objects.count() == 1 and DrafterFile.objects.count() == 2

    # The same recipe, data (by sha256) and seed count as trained, so make demo-drafters'
    # train_drafter --skip-existing does not train it again once the data exist here.
    data = TrainingDataset.objects.create(slug="demo-chat-1k", target=target, sha256=DATA_SHA,
                                          n=1024, tokens=210000, path="x.jsonl")
    assert trained_drafter("medusa_reduced_vocab", data, 3) == d
    assert trained_drafter("medusa_reduced_vocab", data, 4) is None
    # One trained with conversations held out is another drafter, either way round.
    assert trained_drafter("medusa_reduced_vocab", data, 3, heldout=64) is None
    Drafter.objects.filter(pk=d.pk).update(
        training_details={**d.training_details, "settings": {"heldout": 64}})
    assert trained_drafter("medusa_reduced_vocab", data, 3) is None
    assert trained_drafter("medusa_reduced_vocab", data, 3, heldout=64) == d

    # Its page and the API give the recipe, the data and the training figures.
    client = Client()
    api = client.get(f"/api/drafters/{d.slug}").json()["drafter"]["training"]
    assert api["recipe"] == "medusa_reduced_vocab" and api["data_sha256"] == DATA_SHA
    assert (api["seed"], api["steps"], api["seconds"], api["shipped"]) == (3, 600, 401.25,
                                                                             "medusa-demo-1k")
    assert (api["data_conversations"], api["data_answer_tokens"], api["data_seconds"]) == (
        1024, 150000, 812.5)
    assert (api["first_loss"], api["final_loss"]) == (8.5, 1.75)
    page = client.get(f"/drafters/{d.slug}/").content.decode()
    assert "trained by recipe <code>medusa_reduced_vocab</code>" in page
    assert DATA_SHA[:12] in page and "1024 conversations" in page
    assert "shipped in <code>drafters/medusa-demo-1k</code>" in page
    assert '/recipes/?protocol=ship-test@1#recipe-medusa_reduced_vocab' not in page  # no run yet
    assert '/recipes/#recipe-medusa_reduced_vocab' in page

    # A changed file is a new drafter, as an upload would be.
    write_heads(root / "medusa-demo-1k", 16, 64, seed=1)
    changed = shipping.register_shipped_drafters(protocol, root)
    assert len(changed.registered) == 1 and changed.registered[0].pk != d.pk
    assert Drafter.objects.count() == 2


@pytest.mark.django_db
def test_a_bad_shipped_folder_is_refused_with_what_to_fix_and_stores_nothing(site, tmp_path,
                                                                            settings):
    target, protocol = site
    root = tmp_path / "drafters"
    write_heads(root / "a-wrong-hidden-size", 32, 64, record=training_json(target))
    write_heads(root / "b-other-target", 16, 64, record=training_json(
        target, target="llama-8b", target_sha256="cd" * 32))
    write_heads(root / "c-no-record", 16, 64)
    write_heads(root / "d-too-few-heads", 16, 64, heads=2,
                record=training_json(target, options={"heads": 2, "head_layers": 1}))
    write_heads(root / "e-unknown-recipe", 16, 64, record=training_json(target, recipe="magic"))
    folder = write_heads(root / "f-pickle", 16, 64, record=training_json(target))
    (folder / "weights.pt").write_bytes(b"\x80\x04not a tensor")
    write_heads(root / "g-good", 16, 64, seed=5, record=training_json(target))

    report = shipping.register_shipped_drafters(protocol, root)
    refused = dict(report.refused)
    assert sorted(refused) == ["a-wrong-hidden-size", "b-other-target", "c-no-record",
                               "d-too-few-heads", "e-unknown-recipe", "f-pickle"]
    assert "refused as an upload would be" in refused["a-wrong-hidden-size"]
    assert "config.json" in refused["a-wrong-hidden-size"] and "hidden_size" in refused["a-wrong-hidden-size"]
    assert "trained for target llama-8b" in refused["b-other-target"]
    assert "no training.json" in refused["c-no-record"]
    assert "--heads 4" in refused["d-too-few-heads"]
    assert "unknown recipe 'magic'" in refused["e-unknown-recipe"]
    assert "weights.pt" in refused["f-pickle"]
    # Only the good folder is stored: its two files and nothing of the others.
    assert [d.training_details["shipped"] for d in report.registered] == ["g-good"]
    assert Drafter.objects.count() == 1 and DrafterFile.objects.count() == 2
    stored = {Path(default_storage.path(f.file.name)) for f in DrafterFile.objects.all()}
    assert set(media_files(settings)) == stored


@pytest.mark.django_db
def test_setup_demo_registers_shipped_drafters_and_queues_them_after_the_ngram_run(
        demo_target_dir, tmp_path, settings, capsys):
    settings.SHIPPED_DRAFTERS_DIR = root = tmp_path / "drafters"
    root.mkdir()
    (root / "README.md").write_text("no drafter yet\n")
    call_command("setup_demo")   # an empty shipped folder: the n-gram drafter only
    assert list(Drafter.objects.values_list("slug", flat=True)) == ["ngram-prompt-lookup"]

    from leaderboard.models import Target

    target = Target.objects.get(slug="smollm2-135m-instruct")
    write_heads(root / "medusa-reduced", target.hidden_size, target.vocab_size,
                token_map=torch.arange(64), record=training_json(target))
    write_heads(root / "other-target", target.hidden_size, target.vocab_size, seed=2,
                token_map=torch.arange(64),
                record=training_json(target, target_sha256="cd" * 32, target="llama-8b"))
    capsys.readouterr()
    call_command("setup_demo", "--queue-runs")
    captured = capsys.readouterr()
    shipped = Drafter.objects.get(trained_by_recipe="medusa_reduced_vocab")
    assert "shipped drafter medusa-reduced: registered as" in captured.out
    assert "shipped drafter other-target refused: other-target: trained for target llama-8b" in captured.err
    runs = list(Run.objects.order_by("pk").values_list("drafter__slug", flat=True))
    assert runs == ["ngram-prompt-lookup", shipped.slug]   # the n-gram run first
    assert Run.objects.get(drafter=shipped).state == Run.QUEUED

    call_command("setup_demo", "--queue-runs")
    assert Drafter.objects.count() == 2 and Run.objects.count() == 2


@pytest.mark.django_db
def test_ship_drafter_writes_the_folder_that_setup_registers(site, tmp_path, settings, capsys):
    target, protocol = site
    data = TrainingDataset.objects.create(
        slug="demo-chat-1k", target=target, sha256=DATA_SHA, n=1024, tokens=210000,
        path="x.jsonl", params={"stats": {"seconds": 812.5, "answer_tokens": 150000}})
    trained = write_heads(tmp_path / "run" / "drafter", 16, 64)
    summary = {"drafter_dir": str(trained), "method": "medusa", "seed": 0, "steps": 600,
               "seconds": 401.25, "first_loss": 8.5, "final_loss": 1.75, "tokens": 120000,
               "settings": {"steps": 600}, "options": {"heads": 4, "head_layers": 1}}
    drafter, _ = register_drafter(summary, "medusa", data, protocol, send=False)

    out = tmp_path / "shipped"
    call_command("ship_drafter", "--recipe", "medusa", "--data", "demo-chat-1k", "--to", str(out))
    folder = out / drafter.slug
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors",
                                                        "training.json"]
    for name in ("config.json", "model.safetensors"):
        assert (folder / name).read_bytes() == (trained / name).read_bytes()
    record = json.loads((folder / "training.json").read_text())
    assert record == {"recipe": "medusa", "method": "medusa", "target": target.slug,
                      "target_sha256": target.weights_sha256, "data_slug": "demo-chat-1k",
                      "data_version": 1, "data_sha256": DATA_SHA, "data_conversations": 1024,
                      "data_tokens": 210000, "data_answer_tokens": 150000, "data_seconds": 812.5,
                      "seed": 0, "seconds": 401.25, "steps": 600, "first_loss": 8.5,
                      "final_loss": 1.75, "tokens": 120000, "settings": {"steps": 600},
                      "options": {"heads": 4, "head_layers": 1}}
    assert not [p for p in out.iterdir() if p.name.startswith(".ship-")]

    # Again: unchanged. Other files under that name: refused unless --replace.
    capsys.readouterr()
    call_command("ship_drafter", drafter.slug, "--to", str(out))
    assert "already shipped, unchanged" in capsys.readouterr().out
    (folder / "config.json").write_text("{}")
    with pytest.raises(CommandError, match="holds other files; pass --replace"):
        call_command("ship_drafter", drafter.slug, "--to", str(out))
    call_command("ship_drafter", drafter.slug, "--to", str(out), "--replace")
    assert (folder / "config.json").read_bytes() == (trained / "config.json").read_bytes()

    # The folder is the drafter it came from: setup registers nothing new.
    report = shipping.register_shipped_drafters(protocol, out)
    assert ([d.pk for d in report.present], report.registered, report.refused) == (
        [drafter.pk], [], [])

    # Only a drafter trained by a recipe ships.
    ngram = make_drafter(target, "plain ngram")
    with pytest.raises(CommandError, match="not trained by a recipe"):
        call_command("ship_drafter", ngram.slug, "--to", str(out))
    with pytest.raises(CommandError, match="no eagle drafter trained on demo-chat-1k"):
        call_command("ship_drafter", "--recipe", "eagle", "--data", "demo-chat-1k", "--to", str(out))


def test_the_repository_ships_its_folder_with_a_readme():
    from django.conf import settings

    root = Path(__file__).resolve().parent.parent / "drafters"
    assert (root / "README.md").is_file()
    assert Path(settings.SHIPPED_DRAFTERS_DIR) == root   # the default setting
    for folder in shipping.shipped_folders(root):   # any shipped drafter has its record
        assert shipping.read_training_record(folder)["recipe"]
