"""Drafters by model-hub reference (worker/hub.py): huggingface_hub's own code against the
local stand-in hub (tests/hub_standin.py), started per test on its own port and folder,
reached through HF_ENDPOINT. The checkpoints are tiny safetensors files written here; the
stand-in's request log says what was, and was not, fetched."""
import json

import pytest
import torch
from safetensors.torch import save

from worker import hub
from worker.checkpoint import CheckpointRejected, TargetFacts, validate_checkpoint
from worker.checkpoint.names import extension_problem

from .hub_standin import StandinHub

TINY = TargetFacts(vocab_size=64, hidden_size=16, num_layers=4)
CAP = 1 << 20
REPO = "drafter-lab/tiny-draft"
TOKEN = "hf_granted_token"


# ------------------------------------------------------------------------------------
# helpers


def tiny_config(**over):
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=64,
               hidden_size=16, intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    cfg.update(over)
    return (json.dumps(cfg, indent=1) + "\n").encode()


def tiny_weights(seed=0, vocab=64, hidden=16, layers=2):
    g = torch.Generator().manual_seed(seed)
    t = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g).bfloat16(),
         "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(layers):
        t[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        t[f"model.layers.{i}.self_attn.q_proj.weight"] = \
            torch.randn(hidden, hidden, generator=g).bfloat16()
    return save(t)


def checkpoint(seed=0, **extra):
    files = {"config.json": tiny_config(), "model.safetensors": tiny_weights(seed),
             "README.md": b"# tiny draft\n", ".gitattributes": b"*.safetensors filter=lfs\n"}
    files.update(extra)
    return files


def on_disk(folder):
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


def rejected(call, *args, **kwargs):
    with pytest.raises(CheckpointRejected) as info:
        call(*args, **kwargs)
    return info.value.problems


@pytest.fixture
def standin(tmp_path, monkeypatch):
    """The stand-in on its own port and folder, named by HF_ENDPOINT; no implicit token
    or cache of this machine's can take part."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with StandinHub(tmp_path / "hub") as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server


@pytest.fixture
def dest(tmp_path):
    d = tmp_path / "download"
    d.mkdir()
    return d


# ------------------------------------------------------------------------------------
# the reference


@pytest.mark.parametrize("text, expected", [
    ("RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3",
     ("RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3", "main")),
    ("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B@v1.0", ("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "v1.0")),
    ("  a/b@refs/pr/3 ", ("a/b", "refs/pr/3")),
    ("a_1/b_2@" + "0123456789abcdef" * 2 + "01234567",
     ("a_1/b_2", "0123456789abcdef" * 2 + "01234567")),
    ("o/" + "n" * 96, ("o/" + "n" * 96, "main")),
])
def test_parse_reference_accepts_owner_name_and_a_revision(text, expected):
    assert hub.parse_reference(text) == expected


@pytest.mark.parametrize("text", [
    "", "   ", "tiny-draft", "a/b/c", "a--b/c", "a/b..c", "-a/b", "a/b.", "a/b-", "a/b.git",
    "a/" + "n" * 97, "a/b c", "a/b@", "a/b@../main", "a/b@x y", "a/b@main.lock", "a/b@/main",
    "a/b@x@y", "https://huggingface.co/a/b", "a/caf\u00e9",
])
def test_parse_reference_refuses_with_a_sentence(text):
    with pytest.raises(ValueError) as info:
        hub.parse_reference(text)
    message = str(info.value)
    assert len(message) > 30 and ("owner/name" in message or "revision" in message), message


# ------------------------------------------------------------------------------------
# revisions


def test_a_branch_resolves_to_its_commit_and_the_download_stays_at_that_commit(standin, dest):
    first = standin.publish(REPO, checkpoint(seed=0))
    ckpt = hub.inspect(REPO, "main", max_total_bytes=CAP)
    assert ckpt.commit == first and ckpt.revision == "main"
    assert ckpt.reference == f"{REPO}@{first}"
    assert [f.name for f in ckpt.files] == ["config.json", "model.safetensors"]

    second = standin.publish(REPO, checkpoint(seed=1))   # main moves on before the download
    assert second != first
    uploads = hub.download(ckpt, dest)

    assert on_disk(dest) == ["config.json", "model.safetensors"]
    assert (dest / "model.safetensors").read_bytes() == tiny_weights(seed=0)
    assert (dest / "model.safetensors").read_bytes() != tiny_weights(seed=1)
    fetched = [r for r in standin.requests if r.kind == "resolve" and r.method == "GET"
               and r.range is None]
    assert {r.file for r in fetched} == {"config.json", "model.safetensors"}
    assert {r.revision for r in fetched} == {first}
    assert [(u.name, u.size) for u in uploads[:2]] == [
        ("config.json", len(tiny_config())), ("model.safetensors", len(tiny_weights(seed=0)))]
    assert all(u.source == dest / u.name for u in uploads[:2])
    # the branch now names the later commit
    assert hub.inspect(REPO, "main", max_total_bytes=CAP).commit == second


def test_tag_and_full_commit_revisions(standin, dest):
    first = standin.publish(REPO, checkpoint(seed=0))
    standin.tag(REPO, "v1.0", first)
    second = standin.publish(REPO, checkpoint(seed=1))

    by_tag = hub.inspect(REPO, "v1.0", max_total_bytes=CAP)
    assert by_tag.commit == first
    by_sha = hub.inspect(REPO, second, max_total_bytes=CAP)
    assert by_sha.commit == second and by_sha.revision == second
    hub.download(by_tag, dest)
    assert (dest / "model.safetensors").read_bytes() == tiny_weights(seed=0)
    info = [r for r in standin.requests if r.kind == "info"]
    assert [r.revision for r in info] == ["v1.0", second]


# ------------------------------------------------------------------------------------
# refusals before anything is downloaded


def test_unknown_repository_is_refused(standin):
    standin.publish(REPO, checkpoint())
    problems = rejected(hub.inspect, "drafter-lab/no-such-draft", "main", max_total_bytes=CAP)
    assert [(p.file, p.field) for p in problems] == [("(hub)", "repository")]
    assert "drafter-lab/no-such-draft was not found" in problems[0].message
    assert hub.TOKEN_SETTING in problems[0].message          # a private one needs the token


def test_unknown_revision_is_refused(standin):
    standin.publish(REPO, checkpoint())
    for revision in ("no-such-branch", "f" * 40):
        problems = rejected(hub.inspect, REPO, revision, max_total_bytes=CAP)
        assert [(p.file, p.field) for p in problems] == [("(hub)", "revision")]
        assert f"revision {revision!r} does not exist in {REPO}" in problems[0].message


def test_gated_repository_refused_without_a_token_accepted_with_one(standin, dest):
    commit = standin.publish(REPO, checkpoint())
    standin.set_access(REPO, gated=True, tokens=(TOKEN,))

    for no_token in (None, ""):   # an empty setting is no token
        problems = rejected(hub.inspect, REPO, "main", token=no_token, max_total_bytes=CAP)
        assert [(p.file, p.field) for p in problems] == [("(hub)", "access")]
        assert "none configured" in problems[0].message
        assert hub.TOKEN_SETTING in problems[0].message
    assert not [r for r in standin.requests if r.kind == "resolve"]

    problems = rejected(hub.inspect, REPO, "main", token="hf_not_granted", max_total_bytes=CAP)
    assert [(p.file, p.field) for p in problems] == [("(hub)", "access")]
    assert "has not been granted access" in problems[0].message

    ckpt = hub.inspect(REPO, "main", token=TOKEN, max_total_bytes=CAP)
    assert ckpt.gated and ckpt.commit == commit
    assert TOKEN not in json.dumps(ckpt.as_dict()) and TOKEN not in repr(ckpt)
    hub.download(ckpt, dest)
    assert on_disk(dest) == ["config.json", "model.safetensors"]
    fetched = standin.gets(REPO, "config.json")
    assert fetched and all(r.authorization == f"Bearer {TOKEN}" for r in fetched)
    assert all(r.path.startswith(f"/{REPO}/resolve/{commit}/") for r in fetched)


def test_private_repository_is_read_only_with_its_token(standin, dest):
    standin.publish(REPO, checkpoint())
    standin.set_access(REPO, private=True, tokens=(TOKEN,))
    problems = rejected(hub.inspect, REPO, "main", max_total_bytes=CAP)
    assert [p.field for p in problems] == ["repository"]
    assert "private" in problems[0].message and hub.TOKEN_SETTING in problems[0].message
    ckpt = hub.inspect(REPO, "main", token=TOKEN, max_total_bytes=CAP)
    assert ckpt.private
    hub.download(ckpt, dest)
    assert on_disk(dest) == ["config.json", "model.safetensors"]


def test_a_file_over_the_cap_is_refused_before_any_byte_is_downloaded(standin, dest):
    big = save({"w": torch.zeros(512, 512)})                           # 1 MiB of F32
    standin.publish(REPO, checkpoint(**{"model.safetensors": big}))
    size = len(big)
    problems = rejected(hub.inspect, REPO, "main", max_total_bytes=size - 1)
    hit = [p for p in problems if p.file == "model.safetensors"]
    assert [p.field for p in hit] == ["size"] and f"{size} bytes" in hit[0].message
    assert "nothing was downloaded" in hit[0].message
    assert not [r for r in standin.requests if r.kind == "resolve"]   # not even its header
    assert on_disk(dest) == []


def test_the_total_over_the_cap_is_refused(standin):
    standin.publish(REPO, checkpoint(**{"model-00002-of-00002.safetensors": tiny_weights(3)}))
    one = len(tiny_weights(0))
    problems = rejected(hub.inspect, REPO, "main", max_total_bytes=2 * one)
    assert [(p.file, p.field) for p in problems] == [("(hub)", "size")]
    assert "total" in problems[0].message
    assert not [r for r in standin.requests if r.kind == "resolve"]
    assert hub.inspect(REPO, "main", max_total_bytes=CAP).total_bytes > 2 * one


def test_other_file_types_are_refused_with_the_uploads_messages(standin):
    standin.publish(REPO, checkpoint(**{"model.gguf": b"GGUF", "extra/weights.pt": b"PK",
                                        "notes.txt": b"hi", "model.onnx": b"x"}))
    problems = rejected(hub.inspect, REPO, "main", max_total_bytes=CAP)
    assert {(p.file, p.field) for p in problems} == {
        ("model.gguf", "extension"), ("extra/weights.pt", "extension"),
        ("notes.txt", "extension"), ("model.onnx", "extension")}
    for p in problems:
        assert p.message == extension_problem(p.file)
    assert not [r for r in standin.requests if r.kind == "resolve"]


# ------------------------------------------------------------------------------------
# what is and is not downloaded


def test_readme_gitattributes_and_junk_are_not_downloaded(standin, dest):
    standin.publish(REPO, checkpoint(**{".DS_Store": b"\0", "__MACOSX/._config.json": b"\0",
                                        "training_state.pt": b"pickle"}))
    ckpt = hub.inspect(REPO, "main", max_total_bytes=CAP)
    assert ckpt.dropped == [".gitattributes", "README.md", "training_state.pt"]
    assert ckpt.ignored == [".DS_Store", "__MACOSX/._config.json"]
    uploads = hub.download(ckpt, dest)
    assert on_disk(dest) == ["config.json", "model.safetensors"]
    for name in ("README.md", ".gitattributes", ".DS_Store", "training_state.pt"):
        assert standin.gets(REPO, name) == []
    # handed to validation by name only, never with bytes
    set_aside = {u.name: u for u in uploads[2:]}
    assert set(set_aside) == {".gitattributes", "README.md", "training_state.pt", ".DS_Store",
                              "__MACOSX/._config.json"}
    assert all(u.size == 0 and u.source.read() == b"" for u in set_aside.values())


def test_names_with_glob_characters_are_downloaded_exactly(standin, dest):
    names = ["shards/model-[1].safetensors", "weights?.safetensors", "w*.json"]
    standin.publish(REPO, {"config.json": tiny_config(), names[0]: tiny_weights(1),
                           names[1]: tiny_weights(2), names[2]: b"{}"})
    ckpt = hub.inspect(REPO, "main", max_total_bytes=CAP)
    assert sorted(f.name for f in ckpt.files) == sorted(["config.json", *names])
    hub.download(ckpt, dest)
    assert (dest / names[0]).read_bytes() == tiny_weights(1)
    assert (dest / names[1]).read_bytes() == tiny_weights(2)
    assert (dest / names[2]).read_bytes() == b"{}"


def test_a_python_file_is_reported_never_downloaded_and_refused_as_remote_code(
        standin, dest, tmp_path):
    standin.publish(REPO, checkpoint(**{"modeling_draft.py": b"import os\nos.system('id')\n"}))
    ckpt = hub.inspect(REPO, "main", max_total_bytes=CAP)
    assert ckpt.held_code == ["modeling_draft.py"]
    assert any("modeling_draft.py" in n and "never run" in n for n in ckpt.notes)
    uploads = hub.download(ckpt, dest)
    assert standin.gets(REPO, "modeling_draft.py") == []
    assert not (dest / "modeling_draft.py").exists()
    # a plain checkpoint shipping code: refused by validation as an upload would be
    work = tmp_path / "work"
    work.mkdir()
    problems = rejected(validate_checkpoint, uploads, "draft_model", TINY,
                        max_total_bytes=CAP, tmp_root=work)
    assert [(p.file, p.field) for p in problems] == [("modeling_draft.py", "extension")]
    assert "remote code" in problems[0].message


def test_safetensors_headers_are_read_remotely_before_any_download(standin):
    weights = {"model.embed_tokens.weight": torch.zeros(8192, 32, dtype=torch.bfloat16),
               "fc.weight": torch.zeros(16, 32, dtype=torch.float32),
               "d2t": torch.zeros(64, dtype=torch.int64)}
    data = save(weights)
    standin.publish(REPO, checkpoint(**{"model.safetensors": data,
                                        "extra.safetensors": tiny_weights(5)}))
    ckpt = hub.inspect(REPO, "main", max_total_bytes=CAP)
    assert ckpt.tensors["model.safetensors"] == {
        "model.embed_tokens.weight": ("BF16", [8192, 32]), "fc.weight": ("F32", [16, 32]),
        "d2t": ("I64", [64])}
    assert "model.layers.1.self_attn.q_proj.weight" in ckpt.tensors["extra.safetensors"]
    assert "d2t" in ckpt.tensor_names
    reads = standin.gets(REPO, "model.safetensors")
    assert reads and all(r.range and r.status == 206 for r in reads)
    assert sum(r.body_bytes for r in reads) < len(data) // 2
    assert standin.gets(REPO, "config.json") == []


def test_an_unreadable_safetensors_header_is_refused_before_download(standin):
    standin.publish(REPO, checkpoint(**{"model.safetensors": b"\x10\0\0\0\0\0\0\0not json{{{{{{{"}))
    problems = rejected(hub.inspect, REPO, "main", max_total_bytes=CAP)
    assert [(p.file, p.field) for p in problems] == [("model.safetensors", "header")]


# ------------------------------------------------------------------------------------
# the download itself


def test_the_download_passes_validation(standin, dest, tmp_path):
    standin.publish(REPO, checkpoint())
    ckpt = hub.inspect(REPO, "main", max_total_bytes=CAP)
    uploads = hub.download(ckpt, dest)
    work = tmp_path / "work"
    work.mkdir()
    with validate_checkpoint(uploads, "draft_model", TINY, max_total_bytes=CAP,
                             tmp_root=work) as validated:
        assert [f.name for f in validated.files] == ["config.json", "model.safetensors"]
        assert validated.tensor_count == len(ckpt.tensor_names)
        assert any("README.md" in n and ".gitattributes" in n
                   for n in validated.intake["notes"])


@pytest.mark.parametrize("tamper", ["same size", "longer"])
def test_a_download_that_differs_from_the_listing_is_refused_and_removed(
        standin, dest, tamper):
    commit = standin.publish(REPO, checkpoint())
    ckpt = hub.inspect(REPO, "main", max_total_bytes=CAP)
    path = standin.file_path(REPO, commit, "model.safetensors")
    data = bytearray(path.read_bytes())
    if tamper == "same size":
        data[-1] ^= 0xFF
    else:
        data += b"\0" * 64
    path.write_bytes(bytes(data))   # the hub serves other bytes than it listed
    with pytest.raises(hub.HubError, match="model.safetensors"):
        hub.download(ckpt, dest)
    assert on_disk(dest) == []


def test_download_wants_an_empty_folder(standin, dest):
    standin.publish(REPO, checkpoint())
    ckpt = hub.inspect(REPO, "main", max_total_bytes=CAP)
    (dest / "old.json").write_text("{}")
    with pytest.raises(ValueError, match="not empty"):
        hub.download(ckpt, dest)


def test_the_checkpoint_round_trips_through_json(standin, dest):
    standin.publish(REPO, checkpoint())
    standin.set_access(REPO, gated=True, tokens=(TOKEN,))
    ckpt = hub.inspect(REPO, "main", token=TOKEN, max_total_bytes=CAP)
    stored = json.loads(json.dumps(ckpt.as_dict()))
    again = hub.HubCheckpoint.from_dict(stored, token=TOKEN)
    assert again.as_dict() == ckpt.as_dict()
    hub.download(again, dest)
    assert on_disk(dest) == ["config.json", "model.safetensors"]


# ------------------------------------------------------------------------------------
# the endpoint, telemetry, progress bars


def test_the_endpoint_argument_wins_and_an_unreachable_hub_is_not_a_refusal(
        standin, monkeypatch):
    standin.publish(REPO, checkpoint())
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")       # nothing listens there
    with pytest.raises(hub.HubError, match="try again later"):
        hub.inspect(REPO, "main", max_total_bytes=CAP)
    assert hub.inspect(REPO, "main", max_total_bytes=CAP, endpoint=standin.url).files


def test_no_progress_bars_no_telemetry_no_implicit_token(standin, dest, monkeypatch, capfd):
    monkeypatch.setenv("TQDM_POSITION", "-1")          # would force huggingface_hub's bars on
    monkeypatch.setenv("HF_TOKEN", "hf_machine_token")  # must not be sent
    standin.publish(REPO, checkpoint())
    ckpt = hub.inspect(REPO, "main", max_total_bytes=CAP)
    hub.download(ckpt, dest)
    err = capfd.readouterr().err
    assert "Fetching" not in err and "Download" not in err and "%|" not in err, err
    agents = {r.user_agent for r in standin.requests}
    assert agents and all("specboard" in a and "torch/" not in a for a in agents), agents
    assert all(r.authorization is None for r in standin.requests)
