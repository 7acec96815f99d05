"""The formats drafter authors publish (worker/checkpoint/formats.py), each built by
tests/published_formats.py with the published config keys, file names and tensor names
around tiny random weights: accepted as vLLM loads them, converted where they are pickles
(in the sandbox, worker/sandbox.py), their extras dropped with a note; and the content hash
over tensors and config that a reformatted copy cannot evade."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from worker.checkpoint import TargetFacts, checkpoint_content_sha256
from worker.checkpoint.convert import convert_weights
from worker.sandbox import Limits

from . import published_formats as pf
from .test_checkpoint_validation import accept, find, reject, work, write_files  # noqa: F401 (work: a fixture)

TINY = TargetFacts(vocab_size=64, hidden_size=16, num_layers=4, name="tiny-target")


def _eagle3_source(folder, hidden=16):
    g = torch.Generator().manual_seed(3)
    r = (lambda *shape: torch.randn(*shape, generator=g).bfloat16())
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              "hidden_size": hidden, "intermediate_size": 32, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 64,
              "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "draft_vocab_size": 32, "target_hidden_size": 16,
              "eagle_aux_hidden_state_layer_ids": [0, 1, 3]}
    tensors = {"d2t": torch.arange(32, dtype=torch.int64), "fc.weight": r(hidden, 3 * hidden),
               "lm_head.weight": r(32, hidden), "norm.weight": r(hidden),
               "midlayer.hidden_norm.weight": r(hidden),
               "midlayer.input_layernorm.weight": r(hidden),
               "midlayer.self_attn.q_proj.weight": r(hidden, 2 * hidden),
               "midlayer.mlp.down_proj.weight": r(hidden, 32)}
    return _write(folder, config, tensors)


def _medusa_source(folder, heads=3):
    g = torch.Generator().manual_seed(4)
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": 16,
              "vocab_size": 64, "num_heads": heads, "num_hidden_layers": 1,
              "original_lm_head": True}
    tensors = {f"blocks.{h}.layers.0.weight": torch.randn(16, 16, generator=g).bfloat16()
               for h in range(heads)}
    tensors["lm_head.weight"] = torch.randn(64, 16, generator=g).bfloat16()
    return _write(folder, config, tensors)


def _write(folder, config, tensors):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, folder / "model.safetensors")
    return folder


def test_a_speculators_checkpoint_is_read_as_vllm_reads_it(tmp_path, work):
    src = _eagle3_source(tmp_path / "src")
    ups = pf.speculators_eagle3(src, tmp_path / "spec", verifier="someone/tiny-target")
    with accept(ups, "eagle3", TINY, work=work) as ckpt:
        assert [f.name for f in ckpt.files] == ["config.json", "model.safetensors"]
        stored = json.loads(ckpt.file("config.json").path.read_text())
        assert "auto_map" not in stored and stored["speculators_model_type"] == "eagle3"
        intake = ckpt.intake
        assert intake["format"] == "speculators" and intake["verifier"] == "someone/tiny-target"
        notes = " ".join(intake["notes"])
        assert "auto_map removed" in notes and "eagle3.py" in notes
        assert "README.md" in notes and ".gitattributes" in notes and "warning" not in notes
    # The sizes are those of transformer_layer_config, checked by the method's own rules.
    cfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    cfg["transformer_layer_config"].update(vocab_size=65, num_attention_heads=5)
    (tmp_path / "spec" / "config.json").write_text(json.dumps(cfg))
    problems = reject(pf.uploads(tmp_path / "spec"), "eagle3", TINY, work=work)
    find(problems, field="vocab_size", text="65 differs")
    find(problems, field="num_attention_heads", text="does not divide")


def test_a_speculators_checkpoint_names_its_method_and_its_verifier(tmp_path, work):
    src = _eagle3_source(tmp_path / "src")
    ups = pf.speculators_eagle3(src, tmp_path / "spec", verifier="meta-llama/Llama-3.1-8B")
    find(reject(ups, "eagle", TINY, work=work), field="speculators_model_type",
         text="choose the method eagle3")
    with accept(ups, "eagle3", TINY, work=work) as ckpt:
        assert any("warning" in n and "Llama-3.1-8B" in n for n in ckpt.intake["notes"])
    cfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    # A method vLLM 0.32 has and SpecBoard lacks (DSpark, which only Model Runner V2
    # runs) is refused by name.
    dspark = dict(cfg, speculators_model_type="dspark", mask_token_id=0,
                  aux_hidden_state_layer_ids=[1, 2])
    (tmp_path / "spec" / "config.json").write_text(json.dumps(dspark))
    find(reject(pf.uploads(tmp_path / "spec"), "eagle3", TINY, work=work),
         field="speculators_model_type", text="SpecBoard does not measure yet")
    cfg["speculators_model_type"] = "eagle"   # not one vLLM 0.32 reads
    (tmp_path / "spec" / "config.json").write_text(json.dumps(cfg))
    find(reject(pf.uploads(tmp_path / "spec"), "eagle3", TINY, work=work), field="speculators_config",
         text="not one this vLLM loads")


def _dflash_source(folder, **changes):
    pf.dflash_zlab(folder, hidden=16, vocab=64, target_layer_ids=[0, 1, 3], intermediate=32)
    if changes:
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(changes)
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_a_dflash_drafter_is_taken_as_z_lab_and_speculators_publish_it(tmp_path, work):
    src = _dflash_source(tmp_path / "zlab")
    with accept(pf.uploads(src), "dflash", TINY, work=work) as ckpt:
        assert [f.name for f in ckpt.files] == ["config.json", "model.safetensors"]
    spec = pf.speculators_dflash(src, tmp_path / "spec", verifier="someone/tiny-target")
    with accept(spec, "dflash", TINY, work=work) as ckpt:
        assert ckpt.intake["format"] == "speculators"
    find(reject(spec, "eagle3", TINY, work=work), field="speculators_model_type",
         text="choose the method dflash")
    # its own rules: the mask token, target layers, the fc projection, no mask_hidden
    bad = _dflash_source(tmp_path / "bad", dflash_config={"mask_token_id": 64,
                                                          "target_layer_ids": [0, 4]})
    problems = reject(pf.uploads(bad), "dflash", TINY, work=work)
    find(problems, field="dflash_config.mask_token_id", text="0..63")
    find(problems, field="dflash_config.target_layer_ids", text="0..3")
    find(reject(pf.uploads(_dflash_source(tmp_path / "none", dflash_config=None)), "dflash",
                TINY, work=work), field="dflash_config", text="missing")
    tensors = load_file(src / "model.safetensors")
    save_file(dict(tensors, **{"fc.weight": tensors["fc.weight"][:, :32].contiguous(),
                               "mask_hidden": torch.zeros(1, 48)}),
              tmp_path / "zlab" / "model.safetensors")
    problems = reject(pf.uploads(src), "dflash", TINY, work=work)
    find(problems, field="fc.weight", text="[16, 48]")
    find(problems, field="mask_hidden", text="P-EAGLE")
    mixed = _dflash_source(tmp_path / "mixed", layer_types=["sliding_attention",
                                                            "full_attention"])
    find(reject(pf.uploads(mixed), "dflash", TINY, work=work), field="layer_types",
         text="Model Runner V2")


def test_a_p_eagle_head_is_taken_plain_and_as_speculators_publish_it(tmp_path, work):
    head = pf.peagle(_eagle3_source(tmp_path / "src"), tmp_path / "plain")
    with accept(head, "peagle", TINY, work=work):
        pass
    spec = pf.speculators_peagle(tmp_path / "plain", tmp_path / "spec", verifier="a/tiny-target")
    with accept(spec, "peagle", TINY, work=work) as ckpt:
        assert ckpt.intake["format"] == "speculators"
    find(reject(spec, "eagle3", TINY, work=work), field="speculators_model_type",
         text="choose the method peagle")
    # without its mask_hidden vLLM refuses to start; without a mask token, too
    cfg = json.loads((tmp_path / "plain" / "config.json").read_text())
    tensors = load_file(tmp_path / "plain" / "model.safetensors")
    del tensors["mask_hidden"], cfg["mask_token_id"]
    _write(tmp_path / "bare", cfg, tensors)
    problems = reject(pf.uploads(tmp_path / "bare"), "peagle", TINY, work=work)
    find(problems, field="mask_hidden", text="missing")
    find(problems, field="mask_token_id", text="missing")
    # P-EAGLE's registered names load only from the speculators format
    _write(tmp_path / "named", dict(cfg, architectures=["PeagleLlamaForCausalLM"]), tensors)
    find(reject(pf.uploads(tmp_path / "named"), "eagle3", TINY, work=work),
         field="architectures", text="PeagleLlamaForCausalLM")


def test_python_files_are_refused_outside_the_speculators_format(tmp_path, work):
    src = _eagle3_source(tmp_path / "src")
    ups = write_files(tmp_path / "c", {"modeling_eagle.py": b"import os\n"})
    ups += pf.safeailab_bin(src, tmp_path / "bin")
    find(reject(ups, "eagle3", TINY, work=work), field="extension", file="modeling_eagle.py",
         text="remote code")


def test_safeailab_pickle_is_converted_and_hashes_like_the_safetensors(tmp_path, work):
    src = _eagle3_source(tmp_path / "src")
    ups = pf.safeailab_bin(src, tmp_path / "bin")
    with accept(ups, "eagle3", TINY, work=work) as ckpt, \
            accept(write_files(tmp_path / "st", {"config.json": json.loads(
                (src / "config.json").read_text()), "model.safetensors": ("st", load_file(
                    src / "model.safetensors"))}), "eagle3", TINY, work=work) as plain:
        assert [f.name for f in ckpt.files] == ["config.json", "model.safetensors"]
        assert ckpt.intake["format"].startswith("pytorch_model.bin")
        assert ckpt.intake["converted_from"] == {"model.safetensors": "pytorch_model.bin"}
        converted = load_file(ckpt.file("model.safetensors").path)
        original = load_file(src / "model.safetensors")
        assert converted.keys() == original.keys()
        assert all(torch.equal(converted[k], original[k]) for k in original)
        assert ckpt.content_sha256 == plain.content_sha256


def test_fasterdecoding_medusa_gets_the_target_hidden_size_and_keeps_its_biases(tmp_path, work):
    src = _medusa_source(tmp_path / "src")
    pt = pf.fasterdecoding_medusa(src, tmp_path / "pt", ".pt", bias=True)
    st = pf.fasterdecoding_medusa(src, tmp_path / "st", ".safetensors", bias=True)
    with accept(pt, "medusa", TINY, work=work) as a, accept(st, "medusa", TINY, work=work) as b:
        assert [f.name for f in a.files] == ["config.json", "medusa_lm_head.safetensors"]
        stored = json.loads(a.file("config.json").path.read_text())
        assert stored["hidden_size"] == 16 and stored["medusa_fc_bias"] is True
        assert stored["medusa_num_heads"] == 3
        assert a.intake["format"] == "FasterDecoding Medusa"
        assert any("hidden_size 16 taken from the target" in n for n in a.intake["notes"])
        assert "0.0.linear.bias" in load_file(a.file("medusa_lm_head.safetensors").path)
        assert a.content_sha256 == b.content_sha256   # the same heads, pickled or not


def test_the_content_hash_covers_tensors_and_config_not_formatting(tmp_path):
    src = _eagle3_source(tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    base = checkpoint_content_sha256([src / "model.safetensors"], config)
    # Re-sharded, other metadata, reformatted config: the same drafter.
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[:3]}, tmp_path / "a.safetensors")
    save_file({k: tensors[k] for k in names[3:]}, tmp_path / "b.safetensors",
              metadata={"format": "pt", "note": "resharded"})
    assert checkpoint_content_sha256([tmp_path / "b.safetensors", tmp_path / "a.safetensors"],
                                     json.loads(json.dumps(config, indent=7))) == base
    # One changed value, one changed config field: another drafter.
    changed = dict(tensors, **{"norm.weight": tensors["norm.weight"] + 1})
    save_file(changed, tmp_path / "c.safetensors")
    assert checkpoint_content_sha256([tmp_path / "c.safetensors"], config) != base
    assert checkpoint_content_sha256([src / "model.safetensors"],
                                     dict(config, rms_norm_eps=1e-6)) != base


def test_the_converter_child_stays_inside_its_limits(tmp_path):
    torch.save({"w": torch.zeros(4)}, tmp_path / "w.bin")
    with pytest.raises(ValueError, match="memory allowed"):
        convert_weights(tmp_path / "w.bin", tmp_path / "out.safetensors",
                        Limits(address_space=200 << 20))
    with pytest.raises(ValueError, match="CPU seconds allowed"):
        convert_weights(tmp_path / "w.bin", tmp_path / "out.safetensors", Limits(cpu_seconds=1))
    with pytest.raises(ValueError, match="0.001 s allowed"):
        convert_weights(tmp_path / "w.bin", tmp_path / "out.safetensors",
                        Limits(wall_seconds=0.001))
    assert not (tmp_path / "out.safetensors").exists()
    assert convert_weights(tmp_path / "w.bin", tmp_path / "out.safetensors") == {"tensors": 1}
    assert torch.equal(load_file(tmp_path / "out.safetensors")["w"], torch.zeros(4))


# ------------------------------------------------------------------------------------
# through the site: stored converted, shown on the page and in the API, hashed by tensors


def _site_uploads(folder):
    from django.core.files.uploadedfile import SimpleUploadedFile

    return [SimpleUploadedFile(u.name, u.source.read_bytes()) for u in pf.uploads(folder)]


@pytest.mark.django_db
def test_a_safeailab_upload_is_stored_converted_and_says_so(client, tmp_path, media):
    from django.contrib.auth.models import User
    from django.urls import reverse

    from leaderboard.models import Drafter, Submission

    from . import factories as f
    from .test_submission import form_data

    user = User.objects.create_user("eagle-author", password="pw-submit-123")
    client.force_login(user)
    target = f.make_target(vocab_size=64, hidden_size=16, num_layers=4)
    protocol = f.make_protocol(target, hardware="formats-test", ks=(2,))
    pf.safeailab_bin(_eagle3_source(tmp_path / "src"), tmp_path / "bin")
    response = client.post(reverse("submit"), form_data(
        protocol, method="eagle3", name="eagle3 as published",
        files=_site_uploads(tmp_path / "bin")))
    assert response.status_code == 302, response.content.decode()[-2000:]
    assert f.submitted(response).state == Submission.ACCEPTED
    drafter = Drafter.objects.get()
    assert sorted(drafter.files.values_list("name", flat=True)) == ["config.json",
                                                                    "model.safetensors"]
    assert not [p for p in media.rglob("*") if p.suffix in (".bin", ".md")]
    html = client.get(reverse("drafter", args=[drafter.slug])).content.decode()
    assert "converted from <code>pytorch_model.bin</code>" in html and "README.md" in html
    api = client.get(f"/api/drafters/{drafter.slug}").json()["drafter"]
    assert api["intake"]["converted_from"] == {"model.safetensors": "pytorch_model.bin"}
    assert api["content_sha256"] == drafter.content_sha256

    # Rejected by staff, then sent again with one space added to config.json and its
    # weights as safetensors: the same tensors and config, refused.
    Drafter.objects.filter(pk=drafter.pk).update(review_state="rejected")
    again = tmp_path / "again"
    again.mkdir()
    (again / "config.json").write_text(" " + (tmp_path / "src" / "config.json").read_text())
    save_file(load_file(tmp_path / "src" / "model.safetensors"), again / "model.safetensors",
              metadata={"note": "re-saved"})
    response = client.post(reverse("submit"), form_data(
        protocol, method="eagle3", name="same eagle3", files=_site_uploads(again)))
    assert f.submitted(response).state == Submission.REFUSED
    assert "rejected" in client.get(response["Location"]).content.decode()
    assert Drafter.objects.count() == 1


# ------------------------------------------------------------------------------------
# the checks run in a child under limits, and a refused upload counts


def json_array_zip(path, mib=8):
    """A small zip whose config.json is a JSON array of ``mib`` MiB of floats: parsing it
    costs about 10 times that (the issue's 8 KiB zip of an 8 MiB array cost a web worker
    +190 MiB)."""
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("config.json", b"[" + b"0.5," * (mib << 18) + b"0]")
    return path


def test_a_hostile_upload_is_parsed_by_the_child_inside_its_limits(tmp_path, work):
    from worker.checkpoint import CheckpointRejected, Upload
    from worker.checkpoint.sandboxed import validate_in_sandbox

    bomb = json_array_zip(tmp_path / "drafter.zip", mib=48)  # under the 64 MiB JSON cap
    assert bomb.stat().st_size < 256 << 10
    with pytest.raises(CheckpointRejected) as info:
        validate_in_sandbox([Upload(bomb.name, bomb, bomb.stat().st_size)], "eagle3", TINY,
                            max_total_bytes=1 << 30, tmp_root=work,
                            limits=Limits(address_space=384 << 20))
    assert "needed more than the 0.375 GiB of memory allowed" in str(info.value)
    assert list(work.iterdir()) == []
    # With room to parse it, the same upload is refused for what it is, by the same rules.
    with pytest.raises(CheckpointRejected) as info:
        validate_in_sandbox([Upload(bomb.name, bomb, bomb.stat().st_size)], "eagle3", TINY,
                            max_total_bytes=1 << 30, tmp_root=work)
    find(info.value.problems, field="config.json", text="must be a JSON object")
    assert list(work.iterdir()) == []


@pytest.mark.django_db
def test_a_refused_upload_counts_toward_the_daily_limit(tmp_path, settings):
    from django.contrib.auth.models import User

    from leaderboard.models import Drafter, Submission
    from leaderboard.services import intake, submissions
    from worker.checkpoint import Upload

    from . import factories as f

    settings.SPECBOARD_SUBMISSIONS_PER_DAY = 2
    user = User.objects.create_user("repeater")
    target = f.make_target(vocab_size=64, hidden_size=16, num_layers=4)
    protocol = f.make_protocol(target, hardware="formats-test", ks=(2,))
    bomb = json_array_zip(tmp_path / "drafter.zip", mib=1)
    for _ in range(2):
        received = intake.receive(owner=user, protocol=protocol, method="eagle3", name="bomb",
                                  uploads=[Upload(bomb.name, bomb, None)], send=False)
        checked = intake.check(received.pk)
        assert checked.state == Submission.REFUSED
        find([submissions.Problem(**p) for p in checked.problems], field="config.json",
             text="JSON object")
    assert Submission.objects.filter(owner=user, state=Submission.REFUSED).count() == 2
    with pytest.raises(submissions.SubmissionRefused) as info:
        intake.receive(owner=user, protocol=protocol, method="eagle3", name="bomb",
                       uploads=[Upload(bomb.name, bomb, None)], send=False)
    assert info.value.problems[0].field == "rate limit"
    assert "refused ones and ones being checked included" in info.value.problems[0].message
    assert not Drafter.objects.exists() and Submission.objects.count() == 2
