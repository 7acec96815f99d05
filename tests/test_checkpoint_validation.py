"""Drafter upload validation (worker/checkpoint): real crafted uploads, no mocks.

Rule tests use a tiny made-up target (vocab 64, hidden 16, 4 layers) so they run in
milliseconds; the positive case uses a real draft model cut from the demo target.
"""
import argparse
import io
import json
import os
import pickle
import stat
import struct
import tarfile
import zipfile

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save, save_file

from worker.checkpoint import (
    CheckpointRejected,
    Problem,
    TargetFacts,
    Upload,
    validate_checkpoint,
    validate_method_params,
)
from worker.checkpoint.cli import add_cli_arguments, cli
from worker.safetensors_header import check_safetensors_header

TINY = TargetFacts(vocab_size=64, hidden_size=16, num_layers=4)
LIMIT = 8 * 1024 * 1024


# ------------------------------------------------------------------------------------
# helpers


def tiny_config(**over):
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=64,
               hidden_size=16, intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    cfg.update(over)
    return {k: v for k, v in cfg.items() if v is not None}


def tiny_weights(layers=2, vocab=64, hidden=16):
    g = torch.Generator().manual_seed(0)
    t = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g).bfloat16(),
         "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(layers):
        t[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        t[f"model.layers.{i}.self_attn.q_proj.weight"] = torch.randn(hidden, hidden, generator=g).bfloat16()
    return t


def eagle_weights(hidden=16, extra=None):
    g = torch.Generator().manual_seed(1)
    t = {"fc.weight": torch.randn(hidden, 2 * hidden, generator=g).bfloat16(),
         "layers.0.self_attn.q_proj.weight": torch.randn(hidden, hidden, generator=g).bfloat16()}
    t.update(extra or {})
    return t


def write_files(folder, files):
    """files: {name: dict (json) | bytes | {tensor: torch.Tensor} via ('st', dict)}."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name, content in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif isinstance(content, tuple) and content[0] == "st":
            save_file(content[1], str(path))
        else:
            path.write_text(json.dumps(content))
        out.append(Upload(name, path, path.stat().st_size))
    return out


def as_bytes(content):
    if isinstance(content, bytes):
        return content
    if isinstance(content, tuple) and content[0] == "st":
        return save(content[1])
    return json.dumps(content).encode()


def make_zip(path, members, compression=zipfile.ZIP_DEFLATED):
    """members: {name: content} or list of (ZipInfo | name, content)."""
    items = members.items() if isinstance(members, dict) else members
    with zipfile.ZipFile(path, "w", compression=compression, compresslevel=1) as zf:
        for name, content in items:
            zf.writestr(name, as_bytes(content))
    return Upload(path.name, path, path.stat().st_size)


def make_targz(path, members):
    """members: list of (TarInfo, bytes | None)."""
    with tarfile.open(path, "w:gz", compresslevel=1, format=tarfile.GNU_FORMAT) as tf:
        for info, data in members:
            if data is not None:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
            else:
                tf.addfile(info)
    return Upload(path.name, path, path.stat().st_size)


def tar_file(name, data):
    info = tarfile.TarInfo(name)
    info.mode = 0o644
    return info, data


def good_files():
    return {"config.json": tiny_config(), "model.safetensors": ("st", tiny_weights())}


@pytest.fixture
def work(tmp_path):
    """The folder validation may write in; it must be empty again after every call."""
    d = tmp_path / "work"
    d.mkdir()
    return d


def reject(uploads, method="draft_model", target=TINY, *, work, limit=LIMIT, **kw):
    with pytest.raises(CheckpointRejected) as info:
        validate_checkpoint(uploads, method, target, max_total_bytes=limit, tmp_root=work, **kw)
    assert list(work.iterdir()) == [], "the temporary directory survived a refusal"
    problems = info.value.problems
    assert problems and all(isinstance(p, Problem) for p in problems)
    return problems


def accept(uploads, method="draft_model", target=TINY, *, work, limit=LIMIT):
    return validate_checkpoint(uploads, method, target, max_total_bytes=limit, tmp_root=work)


def find(problems, field=None, member=None, file=None, text=None):
    hits = [p for p in problems
            if (field is None or p.field == field or p.field.endswith("." + field))
            and (member is None or p.member == member)
            and (file is None or p.file == file)
            and (text is None or text.lower() in p.message.lower())]
    assert hits, f"no problem with field={field} member={member} text={text!r} in:\n" + \
        "\n".join(map(str, problems))
    return hits[0]


class Payload:
    """A pickle that runs a shell command when it is loaded."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ------------------------------------------------------------------------------------
# the positive case: a real draft model cut from the demo target


@pytest.fixture(scope="module")
def real_draft(demo_target_dir, tmp_path_factory):
    """The demo target's embeddings, final norm and layers 0-1, as a 2-layer Llama."""
    out = tmp_path_factory.mktemp("draft") / "smol-draft"
    out.mkdir()
    keep = {}
    with safe_open(str(demo_target_dir / "model.safetensors"), "pt") as f:
        for key in f.keys():
            if not key.startswith("model.layers.") or key.startswith(("model.layers.0.", "model.layers.1.")):
                keep[key] = f.get_tensor(key)
    save_file(keep, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((demo_target_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    params = sum(t.numel() for t in keep.values())
    return out, params


def test_real_draft_model_is_accepted_loose_zipped_and_tarred_with_one_hash(
        real_draft, demo_target_dir, tmp_path, work):
    folder, params = real_draft
    target = TargetFacts.from_config(demo_target_dir)
    assert (target.vocab_size, target.hidden_size, target.num_layers) == (49152, 576, 30)
    limit = 1024 ** 3

    loose = [Upload(p.name, p, p.stat().st_size) for p in sorted(folder.iterdir())]
    # bf16 weights barely compress and deflating 55 MB takes seconds here: the archives are
    # stored (zip) / level 0 (gzip); the small archive tests exercise real deflate streams
    zip_path = tmp_path / "smol-draft.zip"          # with its top-level folder
    with zipfile.ZipFile(zip_path, "w", zipfile.ZIP_STORED) as zf:
        for p in sorted(folder.iterdir()):
            zf.write(p, f"smol-draft/{p.name}")
        zf.writestr("__MACOSX/smol-draft/._config.json", b"\0\5\26\7junk")
        zf.writestr("smol-draft/.DS_Store", b"junk")
    tgz_path = tmp_path / "smol-draft.tgz"          # as `tar czf x.tgz -C folder .` makes it
    with tarfile.open(tgz_path, "w:gz", compresslevel=0) as tf:
        tf.add(folder, arcname=".")

    results = []
    with open(zip_path, "rb") as zip_fileobj:      # a file object, as the site passes
        uploads = {
            "loose": loose,
            "zip": [Upload(zip_path.name, zip_fileobj, zip_path.stat().st_size)],
            "tgz": [Upload(tgz_path.name, tgz_path, tgz_path.stat().st_size)],
        }
        for kind, up in uploads.items():
            r = accept(up, "draft_model", target, work=work, limit=limit)
            results.append(r)
            assert [f.name for f in r.files] == ["config.json", "model.safetensors"], kind
            assert r.parameter_count == params
            assert r.config["num_hidden_layers"] == 2
            assert r.temp_dir.is_dir() and r.temp_dir.parent == work
            for f in r.files:
                assert f.size == (folder / f.name).stat().st_size
                with f.open() as fh:
                    assert fh.read(64) == (folder / f.name).read_bytes()[:64]
    assert len({r.content_sha256 for r in results}) == 1
    assert results[1].ignored == ["__MACOSX/smol-draft/._config.json", "smol-draft/.DS_Store"]
    assert results[1].files[0].member == "smol-draft/config.json"
    for r in results:
        r.cleanup()
    assert list(work.iterdir()) == []


def test_result_is_a_context_manager_that_removes_its_temp_dir(tmp_path, work):
    with accept(write_files(tmp_path / "c", good_files()), work=work) as r:
        assert r.file("config.json").path.is_file()
        assert r.tensor_count == 6 and r.parameter_count == 64 * 16 + 16 + 2 * (16 + 256)
    assert list(work.iterdir()) == []


def test_file_objects_are_accepted_and_hash_like_paths(tmp_path, work):
    ups = write_files(tmp_path / "c", good_files())
    by_path = accept(ups, work=work)
    objs = [Upload(u.name, io.BytesIO(u.source.read_bytes()), u.size) for u in ups]
    with by_path, accept(objs, work=work) as by_obj:
        assert by_obj.content_sha256 == by_path.content_sha256


# ------------------------------------------------------------------------------------
# pickles and code


def test_pickle_with_payload_is_refused_and_never_unpickled(tmp_path, work):
    marker = tmp_path / "PWNED"
    payload = pickle.dumps(Payload(marker))
    # Under a published weights name it is read in the sandbox by torch's restricted
    # unpickler (weights_only), which refuses the payload's callable without calling it.
    problems = reject(write_files(tmp_path / "b", {"config.json": tiny_config(),
                                                   "pytorch_model.bin": payload}), work=work)
    p = find(problems, field="weights", file="pytorch_model.bin")
    assert "other than tensors" in p.message and "never unpickled" in p.message
    assert not marker.exists(), "the converter ran the pickle's code"
    # Under any other name a pickle is refused unopened, with how to convert it.
    files = good_files()
    files["model.bin"] = payload
    problems = reject(write_files(tmp_path / "c", files), work=work)
    p = find(problems, field="extension", file="model.bin")
    assert "convert" in p.message and "safetensors" in p.message
    assert "safetensors.torch.save_file" in p.message
    assert "save_pretrained" in p.message and "safe_serialization=True" in p.message
    # the same pickle zipped, and renamed to .safetensors: still never loaded
    zipped = make_zip(tmp_path / "d.zip", {"config.json": tiny_config(), "model.bin": payload})
    find(reject([zipped], work=work), field="extension", member="model.bin")
    renamed = write_files(tmp_path / "e", {"config.json": tiny_config(), "model.safetensors": payload})
    find(reject(renamed, work=work), field="header", text="pickle")
    assert not marker.exists(), "validation unpickled the upload"
    # the payload is live: loading it does run the command
    pickle.loads(payload)
    assert marker.exists()


def test_pt_file_inside_a_zip_is_refused(tmp_path, work):
    buf = io.BytesIO()
    torch.save({"fc.weight": torch.zeros(2, 2)}, buf)
    up = make_zip(tmp_path / "drafter.zip", {"config.json": tiny_config(),
                                             "weights/pytorch_model.pt": buf.getvalue()})
    p = find(reject([up], work=work), field="extension", member="weights/pytorch_model.pt")
    assert p.file == "drafter.zip" and "safe_serialization=True" in p.message


def test_torch_save_renamed_to_safetensors_inside_a_zip_is_refused(tmp_path, work):
    buf = io.BytesIO()
    torch.save(tiny_weights(), buf)
    up = make_zip(tmp_path / "drafter.zip", {"config.json": tiny_config(),
                                             "model.safetensors": buf.getvalue()})
    p = find(reject([up], work=work), field="header", member="model.safetensors")
    assert "renamed" in p.message and "save_file" in p.message


def test_auto_map_remote_code_is_refused(tmp_path, work):
    files = good_files()
    files["config.json"] = tiny_config(auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    find(reject(write_files(tmp_path / "c", files), work=work), field="auto_map", file="config.json")


def test_trust_remote_code_in_any_json_is_refused(tmp_path, work):
    files = good_files()
    files["tokenizer_config.json"] = {"trust_remote_code": True}
    find(reject(write_files(tmp_path / "c", files), work=work), field="trust_remote_code",
         file="tokenizer_config.json")


def test_python_member_is_refused_as_remote_code(tmp_path, work):
    members = dict(good_files())
    members["modeling_drafter.py"] = b"import os; os.system('echo hi')\n"
    p = find(reject([make_zip(tmp_path / "d.zip", members)], work=work),
             field="extension", member="modeling_drafter.py")
    assert "remote code" in p.message


def test_other_extensions_are_refused_and_the_message_says_what_is_accepted(tmp_path, work):
    files = good_files()
    files["notes.txt"] = b"my drafter\n"
    p = find(reject(write_files(tmp_path / "c", files), work=work), field="extension",
             file="notes.txt")
    assert ".json" in p.message and ".safetensors" in p.message


# ------------------------------------------------------------------------------------
# archive members


def test_zip_with_dot_dot_member_is_refused_and_nothing_escapes(tmp_path, work):
    up = make_zip(tmp_path / "d.zip", [*good_files().items(), ("../evil.json", {"x": 1})])
    p = find(reject([up], work=work), field="path", member="../evil.json")
    assert ".." in p.message
    assert not (tmp_path / "evil.json").exists() and not (work.parent / "evil.json").exists()


def test_zip_with_absolute_member_is_refused(tmp_path, work):
    evil = str(tmp_path / "abs-evil.json")
    up = make_zip(tmp_path / "d.zip", [*good_files().items(), (evil, {"x": 1})])
    p = find(reject([up], work=work), field="path", member=evil)
    assert "absolute" in p.message
    assert not os.path.exists(evil)


def test_zip_with_symlink_member_is_refused(tmp_path, work):
    link = zipfile.ZipInfo("config.json")
    link.create_system = 3
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    up = make_zip(tmp_path / "d.zip", [(link, b"/etc/passwd"),
                                       ("model.safetensors", ("st", tiny_weights()))])
    find(reject([up], work=work), field="type", member="config.json", text="symbolic link")


def test_tar_with_symlink_is_refused(tmp_path, work):
    link = tarfile.TarInfo("config.json")
    link.type = tarfile.SYMTYPE
    link.linkname = "/etc/passwd"
    up = make_targz(tmp_path / "d.tar.gz", [(link, None),
                                            tar_file("model.safetensors", save(tiny_weights()))])
    p = find(reject([up], work=work), field="type", member="config.json")
    assert "symbolic link" in p.message and "/etc/passwd" in p.message


def test_tar_with_hardlink_is_refused(tmp_path, work):
    link = tarfile.TarInfo("model2.safetensors")
    link.type = tarfile.LNKTYPE
    link.linkname = "model.safetensors"
    up = make_targz(tmp_path / "d.tgz", [tar_file("config.json", json.dumps(tiny_config()).encode()),
                                         tar_file("model.safetensors", save(tiny_weights())),
                                         (link, None)])
    find(reject([up], work=work), field="type", member="model2.safetensors", text="hard link")


def test_tar_with_device_is_refused(tmp_path, work):
    dev = tarfile.TarInfo("dev/sda.json")
    dev.type = tarfile.BLKTYPE
    dev.devmajor, dev.devminor = 8, 0
    fifo = tarfile.TarInfo("pipe.json")
    fifo.type = tarfile.FIFOTYPE
    up = make_targz(tmp_path / "d.tgz", [*(tar_file(n, as_bytes(c)) for n, c in good_files().items()),
                                         (dev, None), (fifo, None)])
    problems = reject([up], work=work)
    find(problems, field="type", member="dev/sda.json", text="device")
    find(problems, field="type", member="pipe.json", text="FIFO")


def test_tar_with_dot_dot_and_absolute_members_is_refused(tmp_path, work):
    up = make_targz(tmp_path / "d.tgz", [*(tar_file(n, as_bytes(c)) for n, c in good_files().items()),
                                         tar_file("../evil.json", b"{}"),
                                         tar_file("/abs.json", b"{}")])
    problems = reject([up], work=work)
    find(problems, field="path", member="../evil.json")
    find(problems, field="path", member="/abs.json", text="absolute")


def test_encrypted_zip_member_is_refused(tmp_path, work):
    path = tmp_path / "d.zip"
    make_zip(path, good_files(), compression=zipfile.ZIP_STORED)
    _patch_zip_member(path, "config.json", {6: ("<H", 0x1)}, {8: ("<H", 0x1)})  # "encrypted"
    with zipfile.ZipFile(path) as zf:
        assert zf.getinfo("config.json").flag_bits & 0x1
    up = Upload(path.name, path, path.stat().st_size)
    find(reject([up], work=work), field="encryption", member="config.json")


def test_duplicate_member_names_are_refused(tmp_path, work):
    up = make_zip(tmp_path / "d.zip", [*good_files().items(), ("./config.json", tiny_config())])
    find(reject([up], work=work), field="path", member="./config.json", text="twice")


def test_archive_with_other_files_is_refused(tmp_path, work):
    ups = write_files(tmp_path / "c", good_files())
    up = make_zip(tmp_path / "d.zip", good_files())
    problems = reject([up, *ups], work=work)
    find(problems, field="files", file="d.zip", text="one archive")


def test_junk_is_ignored_and_does_not_change_the_hash(tmp_path, work):
    with accept(write_files(tmp_path / "c", good_files()), work=work) as loose:
        up = make_zip(tmp_path / "d.zip", [*good_files().items(), (".DS_Store", b"\0\0"),
                                           ("__MACOSX/._model.safetensors", b"\0\5\26\7")])
        with accept([up], work=work) as zipped:
            assert zipped.content_sha256 == loose.content_sha256
            assert zipped.ignored == [".DS_Store", "__MACOSX/._model.safetensors"]
            assert [f.name for f in zipped.files] == ["config.json", "model.safetensors"]


def test_corrupt_archive_is_refused(tmp_path, work):
    bad = tmp_path / "d.zip"
    bad.write_bytes(b"PK\x03\x04 this is not really a zip")
    find(reject([Upload("d.zip", bad, bad.stat().st_size)], work=work), field="archive", file="d.zip")
    bad = tmp_path / "d.tgz"
    bad.write_bytes(b"\x1f\x8b\x08\x00 nor this a tgz")
    find(reject([Upload("d.tgz", bad, bad.stat().st_size)], work=work), field="archive", file="d.tgz")


# ------------------------------------------------------------------------------------
# sizes and bombs


def test_oversize_upload_is_refused(tmp_path, work):
    ups = write_files(tmp_path / "c", good_files())
    limit = sum(u.size for u in ups) - 1
    p = find(reject(ups, work=work, limit=limit), field="size")
    assert str(limit) in p.message


def test_oversize_upload_is_refused_even_if_the_declared_size_lies(tmp_path, work):
    ups = write_files(tmp_path / "c", good_files())
    limit = sum(u.size for u in ups) - 1
    lying = [Upload(u.name, u.source, 1) for u in ups]
    find(reject(lying, work=work, limit=limit), field="size")


class ZeroStream:
    """A file object of `total` zero bytes that counts how much was read from it."""

    def __init__(self, total):
        self.left = total
        self.read_bytes = 0

    def read(self, n=-1):
        n = self.left if n is None or n < 0 else min(n, self.left)
        self.left -= n
        self.read_bytes += n
        return b"\0" * n


def test_stream_of_unknown_size_is_cut_off_at_the_limit_while_reading(tmp_path, work):
    limit = 1024 * 1024
    stream = ZeroStream(32 * limit)
    ups = [*write_files(tmp_path / "c", {"config.json": tiny_config()}),
           Upload("model.safetensors", stream, None)]
    p = find(reject(ups, work=work, limit=limit), field="size", file="model.safetensors")
    assert "actually read" in p.message
    assert stream.read_bytes <= limit + 2 * 1024 * 1024, "it read on past the limit"


def test_zip_bomb_is_refused_on_declared_size_before_extracting(tmp_path, work):
    zeros = b"\0" * (4 * 1024 * 1024)
    up = make_zip(tmp_path / "bomb.zip", {"config.json": tiny_config(), "model.safetensors": zeros})
    assert up.size < 64 * 1024                              # a >100:1 ratio
    p = find(reject([up], work=work, limit=1024 * 1024), field="size", file="bomb.zip")
    assert "declared" in p.message


def _patch_zip_member(path, member, local, central):
    """Overwrite little-endian fields of `member`'s local and central headers:
    ``local``/``central`` map a byte offset in the header to (struct format, value)."""
    data = bytearray(path.read_bytes())
    eocd = data.rindex(b"PK\x05\x06")
    cd = struct.unpack_from("<I", data, eocd + 16)[0]
    while data[cd:cd + 4] == b"PK\x01\x02":
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, cd + 28)
        if data[cd + 46:cd + 46 + name_len] == member.encode():
            lh = struct.unpack_from("<I", data, cd + 42)[0]
            assert data[lh:lh + 4] == b"PK\x03\x04"
            for off, (fmt, value) in local.items():
                struct.pack_into(fmt, data, lh + off, value)
            for off, (fmt, value) in central.items():
                struct.pack_into(fmt, data, cd + off, value)
            path.write_bytes(bytes(data))
            return
        cd += 46 + name_len + extra_len + comment_len
    raise AssertionError(f"{member} not found")


def _patch_zip_sizes(path, member, new_size):
    """Make the headers of `member` declare `new_size` uncompressed bytes."""
    _patch_zip_member(path, member, {22: ("<I", new_size)}, {24: ("<I", new_size)})


def test_zip_member_whose_header_understates_its_size_is_refused(tmp_path, work):
    path = tmp_path / "liar.zip"
    big = save({"w": torch.zeros(1024, 1024, dtype=torch.float32)})   # 4 MB, compresses to ~4 KB
    make_zip(path, {"config.json": tiny_config(), "model.safetensors": big})
    _patch_zip_sizes(path, "model.safetensors", 1000)
    with zipfile.ZipFile(path) as zf:
        assert zf.getinfo("model.safetensors").file_size == 1000   # declared small
    up = Upload(path.name, path, path.stat().st_size)
    problems = reject([up], work=work, limit=1024 * 1024)
    p = find(problems, member="model.safetensors")
    assert p.field in ("archive", "size")


def test_tar_bomb_member_is_refused_on_declared_size(tmp_path, work):
    up = make_targz(tmp_path / "bomb.tgz", [tar_file("config.json", json.dumps(tiny_config()).encode()),
                                            tar_file("model.safetensors", b"\0" * (3 * 1024 * 1024))])
    assert up.size < 64 * 1024
    find(reject([up], work=work, limit=1024 * 1024), field="size", member="model.safetensors")


def test_tar_stream_that_decompresses_beyond_the_limit_is_refused(tmp_path, work):
    # a GNU long-name header whose data (the name) is 8 MB: no member declares it,
    # only counting the decompressed stream catches it
    long_name = "a" * (8 * 1024 * 1024) + ".json"
    up = make_targz(tmp_path / "longname.tgz", [tar_file(long_name, b"{}")])
    assert up.size < 64 * 1024
    p = find(reject([up], work=work, limit=1024 * 1024), field="size", file="longname.tgz")
    assert "decompressed" in p.message


def test_too_many_files_are_refused(tmp_path, work):
    files = good_files()
    files.update({f"extra{i}.json": {} for i in range(5)})
    find(reject(write_files(tmp_path / "c", files), work=work, max_files=4), field="files")


# ------------------------------------------------------------------------------------
# safetensors headers


def raw_safetensors(header, data=b"", length=None, pad=True):
    blob = json.dumps(header).encode() if not isinstance(header, bytes) else header
    if pad:
        blob += b" " * (-len(blob) % 8)
    n = len(blob) if length is None else length
    return struct.pack("<Q", n) + blob + data


def T(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


GOOD_HEADER = {"a": T("F32", [2, 2], 0, 16), "b": T("BF16", [4], 16, 24)}
BAD_SAFETENSORS = {
    "truncated_data": (raw_safetensors(GOOD_HEADER, b"\0" * 20), "b.data_offsets", "truncated"),
    "shorter_than_8_bytes": (b"\x10\0\0\0", "header_length", "truncated"),
    "length_larger_than_file": (raw_safetensors(GOOD_HEADER, b"\0" * 24, length=10_000),
                                "header_length", "only"),
    "overlapping_offsets": (raw_safetensors({"a": T("F32", [2, 2], 0, 16),
                                             "b": T("F32", [2], 8, 16)}, b"\0" * 16),
                            "b.data_offsets", "overlaps"),
    "wrong_byte_count": (raw_safetensors({"a": T("F32", [2, 3], 0, 16)}, b"\0" * 16),
                         "a.data_offsets", "needs 24 bytes"),
    "unknown_dtype": (raw_safetensors({"a": T("F17", [4], 0, 8)}, b"\0" * 8), "a.dtype", "F17"),
    "gap_between_tensors": (raw_safetensors({"a": T("F32", [2], 0, 8), "b": T("F32", [2], 16, 24)},
                                            b"\0" * 24), "b.data_offsets", "gap"),
    "trailing_bytes": (raw_safetensors(GOOD_HEADER, b"\0" * 40), "data_offsets", "trailing"),
    "negative_shape": (raw_safetensors({"a": T("F32", [-1, 2], 0, 8)}, b"\0" * 8), "a.shape", "non-negative"),
    "bool_in_shape": (raw_safetensors({"a": T("F32", [True, 2], 0, 8)}, b"\0" * 8), "a.shape", "non-negative"),
    "end_before_begin": (raw_safetensors({"a": T("F32", [2], 8, 0)}, b"\0" * 8), "a.data_offsets", "begin <= end"),
    "header_not_json": (raw_safetensors(b"{not json}"), "header", "JSON"),
    "header_is_a_list": (raw_safetensors([1, 2]), "header", "not an object"),
    "duplicate_tensor_name": (raw_safetensors(b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},'
                                              b' "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}',
                                              b"\0"), "header", "duplicate"),
    "metadata_not_str_to_str": (raw_safetensors({"__metadata__": {"format": 1},
                                                 "a": T("U8", [1], 0, 1)}, b"\0"), "__metadata__", "strings"),
    "extra_key_in_entry": (raw_safetensors({"a": dict(T("U8", [1], 0, 1), extra=1)}, b"\0"), "a", "exactly"),
    "no_tensors": (raw_safetensors({"__metadata__": {"format": "pt"}}), "header", "no tensors"),
}


@pytest.mark.parametrize("case", sorted(BAD_SAFETENSORS))
def test_bad_safetensors_header_is_refused(case, tmp_path, work):
    blob, field, text = BAD_SAFETENSORS[case]
    up = make_zip(tmp_path / "d.zip", {"config.json": tiny_config(), "model.safetensors": blob})
    p = find(reject([up], work=work), field=field, member="model.safetensors", text=text)
    assert p.file == "d.zip"


def test_good_hand_made_safetensors_header_passes_the_header_check(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(raw_safetensors(dict(GOOD_HEADER, __metadata__={"format": "pt"}), b"\0" * 24))
    problems = []
    found = check_safetensors_header(path, lambda f, m: problems.append((f, m)))
    assert problems == [] and found == {"a": ("F32", [2, 2]), "b": ("BF16", [4])}
    # and the real library agrees it is a valid file
    with safe_open(str(path), "pt") as f:
        assert sorted(f.keys()) == ["a", "b"]


def test_header_length_above_the_cap_is_refused_without_reading_it(tmp_path):
    path = tmp_path / "huge.safetensors"
    n = 150 * 1000 * 1000
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", n) + b"{")
        f.truncate(8 + n + 16)                  # sparse: costs no disk
    problems = []
    assert check_safetensors_header(path, lambda f, m: problems.append((f, m))) is None
    assert problems and problems[0][0] == "header_length" and "cap" in problems[0][1]


def test_sharded_index_referring_to_a_missing_shard_is_refused(tmp_path, work):
    files = good_files()
    files["model.safetensors.index.json"] = {"weight_map": {
        "model.embed_tokens.weight": "model.safetensors",
        "model.norm.weight": "model-00002-of-00002.safetensors"}}
    find(reject(write_files(tmp_path / "c", files), work=work), field="weight_map",
         file="model.safetensors.index.json", text="model-00002-of-00002.safetensors")


def test_tensor_stored_twice_across_shards_is_refused(tmp_path, work):
    files = good_files()
    files["model-2.safetensors"] = ("st", {"model.norm.weight": torch.ones(16)})
    find(reject(write_files(tmp_path / "c", files), work=work), field="model.norm.weight",
         text="also present")


# ------------------------------------------------------------------------------------
# config.json


def test_wrong_vocabulary_size_is_refused(tmp_path, work):
    files = {"config.json": tiny_config(vocab_size=65),
             "model.safetensors": ("st", tiny_weights(vocab=65))}
    p = find(reject(write_files(tmp_path / "c", files), work=work), field="vocab_size",
             file="config.json")
    assert "65" in p.message and "64" in p.message


def test_wrong_hidden_size_for_eagle_is_refused(tmp_path, work):
    files = {"config.json": tiny_config(hidden_size=32, num_hidden_layers=1),
             "model.safetensors": ("st", eagle_weights(hidden=32))}
    p = find(reject(write_files(tmp_path / "c", files), "eagle", work=work), field="hidden_size")
    assert "32" in p.message and "16" in p.message
    # a draft model may have its own hidden size
    files = {"config.json": tiny_config(hidden_size=32),
             "model.safetensors": ("st", tiny_weights(hidden=32))}
    accept(write_files(tmp_path / "d", files), work=work).cleanup()


@pytest.mark.parametrize("method,arch,ok", [
    ("eagle", "LlamaForCausalLM", True),          # vLLM renames it EagleLlamaForCausalLM
    ("eagle", "EagleLlamaForCausalLM", True),
    ("eagle", "EagleMistralForCausalLM", True),
    ("eagle", "Eagle3LlamaForCausalLM", False),
    ("eagle", "GPT2LMHeadModel", False),
    ("eagle3", "LlamaForCausalLM", True),         # -> Eagle3LlamaForCausalLM
    ("eagle3", "LlamaForCausalLMEagle3", True),
    ("eagle3", "Eagle3LlamaForCausalLM", True),
    ("eagle3", "EagleLlamaForCausalLM", False),
    ("mtp", "DeepSeekMTPModel", True),
    ("mtp", "LlamaForCausalLM", False),
])
def test_head_architectures_follow_vllm(method, arch, ok, tmp_path, work):
    files = {"config.json": tiny_config(architectures=[arch], num_hidden_layers=1),
             "model.safetensors": ("st", eagle_weights())}
    ups = write_files(tmp_path / "c", files)
    if ok:
        accept(ups, method, work=work).cleanup()
    else:
        find(reject(ups, method, work=work), field="architectures", text=arch)


def test_draft_model_architecture_must_be_llama_family(tmp_path, work):
    files = good_files()
    files["config.json"] = tiny_config(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    p = find(reject(write_files(tmp_path / "c", files), work=work), field="architectures")
    assert "LlamaForCausalLM" in p.message and "Qwen2ForCausalLM" in p.message
    files["config.json"] = tiny_config(architectures=["MistralForCausalLM"])   # model_type llama
    find(reject(write_files(tmp_path / "d", files), work=work), field="model_type")


def test_eagle3_draft_vocabulary_needs_d2t(tmp_path, work):
    cfg = tiny_config(architectures=["LlamaForCausalLM"], num_hidden_layers=1, draft_vocab_size=32,
                      eagle_aux_hidden_state_layer_ids=[0, 1, 3])
    files = {"config.json": cfg, "model.safetensors": ("st", eagle_weights())}
    find(reject(write_files(tmp_path / "c", files), "eagle3", work=work), field="d2t")
    d2t = {"d2t": torch.arange(32, dtype=torch.int64), "t2d": torch.ones(64, dtype=torch.bool)}
    files["model.safetensors"] = ("st", eagle_weights(extra=d2t))
    with accept(write_files(tmp_path / "d", files), "eagle3", work=work) as r:
        assert r.parameter_count == 16 * 32 + 16 * 16     # index buffers are not parameters
    files["model.safetensors"] = ("st", eagle_weights(extra={"d2t": torch.arange(31)}))
    find(reject(write_files(tmp_path / "e", files), "eagle3", work=work), field="d2t", text="shape [32]")
    cfg["eagle_aux_hidden_state_layer_ids"] = [0, 4]
    files = {"config.json": cfg, "model.safetensors": ("st", eagle_weights(extra=d2t))}
    find(reject(write_files(tmp_path / "f", files), "eagle3", work=work),
         field="eagle_aux_hidden_state_layer_ids")


def test_medusa_reduced_vocabulary_needs_its_token_map(tmp_path, work):
    cfg = {"hidden_size": 16, "vocab_size": 64, "num_heads": 2, "original_lm_head": True,
           "truncated_vocab_size": 8}
    heads = {"blocks.0.layers.0.weight": torch.zeros(16, 16), "lm_head.weight": torch.zeros(8, 16)}
    files = {"config.json": cfg, "model.safetensors": ("st", heads)}
    p = find(reject(write_files(tmp_path / "a", files), "medusa", work=work), field="token_map")
    assert "truncated_vocab_size 8" in p.message and "shape [truncated_vocab_size]" in p.message
    files["model.safetensors"] = ("st", dict(heads, token_map=torch.arange(7)))
    find(reject(write_files(tmp_path / "b", files), "medusa", work=work), field="token_map",
         text="shape [8]")
    files["model.safetensors"] = ("st", dict(heads, token_map=torch.arange(8.0)))
    find(reject(write_files(tmp_path / "c", files), "medusa", work=work), field="token_map",
         text="integer")
    files["model.safetensors"] = ("st", dict(heads, token_map=torch.arange(8) * 3))
    accept(write_files(tmp_path / "d", files), "medusa", work=work).cleanup()
    files["config.json"] = dict(cfg, truncated_vocab_size=65)
    find(reject(write_files(tmp_path / "e", files), "medusa", work=work),
         field="truncated_vocab_size", text="1..64")


def test_medusa_heads(tmp_path, work):
    cfg = {"hidden_size": 16, "vocab_size": 64, "medusa_num_heads": 3, "medusa_num_layers": 1}
    weights = ("st", {"0.0.linear.weight": torch.zeros(16, 16), "0.1.weight": torch.zeros(64, 16)})
    accept(write_files(tmp_path / "c", {"config.json": cfg, "model.safetensors": weights}),
           "medusa", work=work).cleanup()
    bad = dict(cfg, hidden_size=32, architectures=["LlamaForCausalLM"], medusa_num_heads=0)
    problems = reject(write_files(tmp_path / "d", {"config.json": bad, "model.safetensors": weights}),
                      "medusa", work=work)
    find(problems, field="hidden_size")
    find(problems, field="architectures", text="MedusaModel")
    find(problems, field="medusa_num_heads")


@pytest.mark.parametrize("over,field", [
    (dict(num_attention_heads=3), "num_attention_heads"),      # 3 does not divide 16
    (dict(num_key_value_heads=3), "num_key_value_heads"),      # 3 does not divide 4
    (dict(num_hidden_layers=500), "num_hidden_layers"),
    (dict(num_hidden_layers=0), "num_hidden_layers"),
    (dict(hidden_size="16"), "hidden_size"),
    (dict(num_attention_heads=None), "num_attention_heads"),
])
def test_insane_layer_and_head_counts_are_refused(over, field, tmp_path, work):
    files = good_files()
    files["config.json"] = tiny_config(**over)
    find(reject(write_files(tmp_path / "c", files), work=work), field=field, file="config.json")


def test_config_and_tensors_must_agree(tmp_path, work):
    files = {"config.json": tiny_config(num_hidden_layers=3, tie_word_embeddings=False),
             "model.safetensors": ("st", tiny_weights(layers=2))}
    problems = reject(write_files(tmp_path / "c", files), work=work)
    find(problems, field="num_hidden_layers", text="missing 2")
    find(problems, field="lm_head.weight", text="tie_word_embeddings")


def test_missing_config_and_weights_are_refused(tmp_path, work):
    problems = reject(write_files(tmp_path / "c", {"generation_config.json": {}}), work=work)
    find(problems, field="config.json", text="missing")
    find(problems, field="files", text=".safetensors")


def test_all_problems_are_collected_and_printed(tmp_path, work):
    files = {"config.json": tiny_config(vocab_size=65, auto_map={"AutoConfig": "x.Y"}),
             "model.safetensors": raw_safetensors({"a": T("F17", [4], 0, 8)}, b"\0" * 8),
             "weights.pt": b"\x80\x04.", "notes.txt": b"hi"}
    up = make_zip(tmp_path / "drafter.zip", files)
    with pytest.raises(CheckpointRejected) as info:
        validate_checkpoint([up], "draft_model", TINY, max_total_bytes=LIMIT, tmp_root=work)
    problems = info.value.problems
    for field in ("vocab_size", "auto_map", "a.dtype", "extension"):
        find(problems, field=field)
    assert {p.member for p in problems if p.field == "extension"} == {"weights.pt", "notes.txt"}
    text = str(info.value)
    assert text.splitlines()[0] == f"checkpoint rejected: {len(problems)} problems"
    assert len(text.splitlines()) == len(problems) + 1
    assert "drafter.zip -> config.json [vocab_size]" in text
    assert "drafter.zip -> weights.pt [extension]" in text
    assert list(work.iterdir()) == []


# ------------------------------------------------------------------------------------
# ngram, unknown methods


def test_ngram_takes_no_files(tmp_path, work):
    ups = write_files(tmp_path / "c", good_files())
    find(reject(ups, "ngram", work=work), field="method", text="no files")
    with accept([], "ngram", work=work) as r:
        assert r.files == [] and r.temp_dir is None


def test_unknown_method_is_refused(work):
    find(reject([], "lookahead", work=work), field="method", text="draft_model")


def test_ngram_params():
    assert validate_method_params("ngram", {"prompt_lookup_min": 2, "prompt_lookup_max": 4}, [2, 4]) == \
        {"prompt_lookup_min": 2, "prompt_lookup_max": 4}
    # a missing bound is filled as vLLM fills it, and stored explicitly
    assert validate_method_params("ngram", {"prompt_lookup_max": 4}, [2, 4]) == \
        {"prompt_lookup_min": 4, "prompt_lookup_max": 4}
    assert validate_method_params("ngram", {}, [2, 4]) == {"prompt_lookup_min": 5, "prompt_lookup_max": 5}
    assert validate_method_params("ngram", {"prompt_lookup_min": 1, "prompt_lookup_max": 16, "k": 4},
                                 [2, 4])["k"] == 4
    bad = [
        ({"prompt_lookup_min": 0, "prompt_lookup_max": 4}, "prompt_lookup_min"),
        ({"prompt_lookup_min": 2, "prompt_lookup_max": 17}, "prompt_lookup_max"),
        ({"prompt_lookup_min": 5, "prompt_lookup_max": 4}, "prompt_lookup_min"),
        ({"prompt_lookup_min": 2.0, "prompt_lookup_max": 4}, "prompt_lookup_min"),
        ({"prompt_lookup_min": True, "prompt_lookup_max": 4}, "prompt_lookup_min"),
        ({"prompt_lookup_min": 2, "prompt_lookup_max": 4, "k": 3}, "k"),
        ({"prompt_lookup_min": 2, "prompt_lookup_max": 4, "n": 3}, "n"),
    ]
    for params, field in bad:
        with pytest.raises(CheckpointRejected) as info:
            validate_method_params("ngram", params, [2, 4])
        find(info.value.problems, field=field)


def test_the_upload_check_and_the_engine_config_apply_one_ngram_rule():
    """Whatever the upload check accepts, the engine configures with the same bounds; what it
    refuses, the engine refuses too (worker.methods.ngram.lookup_bounds is the one rule)."""
    from worker.measure import DrafterSpec
    from worker.methods import speculative_config

    cases = [{}, {"prompt_lookup_min": 3}, {"prompt_lookup_max": 7}, {"prompt_lookup_min": 1,
             "prompt_lookup_max": 16}, {"prompt_lookup_min": 0, "prompt_lookup_max": 4},
             {"prompt_lookup_min": 2, "prompt_lookup_max": 17}, {"prompt_lookup_min": 6,
             "prompt_lookup_max": 4}, {"prompt_lookup_min": True}]
    for params in cases:
        try:
            accepted = validate_method_params("ngram", params, [2])
        except CheckpointRejected:
            accepted = None
        try:
            config = speculative_config(DrafterSpec("ngram", None, params), 2)
        except ValueError:
            config = None
        assert (accepted is None) == (config is None), params
        if config is not None:
            assert {key: config[key] for key in accepted} == accepted, params


# ------------------------------------------------------------------------------------
# CLI


def run_cli(argv):
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    return cli(parser.parse_args(argv))


def test_cli_validates_files_against_a_target_folder(tmp_path, capsys):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(tiny_config(num_hidden_layers=4)))
    ups = write_files(tmp_path / "c", good_files())
    assert run_cli(["--method", "draft_model", "--target", str(target),
                    *[str(u.source) for u in ups]]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK content_sha256=") and "model.safetensors" in out
    zipped = make_zip(tmp_path / "d.zip", dict(good_files(), **{"x.pt": b"\x80"}))
    assert run_cli(["--method", "draft_model", "--target", str(target), str(zipped.source)]) == 1
    out = capsys.readouterr().out
    assert "d.zip -> x.pt [extension]" in out and "convert" in out
