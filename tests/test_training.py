"""Baseline drafter recipes on the demo target with a few conversations: the shared data
(the target's own questions and answers, seeded; evaluation prompts refused), each recipe's
loss falling, its checkpoint passing the upload validation and loading in the reference
engine with greedy output identical to the target's, EAGLE and Medusa heads actually
proposing accepted tokens, resuming from a checkpoint, and the registered drafter.

The data are tiny (a few hundred tokens), so the heads are trained to overfit them: that a
head overfitted on a conversation proposes its continuation is what shows the engine feeds
the head the hidden states of the right positions.
"""
import io
import json
from pathlib import Path

import pytest
import torch
from django.core.management import call_command
from django.core.management.base import CommandError

from worker.checkpoint import TargetFacts, Upload, validate_checkpoint
from worker.methods import make_proposer
from worker.training import train_recipe
from worker.training.data import (GenerationSettings, TrainingDataError, check_not_evaluation,
                                  generate_conversations, read_dataset, text_sha256, write_dataset)

PROMPTS = [
    "Write a short poem about the sea.",
    "What is the capital of France? Answer in one sentence.",
    "Explain what a binary search does.",
    "Give me three tips for a good night's sleep.",
]
ANSWER_TOKENS = 40
METHOD = {"draft_model": "draft_model", "eagle": "eagle", "eagle_multistep": "eagle",
          "medusa": "medusa", "medusa_reduced_vocab": "medusa"}


# One torch thread for every test of this module (conftest.one_torch_thread).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def dataset(engine, tmp_path_factory):
    """Four conversations: the target's greedy answers to PROMPTS."""
    records, stats = generate_conversations(
        engine, GenerationSettings(n=len(PROMPTS), max_answer_tokens=ANSWER_TOKENS, batch_size=4),
        prompts=PROMPTS)
    path = tmp_path_factory.mktemp("data") / "conversations.jsonl"
    return path, write_dataset(records, path)


@pytest.fixture(scope="module")
def target(engine, demo_target_dir):
    """The engine's own target model, shared with the recipes (frozen there)."""
    return engine.model, json.loads((demo_target_dir / "config.json").read_text())


@pytest.fixture
def train(demo_target_dir, dataset, target):
    def run(name, out, steps, **kw):
        kw.setdefault("progress", False)
        return train_recipe(name, demo_target_dir, dataset[0], "t" * 64, out, steps=steps,
                            say=lambda m: None, target=target, **kw)
    return run


@pytest.fixture(scope="module")
def check_prompts(engine):
    """A training prompt and an unseen one, with the target's own greedy outputs."""
    ids = [engine.encode_chat(PROMPTS[1]), engine.encode_chat("Name a colour.")]
    return ids, [r.output_ids for r in engine.generate(ids, max_new_tokens=20)]


def test_one_generation_appends_to_a_folder_at_a_time_and_a_prefix_read_never_waits(
        engine, tmp_path, capfd):
    import threading

    from worker.hostlock import HostLock

    folder = tmp_path / "rounds"
    first, _ = generate_conversations(engine, GenerationSettings(n=2, max_answer_tokens=6,
                                                                 batch_size=1),
                                      prompts=PROMPTS, checkpoint=folder)
    done = {}
    more = threading.Thread(target=lambda: done.setdefault("more", generate_conversations(
        engine, GenerationSettings(n=3, max_answer_tokens=6, batch_size=1), prompts=PROMPTS,
        checkpoint=folder)))
    with HostLock(folder / "writer.lock", log=lambda m: None, what="another generation"):
        more.start()
        more.join(timeout=2)
        assert more.is_alive() and "more" not in done   # waits for the generation holding it
        assert "waiting for the generation lock" in capfd.readouterr().err
        fewer, _ = generate_conversations(   # a smaller size reads without the lock
            engine, GenerationSettings(n=1, max_answer_tokens=6, batch_size=1),
            prompts=PROMPTS, checkpoint=folder)
        assert fewer == first[:1]
    more.join(timeout=120)
    records, stats = done["more"]
    assert records[:2] == first and len(records) == 3 and stats["resumed_at"] == 2


def test_the_target_writes_seeded_distinct_questions_and_answers_them(engine):
    # One batch of 8 samples usually holds 2 finished questions: one round of sampling.
    settings = GenerationSettings(n=2, seed=3, max_question_tokens=48, max_answer_tokens=4,
                                  batch_size=8)
    records, stats = generate_conversations(engine, settings)
    assert len(records) == 2 and stats["questions_sampled"] >= 2
    assert len({text_sha256(r["user"]) for r in records}) == 2  # deduplicated
    for r in records:
        assert r["source"] == "generated" and r["user"].strip()
        # The prompt is the chat template around the question; the answer follows it.
        assert r["input_ids"][:r["prompt_len"]] == engine.encode_chat(r["user"])
        assert 0 < len(r["input_ids"]) - r["prompt_len"] <= 4
    again, _ = generate_conversations(engine, settings)
    assert [r["user"] for r in again] == [r["user"] for r in records]  # seeded


def test_question_starts_open_the_questions_the_target_writes(engine):
    starts = ("Implement a function in Python that", "Explain how")
    settings = GenerationSettings(n=4, seed=3, max_question_tokens=48, max_answer_tokens=4,
                                  batch_size=8, question_starts=starts)
    records, _ = generate_conversations(engine, settings)
    assert len(records) == 4 and all(r["user"].startswith(starts) for r in records)
    assert {r["user"].split(" ")[0] for r in records} == {"Implement", "Explain"}  # in turn
    for r in records:  # the whole question, opening included, is what the answer follows
        assert r["input_ids"][:r["prompt_len"]] == engine.encode_chat(r["user"])
    # Without starts the settings are what they were before starts existed (the key of
    # the shipped rounds), with them they differ.
    assert "question_starts" not in GenerationSettings(n=4).to_dict()
    assert settings.to_dict()["question_starts"] == list(starts)
    with pytest.raises(TrainingDataError, match="question starts"):
        generate_conversations(engine, settings, prompts=PROMPTS)


def test_generation_resumes_after_its_last_round_and_larger_n_extends_it(engine, tmp_path):
    settings = GenerationSettings(n=2, max_answer_tokens=6, batch_size=1)
    alone, _ = generate_conversations(engine, GenerationSettings(n=3, max_answer_tokens=6,
                                                                 batch_size=1), prompts=PROMPTS)
    folder = tmp_path / "rounds"
    first, stats = generate_conversations(engine, settings, prompts=PROMPTS, checkpoint=folder)
    assert len(first) == 2 and stats["resumed_at"] is None
    # A round written after the last state (a crash between the two) is done again.
    with open(folder / "rounds.jsonl", "a") as f:
        f.write(json.dumps({**first[0], "id": 2, "assistant": "half-written"}) + "\n")
    more, stats = generate_conversations(engine, GenerationSettings(n=3, max_answer_tokens=6,
                                                                    batch_size=1),
                                         prompts=PROMPTS, checkpoint=folder)
    assert stats["resumed_at"] == 2 and more[:2] == first
    assert [r["input_ids"] for r in more] == [r["input_ids"] for r in alone]
    assert "half-written" not in (folder / "rounds.jsonl").read_text().split("\n", 3)[2]
    # A smaller n is the first conversations of the same generation; nothing is generated.
    fewer, stats = generate_conversations(
        engine, GenerationSettings(n=1, max_answer_tokens=6, batch_size=1), prompts=PROMPTS,
        checkpoint=folder)
    assert fewer == first[:1] and stats["prefix_of"] == 3
    # A prefix read while a larger generation appends its next round (written, its state
    # not yet) reads around that round and leaves the file to the writer.
    with open(folder / "rounds.jsonl", "a") as f:
        f.write(json.dumps({**first[0], "id": 3, "assistant": "being appended"}) + "\n")
    on_disk = (folder / "rounds.jsonl").read_text()
    fewer, _ = generate_conversations(
        engine, GenerationSettings(n=2, max_answer_tokens=6, batch_size=1), prompts=PROMPTS,
        checkpoint=folder)
    assert fewer == first and (folder / "rounds.jsonl").read_text() == on_disk
    with pytest.raises(TrainingDataError, match="other settings"):
        generate_conversations(engine, GenerationSettings(n=2, max_answer_tokens=7, batch_size=1),
                               prompts=PROMPTS, checkpoint=folder)


def test_reduced_vocabulary_heads_draft_only_the_most_frequent_answer_tokens(train, engine,
                                                                           dataset, tmp_path):
    from worker.heads import MedusaHeads
    from worker.training.data import read_dataset

    summary = train("medusa_reduced_vocab", tmp_path / "m", 30, lr=2e-3,
                    options={"draft_vocab": 40})
    heads = MedusaHeads.from_pretrained(summary["drafter_dir"])
    config = json.loads((Path(summary["drafter_dir"]) / "config.json").read_text())
    assert config["truncated_vocab_size"] == 40 and config["vocab_size"] == 49152
    assert heads.lm_head.weight.shape[0] == 40 and len(heads.token_map) == 40
    # The 40 ids are the answers' most frequent tokens; their share is reported.
    answers = [t for r in read_dataset(dataset[0]) for t in r["input_ids"][r["prompt_len"]:]]
    counts = torch.bincount(torch.tensor(answers), minlength=49152)
    assert counts[heads.token_map].min() >= counts.sort(descending=True).values[39]
    covered = float(counts[heads.token_map].sum()) / len(answers)
    assert summary["options"]["answer_token_coverage"] == pytest.approx(covered, abs=1e-4)
    assert 0 < covered < 1
    ids = [engine.encode_chat(PROMPTS[1])]
    out = engine.generate(ids, proposer=make_proposer("medusa", summary["drafter_dir"]), k=3,
                          max_new_tokens=16)
    drafted = [t for s in out[0].steps for t in s.drafted]
    assert drafted and set(drafted) <= set(heads.token_map.tolist())


def test_held_out_conversations_are_not_trained_on_and_measure_over_fitting(
        train, engine, dataset, demo_target_dir, target, tmp_path):
    from worker.heads import MedusaHeads
    from worker.training.data import load_training_data

    # The split shares the hidden states: a held-out conversation's batch is the same as
    # in the whole data.
    data = load_training_data(dataset[0], target[0], "t" * 64)
    kept, held = data.split(1)
    assert (len(kept), len(held)) == (3, 1) and kept.tokens + held.tokens == data.tokens
    for key in ("ids", "hidden", "prompt_lens"):
        assert torch.equal(held.batch([0])[key], data.batch([3])[key])
    with pytest.raises(TrainingDataError, match="cannot hold out 4 of 4"):
        data.split(4)

    summary = train("medusa_reduced_vocab", tmp_path / "m", 50, lr=2e-3, heldout=1,
                    options={"draft_vocab": 40})
    assert summary["settings"]["heldout"] == 1
    # Overfitted on three conversations, the heads draft them far better than the unseen one.
    assert summary["train_sample_top1"] > summary["heldout_top1"] + 0.2, summary
    # The reduced vocabulary is chosen from the trained conversations only.
    records = read_dataset(dataset[0])
    trained_answers = {t for r in records[:3] for t in r["input_ids"][r["prompt_len"]:]}
    heads = MedusaHeads.from_pretrained(summary["drafter_dir"])
    assert set(heads.token_map.tolist()) <= trained_answers


def test_evaluation_prompts_are_refused_by_hash():
    forbidden = {text_sha256("What is 2+2?"): "mt-bench#81 (turn 1)"}
    check_not_evaluation(["What is 3+3?"], forbidden)
    with pytest.raises(TrainingDataError, match=r"prompt 2 .*what is 2\+2\?.*mt-bench#81"):
        check_not_evaluation(["Hello there", "  what is   2+2?  "], forbidden)


@pytest.mark.parametrize("recipe,steps", [("draft_model", 8), ("eagle", 50),
                                          ("eagle_multistep", 12), ("medusa", 50),
                                          ("medusa_reduced_vocab", 50)])
def test_recipe_loss_falls_and_checkpoint_loads_losslessly(recipe, steps, demo_target_dir, train,
                                                           engine, check_prompts, tmp_path):
    summary = train(recipe, tmp_path / recipe, steps, lr=2e-3 if recipe != "draft_model" else None)
    assert summary["finished"] and summary["steps"] == steps
    assert summary["final_loss"] < 0.8 * summary["first_loss"], summary
    assert 0 <= summary["final_top1"] <= 1, summary
    folder = Path(summary["drafter_dir"])
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    uploads = [Upload(p.name, p, p.stat().st_size) for p in sorted(folder.iterdir())]
    with validate_checkpoint(uploads, METHOD[recipe], TargetFacts.from_config(demo_target_dir),
                             max_total_bytes=1 << 30) as ckpt:
        assert ckpt.parameter_count > 0
    # Greedy speculative decoding with the trained drafter equals the target's own output,
    # on a training prompt and on an unseen one, in one batch.
    ids, plain = check_prompts
    results = engine.generate(ids, proposer=make_proposer(METHOD[recipe], str(folder)), k=3,
                              max_new_tokens=20)
    assert [r.output_ids for r in results] == plain
    drafted = [s for s in results[0].steps if s.drafted]
    assert drafted  # it proposed
    if recipe in ("eagle", "medusa", "medusa_reduced_vocab"):
        # Overfitted on this conversation, the head proposes its continuation: acceptance
        # well above 1 means it reads the hidden states of the right positions.
        al = 1 + sum(s.accepted for s in drafted) / len(drafted)
        assert al > 1.8, al
        # and on its training data its first token mostly matches the target's
        assert summary["final_top1"] > 0.5, summary


def test_hidden_layers_are_the_residual_stream_after_that_many_layers(target):
    from worker.llama import rope_tables
    from worker.heads import layer_train

    model, _ = target
    ids = torch.tensor([[1, 504, 3458, 28, 2]])
    n, width = model.config.num_layers, model.config.hidden_size
    _, last = model(ids, model.new_cache(1, 8), return_hidden=True)
    logits, aux = model(ids, model.new_cache(1, 8), return_hidden=True, hidden_layers=(0, 1, n))
    assert aux.shape == (1, 5, 3 * width)
    embeds = model.embed_tokens(ids)
    assert torch.equal(aux[..., :width], embeds)
    cos, signed_sin = rope_tables(model.inv_freq, torch.arange(5)[None], embeds.dtype)
    after_one, _ = layer_train(model.layers[0], embeds, cos, signed_sin)
    assert torch.allclose(aux[..., width:2 * width], after_one, atol=1e-4)
    assert torch.allclose(model.norm(aux[..., 2 * width:]), last, atol=1e-5)
    assert torch.allclose(logits, model.logits(last))   # the logits are the model's own


def test_eagle3_head_learns_from_three_layers_over_a_reduced_vocabulary(
        train, dataset, demo_target_dir, tmp_path):
    from safetensors.torch import load_file

    summary = train("eagle3", tmp_path / "e3", 40, lr=3e-3, options={"draft_vocab": 300})
    assert summary["final_loss"] < 0.8 * summary["first_loss"], summary
    assert summary["final_top1"] > 0.5, summary
    assert summary["options"]["feature_layers"] == [2, 15, 27]
    folder = Path(summary["drafter_dir"])
    uploads = [Upload(p.name, p, p.stat().st_size) for p in sorted(folder.iterdir())]
    with validate_checkpoint(uploads, "eagle3", TargetFacts.from_config(demo_target_dir),
                             max_total_bytes=1 << 30) as ckpt:
        assert ckpt.parameter_count > 0
    # The draft vocabulary is the data's most frequent answer tokens, mapped by d2t.
    records = read_dataset(dataset[0])
    answers = torch.cat([torch.tensor(r["input_ids"][r["prompt_len"]:]) for r in records])
    counts = torch.bincount(answers)
    config = json.loads((folder / "config.json").read_text())
    size = config["draft_vocab_size"]
    assert size == min(300, int((counts > 0).sum()))
    tensors = load_file(str(folder / "model.safetensors"))
    target_ids = torch.arange(size) + tensors["d2t"]
    assert tensors["lm_head.weight"].shape[0] == size
    assert set(target_ids.tolist()) == set(torch.argsort(counts, descending=True,
                                                         stable=True)[:size].tolist())
    assert summary["options"]["answer_token_coverage"] == pytest.approx(
        float(counts[target_ids].sum() / counts.sum()), abs=1e-4)


def test_trained_heads_sample_at_temperature(train, engine, tmp_path):
    summary = train("eagle", tmp_path / "e", 4)
    ids = [engine.encode_chat(PROMPTS[0])]
    proposer = make_proposer("eagle", summary["drafter_dir"])
    out = engine.generate(ids, proposer=proposer, k=3, max_new_tokens=12, temperature=0.8, seed=5)
    assert len(out[0].output_ids) == 12
    assert all(s.accepted <= len(s.drafted) for s in out[0].steps)


def test_resume_continues_exactly_where_the_checkpoint_stopped(train, tmp_path):
    train("eagle_multistep", tmp_path / "whole", 4)
    part = train("eagle_multistep", tmp_path / "part", 4, stop_after_steps=2)
    assert not part["finished"] and part["steps"] == 2
    resumed = train("eagle_multistep", tmp_path / "part", 4, resume=True)
    assert resumed["finished"] and resumed["steps"] == 4
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "whole" / "drafter" / "model.safetensors"))
    b = load_file(str(tmp_path / "part" / "drafter" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name].float(), b[name].float(), atol=2e-2, rtol=0)
    assert json.loads((tmp_path / "part" / "training.json").read_text())["steps"] == 4
    # Another seed is another run: resuming it from this checkpoint is refused.
    from worker.training import ResumeError

    with pytest.raises(ResumeError, match="seed"):
        train("eagle_multistep", tmp_path / "part", 4, resume=True, seed=1)


# ---- Django: commands, evaluation prompts, registration ---------------------------------

@pytest.fixture
def site(settings, tmp_path, demo_target_dir):
    from leaderboard.services import setup

    from .factories import make_protocol, make_prompt_set

    settings.DATA_DIR = tmp_path / "data"
    target, _ = setup.ensure_target("smollm2", "SmolLM2-135M-Instruct", demo_target_dir)
    prompt_set = make_prompt_set("eval-set", categories=("writing",), per_category=3)
    prompt_set.prompts.create(external_id="q-7", position=9, category="writing",
                              turns=["Write a short poem about the sea.", "Now shorter."])
    protocol = make_protocol(target, slug="train-test", hardware="cpu", prompt_set=prompt_set)
    return target, protocol


def write_prompts(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


@pytest.mark.django_db
def test_make_training_data_refuses_an_evaluation_prompt(site, tmp_path):
    from leaderboard.models import TrainingDataset

    file = write_prompts(tmp_path / "p.jsonl", ["Tell me a joke.", "write a short poem  about the SEA."])
    with pytest.raises(CommandError, match=r"prompt 2 .*eval-set#q-7 \(turn 1 of protocol train-test v1\)"):
        call_command("make_training_data", "--target", "smollm2", "--n", "2", "--prompts", str(file))
    assert not TrainingDataset.objects.exists()
    with pytest.raises(CommandError, match="no target 'nope'"):
        call_command("make_training_data", "--target", "nope", "--n", "2")


@pytest.mark.django_db
def test_trained_drafter_is_registered_with_its_recipe_and_queued(site, tmp_path, capsys):
    from leaderboard.models import Drafter, Run, TrainingDataset
    from leaderboard.selectors import drafters

    target, protocol = site
    file = write_prompts(tmp_path / "p.jsonl", PROMPTS[1:3])
    call_command("make_training_data", "--target", "smollm2", "--n", "2", "--prompts", str(file),
                 "--max-answer-tokens", "24", "--slug", "tiny-chat", "--engine", "reference")
    data = TrainingDataset.objects.get(slug="tiny-chat")
    assert (data.version, data.n, data.target) == (1, 2, target)
    local = Path(settings_media(data.path))
    assert local.is_file() and len(read_dataset(local)) == 2
    # The protocol measures k = 2 and 4: 3 heads cannot propose 4 tokens, refused up front.
    with pytest.raises(CommandError, match=r"measures k up to 4, but 3 Medusa heads .*--heads 4"):
        call_command("train_drafter", "--recipe", "medusa", "--target", "smollm2", "--data",
                     "tiny-chat", "--protocol", "train-test", "--heads", "3", "--no-progress")
    assert not Drafter.objects.exists()
    call_command("train_drafter", "--recipe", "medusa", "--target", "smollm2", "--data", "tiny-chat",
                 "--protocol", "train-test", "--seed", "7", "--steps", "5", "--no-progress")
    drafter = Drafter.objects.get(trained_by_recipe="medusa")
    assert drafter.method == "medusa" and drafter.owner is None
    assert drafter.training_details["options"]["heads"] == 4   # one per token of the largest k
    assert (drafter.training_data, drafter.training_data_sha256, drafter.training_seed) == (
        data, data.sha256, 7)
    assert drafter.training_seconds > 0 and drafter.training_details["steps"] == 5
    assert sorted(drafter.files.values_list("name", flat=True)) == ["config.json", "model.safetensors"]
    run = Run.objects.get(drafter=drafter)
    assert run.state == Run.QUEUED and run.protocol == protocol
    summary = drafters.drafter_api_summary(drafter)
    assert summary["training"]["recipe"] == "medusa" and summary["training"]["seed"] == 7
    assert summary["training"]["data_sha256"] == data.sha256
    from django.test import Client

    page = Client().get(f"/drafters/{drafter.slug}/").content.decode()
    assert "trained by recipe <code>medusa</code>" in page and data.sha256[:12] in page
    # Once registered, the same recipe, data and seed are skipped when asked to.
    capsys.readouterr()
    call_command("train_drafter", "--recipe", "medusa", "--target", "smollm2", "--data", "tiny-chat",
                 "--seed", "7", "--skip-existing")
    out = capsys.readouterr().out
    assert "already registered" in out and "queued" not in out
    assert Drafter.objects.filter(trained_by_recipe="medusa").count() == 1
    assert Run.objects.filter(drafter=drafter).count() == 1
    # Skipped under another protocol (a learning curve's), it is queued there, once.
    from leaderboard.models import PromptSet

    from .factories import make_protocol

    curve = make_protocol(target, slug="curve-test", hardware="cpu",
                          prompt_set=PromptSet.objects.get(slug="eval-set"), baseline="paired")
    for _ in range(2):
        call_command("train_drafter", "--recipe", "medusa", "--target", "smollm2", "--data",
                     "tiny-chat", "--seed", "7", "--skip-existing", "--protocol", "curve-test")
    (queued,) = Run.objects.filter(drafter=drafter, protocol=curve)
    assert queued.state == Run.QUEUED
    assert capsys.readouterr().out.count(f"run {queued.pk} queued under {curve}") == 1
    assert Run.objects.filter(drafter=drafter).count() == 2


@pytest.mark.django_db
def test_shipped_rounds_are_continued_instead_of_written_again(site, settings, tmp_path):
    import gzip
    import shutil

    from leaderboard.models import TrainingDataset

    file = write_prompts(tmp_path / "p.jsonl", PROMPTS[1:3])
    args = ["make_training_data", "--target", "smollm2", "--prompts", str(file),
            "--max-answer-tokens", "8", "--engine", "reference"]
    call_command(*args, "--n", "2", "--slug", "written")
    written = read_dataset(settings_media(TrainingDataset.objects.get(slug="written").path))
    # Ship those rounds (gzipped, as training-data/rounds/ holds them) and forget them here.
    kept = settings.DATA_DIR / "training" / "rounds"
    (folder,) = kept.iterdir()
    settings.SHIPPED_ROUNDS_DIR = tmp_path / "shipped"
    shipped = settings.SHIPPED_ROUNDS_DIR / folder.name
    shipped.mkdir(parents=True)
    with open(folder / "rounds.jsonl", "rb") as src, gzip.open(shipped / "rounds.jsonl.gz", "wb") as out:
        shutil.copyfileobj(src, out)
    shutil.copyfile(folder / "state.json", shipped / "state.json")
    shutil.rmtree(kept)
    said = io.StringIO()
    call_command(*args, "--n", "1", "--slug", "from-shipped", stderr=said)
    assert "2 conversations of these settings are kept" in said.getvalue()
    assert "taking the first 1" in said.getvalue()
    row = TrainingDataset.objects.get(slug="from-shipped")
    assert read_dataset(settings_media(row.path)) == written[:1]
    assert row.params["stats"]["prefix_of"] == 2   # taken from the shipped rounds, not written
    assert (kept / folder.name / "rounds.jsonl").is_file()


@pytest.mark.django_db
def test_mixed_training_data_interleaves_its_parts_and_drops_repeats(site, tmp_path, capsys):
    from leaderboard.models import PromptSet, TrainingDataset

    first = ["Tell me a joke.", "Name three rivers.", "What is two plus two?"]
    args = ["make_training_data", "--target", "smollm2", "--max-answer-tokens", "8",
            "--engine", "reference"]
    call_command(*args, "--n", "3", "--slug", "part-a",
                 "--prompts", str(write_prompts(tmp_path / "a.jsonl", first)))
    call_command(*args, "--n", "2", "--slug", "part-b", "--prompts",
                 str(write_prompts(tmp_path / "b.jsonl", ["Say hello.", "tell me a  JOKE."])))
    a, b = (TrainingDataset.objects.get(slug=s) for s in ("part-a", "part-b"))
    # A prompt set that came after the data were written: the mix drops its prompt.
    PromptSet.objects.get(slug="eval-set").prompts.create(
        external_id="q-8", position=10, category="writing", turns=[first[1]])
    for bad, message in [(["part-a"], "at least two"), (["part-a", "part-a"], "named twice"),
                         (["part-a", "nope"], "no training data 'nope'")]:
        with pytest.raises(CommandError, match=message):
            call_command("mix_training_data", *bad, "--slug", "mixed")
    with pytest.raises(CommandError, match="one of the parts"):
        call_command("mix_training_data", "part-a", "part-b", "--slug", "part-b")
    assert TrainingDataset.objects.count() == 2
    call_command("mix_training_data", "part-a", "part-b@1", "--slug", "mixed")
    assert "3 conversations (3 of part-a v1, 2 of part-b v1; 1 duplicates and 1 evaluation " \
        "prompts dropped)" in capsys.readouterr().out
    mix = TrainingDataset.objects.get(slug="mixed")
    records = read_dataset(settings_media(mix.path))
    # In proportion: a0 (1/6), b0 (1/4), a1 (1/2, now an evaluation prompt), b1 (3/4, a0's
    # question again), a2 (5/6).
    assert [r["mixed_from"] for r in records] == ["part-a v1 #0", "part-b v1 #0", "part-a v1 #2"]
    assert [r["id"] for r in records] == [0, 1, 2]
    parts = {p.slug: read_dataset(settings_media(p.path)) for p in (a, b)}
    assert records[1]["input_ids"] == parts["part-b"][0]["input_ids"]
    assert (mix.n, mix.target, mix.source) == (3, a.target, "mix of part-a v1, part-b v1")
    assert mix.tokens == sum(len(r["input_ids"]) for r in records)
    stats = mix.params["stats"]
    assert [(p["slug"], p["sha256"]) for p in stats["parts"]] == [
        ("part-a", a.sha256), ("part-b", b.sha256)]
    assert stats["seconds"] == round(a.params["stats"]["seconds"] + b.params["stats"]["seconds"], 1)
    call_command("mix_training_data", "part-a", "part-b", "--slug", "mixed")
    assert "already present" in capsys.readouterr().out
    assert TrainingDataset.objects.filter(slug="mixed").count() == 1


def test_shipped_rounds_are_copied_under_the_generation_lock(settings, tmp_path):
    import gzip
    import threading

    from leaderboard.services.training import copy_shipped_rounds
    from worker.training.data import generation_lock

    settings.SHIPPED_ROUNDS_DIR = tmp_path / "shipped"
    (settings.SHIPPED_ROUNDS_DIR / "k").mkdir(parents=True)
    with gzip.open(settings.SHIPPED_ROUNDS_DIR / "k" / "rounds.jsonl.gz", "wt") as f:
        f.write('{"shipped": 1}\n')
    (settings.SHIPPED_ROUNDS_DIR / "k" / "state.json").write_text('{"records": 1}')
    folder, done = tmp_path / "kept" / "k", {}
    copy = threading.Thread(target=lambda: done.setdefault("copied", copy_shipped_rounds("k", folder)))
    with generation_lock(folder, "another generation"):
        copy.start()
        copy.join(timeout=2)
        assert copy.is_alive()   # waits for the generation holding the folder
        # ... which writes rounds of its own meanwhile: the copy must not replace them.
        (folder / "rounds.jsonl").write_text('{"mine": 1}\n')
        (folder / "state.json").write_text('{"records": 1}')
    copy.join(timeout=30)
    assert done == {"copied": False}
    assert (folder / "rounds.jsonl").read_text() == '{"mine": 1}\n'
    other = tmp_path / "kept" / "other"
    assert copy_shipped_rounds("k", other) is True
    assert (other / "rounds.jsonl").read_text() == '{"shipped": 1}\n'
    assert sorted(p.name for p in other.iterdir()) == ["rounds.jsonl", "state.json", "writer.lock"]


def settings_media(name):
    from django.core.files.storage import default_storage

    return default_storage.path(name)


def test_every_json_lines_reader_names_the_file_and_line_of_a_bad_line(tmp_path):
    """Prompts files and training datasets go through one reader (data.json_lines): blank
    lines are skipped, a line that is not JSON is refused with its file and line number."""
    from worker.training.data import read_prompts_file

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"first"\n\n{"turns": ["second"]}\n')
    assert read_prompts_file(prompts) == ["first", "second"]
    prompts.write_text('"first"\n\n{"turns": ["second"\n')
    with pytest.raises(TrainingDataError, match=r"prompts\.jsonl, line 3: not JSON"):
        read_prompts_file(prompts)
    dataset = tmp_path / "data.jsonl"
    dataset.write_text(json.dumps({"input_ids": [1, 2, 3], "prompt_len": 1}) + "\n{oops\n")
    with pytest.raises(TrainingDataError, match=r"data\.jsonl, line 2: not JSON"):
        read_dataset(dataset)


def test_the_makefiles_recipe_lists_name_the_registrys_recipes():
    """worker.training.recipes.RECIPES is the one list of recipes (train_drafter's choices,
    each recipe's default steps and options): the Makefile's lists may not drift from it."""
    import re

    from worker.training.recipes import RECIPES

    makefile = (Path(__file__).resolve().parent.parent / "Makefile").read_text()
    curve = re.search(r"^CURVE_RECIPES \?= (.+)$", makefile, re.M).group(1).split()
    assert sorted(curve) == sorted(RECIPES)
    demo = re.search(r"^DEMO_DRAFTERS \?= (.+)$", makefile, re.M).group(1).split()
    assert demo and {entry.split(":")[0] for entry in demo} <= set(RECIPES)
