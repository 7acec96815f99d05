"""Submission through the submit page: the page answers at once (the submission *checking*,
its files staged) and the intake task checks it (``f.submitted``: the task's body, here in
the test process; tests/test_intake.py runs a real intake worker). Every validation rule of
worker/checkpoint/ reached with a crafted bad upload (refused with a message naming the file;
nothing stored: no drafter rows, no files under MEDIA_ROOT), a real draft model cut from the
demo target accepted and queued, duplicates, the rate limit and the n-gram parameters."""
import hashlib
import io
import json
import os
import struct
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from django.contrib.auth.models import User
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse
from safetensors.numpy import save as st_save

from leaderboard.services import runs, submissions
from leaderboard.models import Drafter, DrafterFile, Run, Submission, Target
from worker.checkpoint import Upload

from . import factories as f

pytestmark = pytest.mark.django_db

VOCAB, HIDDEN, LAYERS = 64, 16, 4


@pytest.fixture
def user(client):
    u = User.objects.create_user("submitter", password="pw-submit-123")
    client.force_login(u)
    return u


@pytest.fixture
def protocol():
    target = f.make_target(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS)
    return f.make_protocol(target, hardware="submit-test", ks=(2, 4))


def stored_files(media):
    return [p for p in media.rglob("*") if p.is_file()] if media.exists() else []


def tiny_config(**changes):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
           "hidden_size": HIDDEN, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_key_value_heads": 1, "intermediate_size": 32, "tie_word_embeddings": True}
    cfg.update(changes)
    return json.dumps(cfg).encode()


def tiny_weights(vocab=VOCAB, layers=1):
    z = lambda *shape: np.zeros(shape, dtype=np.float32)  # noqa: E731
    tensors = {"model.embed_tokens.weight": z(vocab, HIDDEN), "model.norm.weight": z(HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": z(HIDDEN), p + "post_attention_layernorm.weight": z(HIDDEN),
            p + "self_attn.q_proj.weight": z(HIDDEN, HIDDEN), p + "self_attn.k_proj.weight": z(8, HIDDEN),
            p + "self_attn.v_proj.weight": z(8, HIDDEN), p + "self_attn.o_proj.weight": z(HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": z(32, HIDDEN), p + "mlp.up_proj.weight": z(32, HIDDEN),
            p + "mlp.down_proj.weight": z(HIDDEN, 32)})
    return st_save(tensors)


def upload(name, data):
    return SimpleUploadedFile(name, data, content_type="application/octet-stream")


def form_data(protocol, method="draft_model", name="tiny draft", files=(), **extra):
    data = {"target": protocol.target_id, "protocol": protocol.pk, "method": method,
            "name": name, "description": "", "link": "", "licence": "Apache-2.0",
            "claimed_acceptance_length": "", "claimed_speedup": "", "claimed_source": "",
            "k": "", "prompt_lookup_min": "", "prompt_lookup_max": ""}
    data.update(extra)
    if files:
        data["files"] = list(files)
    return data


def zip_bytes(members):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members:
            z.writestr(name, data)
    return buf.getvalue()


def tar_with_symlink():
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        cfg = tiny_config()
        info = tarfile.TarInfo("config.json")
        info.size = len(cfg)
        t.addfile(info, io.BytesIO(cfg))
        link = tarfile.TarInfo("model.safetensors")
        link.type = tarfile.SYMTYPE
        link.linkname = "/etc/passwd"
        t.addfile(link)
    return buf.getvalue()


def bad_header():
    # 8-byte length claiming far more header than the file holds
    return struct.pack("<Q", 10 ** 6) + b'{"a": 1}'


BAD_UPLOADS = {
    "pickle": (lambda: [upload("config.json", tiny_config()),
                        upload("pytorch_model.bin", b"\x80\x04\x95 pickle bytes")],
               "pytorch_model.bin", "safetensors"),
    "zip-slip": (lambda: [upload("drafter.zip", zip_bytes([
                    ("config.json", tiny_config()), ("model.safetensors", tiny_weights()),
                    ("../evil.json", b"{}")]))],
                 "drafter.zip", "../evil.json"),
    "tar-symlink": (lambda: [upload("drafter.tar.gz", tar_with_symlink())],
                    "drafter.tar.gz", "symbolic link"),
    "oversize": (lambda: [upload("config.json", tiny_config()),
                          upload("model.safetensors", tiny_weights())],
                 "model.safetensors", "limit"),
    "bad-header": (lambda: [upload("config.json", tiny_config()),
                            upload("model.safetensors", bad_header())],
                   "model.safetensors", "header"),
    "wrong-vocab": (lambda: [upload("config.json", tiny_config(vocab_size=32)),
                             upload("model.safetensors", tiny_weights(vocab=32))],
                    "config.json", "vocab_size"),
    "remote-code": (lambda: [upload("config.json", tiny_config(
                        auto_map={"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})),
                             upload("model.safetensors", tiny_weights())],
                    "config.json", "auto_map"),
}


@pytest.mark.parametrize("case", list(BAD_UPLOADS))
def test_a_bad_upload_is_refused_naming_the_file_and_nothing_is_stored(
        client, user, protocol, media, settings, case):
    make_files, filename, hint = BAD_UPLOADS[case]
    if case == "oversize":
        settings.SPECBOARD_MAX_UPLOAD_BYTES = 2000
    response = client.post(reverse("submit"), form_data(protocol, files=make_files()))
    assert response.status_code == 302 and Drafter.objects.count() == 0
    submission = f.submitted(response)
    assert submission.state == Submission.REFUSED
    said = [f"{p['file']} {p.get('member')} {p['field']}: {p['message']}".lower()
            for p in submission.problems]
    assert any(filename.lower() in line and hint.lower() in line for line in said), said
    html = client.get(response["Location"]).content.decode()
    # every problem in the page's table, by file and field
    table = html[html.index('id="problems"'):html.index("</table>")]
    assert filename in table and 'id="refused"' in html
    assert Drafter.objects.count() == 0 and DrafterFile.objects.count() == 0
    assert Run.objects.count() == 0
    assert stored_files(media) == []   # the staged upload is removed too


def test_a_valid_tiny_draft_model_is_stored_and_queued(
        client, user, protocol, media, django_capture_on_commit_callbacks):
    weights = tiny_weights()
    with django_capture_on_commit_callbacks(execute=False) as sent:
        response = client.post(reverse("submit"), form_data(
            protocol, files=[upload("config.json", tiny_config()),
                             upload("model.safetensors", weights)], k="4"))
    assert response.status_code == 302, response.content.decode()[-3000:]
    # answered at once: staged and sent to the intake queue, nothing checked or stored yet
    assert len(sent) == 1 and Drafter.objects.count() == 0
    checking = client.get(response["Location"]).content.decode()
    assert 'id="checking"' in checking and "Position in the intake queue: <b>1</b>" in checking
    assert '<meta http-equiv="refresh"' in checking
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        submission = f.submitted(response)
    assert submission.state == Submission.ACCEPTED, submission.problems
    drafter = Drafter.objects.get()
    assert submission.drafter == drafter
    assert drafter.owner == user and drafter.params == {}  # k is checked, every k measured
    files = {df.name: df for df in drafter.files.all()}
    assert set(files) == {"config.json", "model.safetensors"}
    stored = files["model.safetensors"]
    with stored.file.open("rb") as fh:
        assert hashlib.sha256(fh.read()).hexdigest() == stored.sha256 == \
            hashlib.sha256(weights).hexdigest()
    assert str(Path(stored.file.path).resolve()).startswith(str(media.resolve()))
    # only the drafter's files remain: the staged copies are gone
    assert {p.name for p in stored_files(media)} == {Path(df.file.name).name
                                                    for df in drafter.files.all()}
    # the drafter's run and the protocol's baseline are queued, and sent on commit
    run = Run.objects.get(drafter=drafter)
    assert run.state == Run.QUEUED and run.hardware == "submit-test"
    assert Run.objects.filter(drafter__isnull=True, protocol=protocol).count() == 1
    assert len(callbacks) == 2
    page = client.get(response["Location"]).content.decode()
    assert 'id="accepted"' in page and drafter.slug in page and f"run #{run.pk}" in page
    assert "refresh" not in page
    # the drafter page says it came through intake (the owner sees the submission's link)
    drafter_page = client.get(reverse("drafter", args=[drafter.slug])).content.decode()
    assert 'id="intake-checked"' in drafter_page and response["Location"] in drafter_page
    client.logout()
    public = client.get(reverse("drafter", args=[drafter.slug])).content.decode()
    assert 'id="intake-checked"' in public and response["Location"] not in public
    queue_html = client.get(reverse("queue")).content.decode()
    assert f'id="run-{run.pk}"' in queue_html and "tiny draft" in queue_html


def test_the_same_content_under_the_same_protocol_is_refused_with_a_link(
        client, user, protocol, media):
    files = lambda: [upload("config.json", tiny_config()),  # noqa: E731
                     upload("model.safetensors", tiny_weights())]
    assert f.submitted(client.post(reverse("submit"), form_data(
        protocol, files=files()))).state == Submission.ACCEPTED
    first = Drafter.objects.get()
    before = stored_files(media)
    response = client.post(reverse("submit"), form_data(protocol, name="again", files=files()))
    again = f.submitted(response)
    assert again.state == Submission.REFUSED
    html = client.get(response["Location"]).content.decode()
    assert reverse("drafter", args=[first.slug]) in html and "already" in html
    assert Drafter.objects.count() == 1 and stored_files(media) == before
    # the same files for another protocol of the target are a new entry
    other = f.make_protocol(protocol.target, slug="other", hardware="submit-test")
    assert f.submitted(client.post(reverse("submit"), form_data(
        other, name="again", files=files()))).state == Submission.ACCEPTED


def test_ngram_parameters_are_checked_next_to_their_fields(client, user, protocol, media):
    response = client.post(reverse("submit"), form_data(
        protocol, method="ngram", prompt_lookup_min="5", prompt_lookup_max="3"))
    assert response.status_code == 400
    assert "larger than" in response.context["form"].errors["prompt_lookup_min"][0]
    response = client.post(reverse("submit"), form_data(
        protocol, method="ngram", prompt_lookup_min="1", prompt_lookup_max="3", k="3"))
    assert response.status_code == 400
    assert "k" in response.context["form"].errors
    response = client.post(reverse("submit"), form_data(
        protocol, method="ngram", prompt_lookup_min="2", prompt_lookup_max="4",
        files=[upload("config.json", tiny_config())]))
    assert response.status_code == 400
    assert "takes no files" in " ".join(response.context["form"].errors["files"])
    response = client.post(reverse("submit"), form_data(
        protocol, method="draft_model", prompt_lookup_min="2",
        files=[upload("config.json", tiny_config()), upload("model.safetensors", tiny_weights())]))
    assert response.status_code == 400 and "ngram method only" in \
        response.context["form"].errors["prompt_lookup_min"][0]
    assert Drafter.objects.count() == 0 and Run.objects.count() == 0
    response = client.post(reverse("submit"), form_data(
        protocol, method="ngram", name="lookup 2-4", prompt_lookup_min="2",
        prompt_lookup_max="4", k="2"))
    assert f.submitted(response).state == Submission.ACCEPTED
    d = Drafter.objects.get()
    assert d.params == {"prompt_lookup_min": 2, "prompt_lookup_max": 4}
    # what is stored, the engines take (worker/methods/)
    from worker.methods import ALLOWED_PARAMS
    assert set(d.params) <= set(ALLOWED_PARAMS["ngram"])
    assert len(d.content_sha256) == 64 and not d.files.exists()
    assert stored_files(media) == []
    again = client.post(reverse("submit"), form_data(
        protocol, method="ngram", name="lookup again", prompt_lookup_min="2",
        prompt_lookup_max="4", k="2"))
    assert f.submitted(again).state == Submission.REFUSED
    assert reverse("drafter", args=[d.slug]) in client.get(again["Location"]).content.decode()


def test_the_form_checks_protocol_target_and_claims(client, user, protocol):
    other_target = f.make_target(slug="other-target")
    response = client.post(reverse("submit"), form_data(
        protocol, method="ngram", target=other_target.pk, prompt_lookup_min="2",
        prompt_lookup_max="4", claimed_speedup="2.0"))
    assert response.status_code == 400
    errors = response.context["form"].errors
    assert "not Tiny test target (other-target)" in errors["protocol"][0]
    assert "Give the URL" in errors["claimed_source"][0]
    assert Drafter.objects.count() == 0


def test_submissions_per_day_are_limited(client, user, protocol, settings):
    settings.SPECBOARD_SUBMISSIONS_PER_DAY = 1
    ok = client.post(reverse("submit"), form_data(protocol, method="ngram", name="one",
                                                  prompt_lookup_min="1", prompt_lookup_max="2"))
    assert ok.status_code == 302
    # one being checked counts already
    refused = client.post(reverse("submit"), form_data(protocol, method="ngram", name="two",
                                                       prompt_lookup_min="2", prompt_lookup_max="3"))
    assert refused.status_code == 429
    assert "SPECBOARD_SUBMISSIONS_PER_DAY" in refused.content.decode()
    assert f.submitted(ok).state == Submission.ACCEPTED
    assert client.post(reverse("submit"), form_data(
        protocol, method="ngram", name="two", prompt_lookup_min="2",
        prompt_lookup_max="3")).status_code == 429
    assert Drafter.objects.count() == 1 and Submission.objects.count() == 1


def test_an_oversize_upload_is_refused_before_its_body_is_read(client, user, protocol,
                                                               settings):
    settings.SPECBOARD_MAX_UPLOAD_BYTES = 1000
    # A body announced as 1 TB but empty: reading it would fail; it is never read.
    response = client.generic("POST", reverse("submit"), b"", CONTENT_LENGTH=str(10 ** 12),
                              CONTENT_TYPE="multipart/form-data; boundary=x")
    assert response.status_code == 413
    assert "SPECBOARD_MAX_UPLOAD_BYTES" in response.content.decode()
    assert Drafter.objects.count() == 0


def test_a_failure_after_storing_removes_the_files_and_rows(protocol, media, monkeypatch):
    user = User.objects.create_user("u")

    def broken_queue(*args, **kwargs):
        raise runs.RunError("broker down (test)")

    monkeypatch.setattr(runs, "queue_run", broken_queue)
    uploads = [Upload("config.json", io.BytesIO(tiny_config()), None),
               Upload("model.safetensors", io.BytesIO(tiny_weights()), None)]
    with pytest.raises(runs.RunError):
        submissions.submit_drafter(owner=user, protocol=protocol, method="draft_model",
                                   name="doomed", uploads=uploads)
    assert Drafter.objects.count() == 0 and DrafterFile.objects.count() == 0
    assert stored_files(media) == []


def test_submit_needs_an_account(client, protocol):
    response = client.get(reverse("submit"))
    assert response.status_code == 302 and reverse("login") in response["Location"]


# ---- a real draft model: the demo target's first two layers -------------------------------

def cut_layers(src: Path, dest: Path, keep):
    """Copy the named tensors of a safetensors file byte for byte into a new one."""
    with open(src, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
        start = 8 + n
        out_header, chunks, offset = {}, [], 0
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]
                                 if kv[0] != "__metadata__" else -1):
            if name == "__metadata__" or not keep(name):
                continue
            b, e = info["data_offsets"]
            fh.seek(start + b)
            chunks.append(fh.read(e - b))
            out_header[name] = {"dtype": info["dtype"], "shape": info["shape"],
                                "data_offsets": [offset, offset + e - b]}
            offset += e - b
    raw = json.dumps(out_header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(dest, "wb") as out:
        out.write(struct.pack("<Q", len(raw)) + raw)
        for c in chunks:
            out.write(c)
    return out_header


def test_a_real_two_layer_draft_model_of_the_demo_target_is_accepted_and_queued(
        client, user, media, tmp_path, demo_target_dir, django_capture_on_commit_callbacks):
    cfg = json.loads((demo_target_dir / "config.json").read_text())
    target = Target.objects.create(
        slug="smollm2-test", name="SmolLM2-135M-Instruct", path=str(demo_target_dir),
        weights_sha256="0" * 64, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"])
    protocol = f.make_protocol(target, slug="demo-like", hardware="submit-test")
    keep = lambda name: (name in ("model.embed_tokens.weight", "model.norm.weight")  # noqa: E731
                         or name.startswith(("model.layers.0.", "model.layers.1.")))
    header = cut_layers(demo_target_dir / "model.safetensors", tmp_path / "model.safetensors", keep)
    assert {n.split(".")[2] for n in header if n.startswith("model.layers.")} == {"0", "1"}
    draft_cfg = dict(cfg, num_hidden_layers=2)
    weights = (tmp_path / "model.safetensors").read_bytes()
    response = client.post(reverse("submit"), form_data(
        protocol, name="SmolLM2 2-layer draft", files=[
            upload("config.json", json.dumps(draft_cfg).encode()),
            upload("model.safetensors", weights)]))
    assert response.status_code == 302, response.context["form"].errors
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        assert f.submitted(response).state == Submission.ACCEPTED
    drafter = Drafter.objects.get(name="SmolLM2 2-layer draft")
    stored = drafter.files.get(name="model.safetensors")
    assert stored.size == len(weights) == os.path.getsize(stored.file.path)
    assert stored.sha256 == hashlib.sha256(weights).hexdigest()
    run = Run.objects.get(drafter=drafter)
    assert run.state == Run.QUEUED and run.cells_total == len(
        protocol.spec.cells(with_drafter=True))
    assert len(callbacks) == 2  # the baseline's run and the drafter's


@pytest.mark.parametrize("name, slug", [
    ("medusa_reduced_vocab-demo-chat-1k-v1-seed0", "medusa_reduced_vocab-demo-chat-1k-v1"),
    ("EAGLE head, 1k conversations", "eagle-head-1k-conversations"),
    ("x" * 60, "x" * 40),
    ("", "drafter"),
])
def test_a_long_name_is_cut_at_a_word_boundary(name, slug):
    assert submissions.slug_base(name) == slug
    assert len(submissions.slug_base(name)) <= submissions.SLUG_LENGTH


@pytest.mark.django_db
def test_a_taken_slug_gets_a_numbered_suffix():
    f.make_drafter(f.make_target(), "medusa_reduced_vocab-demo-chat-1k-v1")
    assert submissions.unique_slug("medusa_reduced_vocab-demo-chat-1k-v1-seed0") \
        == "medusa_reduced_vocab-demo-chat-1k-v1-2"
