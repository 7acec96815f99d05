"""Peak memory of the site while it takes a large upload (a benchmark, not a test).

Starts the site under gunicorn (one sync worker, a throw-away SQLite database), submits a
draft-model checkpoint of each size through POST /api/drafters as one streamed multipart
body, and prints the web worker's peak resident memory (VmHWM) after each upload, a fresh
server per size, side by side. The goal is flat memory: the upload streams to a temporary
file (Django's TemporaryFileUploadHandler) and into the storage, staged for the intake
worker, so a 2 GiB upload peaks where a 200 MiB one does. Then a real intake worker (queue
intake) checks what was received; its outcome per upload is printed with the peak of the
sandboxed child that parsed it, and the child's address-space limit.

    .venv/bin/python bench/upload_memory.py [--sizes-mib 200,2048] [--formats safetensors,bin]
    .venv/bin/python bench/upload_memory.py --hostile

``--formats``: each size is sent as ``model.safetensors`` and, with ``bin``, as the same
tensors pickled into ``pytorch_model.bin`` (SafeAILab's layout), which the site converts to
safetensors in a sandboxed child (worker/checkpoint/convert.py): the web worker's own peak
must not grow with it either. ``--hostile``: the uploads that cost a web worker hundreds of
MiB when it parsed uploads itself, sent to one server; its peak growth over the whole set.

The checkpoint is a one-layer Llama draft model for a tiny target (vocab 64, hidden 16)
whose MLP is made as wide as the size asks; its weights are zeros, written and sent in
chunks, so the client needs no memory either. Needs about twice the largest size on disk.
"""
import argparse
import http.client
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VOCAB, HIDDEN = 64, 16
CHUNK = 8 << 20


def llama_config(intermediate):
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
            "hidden_size": HIDDEN, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "intermediate_size": intermediate,
            "tie_word_embeddings": True}


def write_checkpoint(folder: Path, size_bytes: int) -> tuple[Path, Path]:
    """config.json and model.safetensors of about size_bytes, zeros written in chunks."""
    intermediate = max(32, size_bytes // (3 * HIDDEN * 4))
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "model.layers.0.input_layernorm.weight": (HIDDEN,),
              "model.layers.0.post_attention_layernorm.weight": (HIDDEN,),
              "model.layers.0.self_attn.q_proj.weight": (HIDDEN, HIDDEN),
              "model.layers.0.self_attn.k_proj.weight": (8, HIDDEN),
              "model.layers.0.self_attn.v_proj.weight": (8, HIDDEN),
              "model.layers.0.self_attn.o_proj.weight": (HIDDEN, HIDDEN),
              "model.layers.0.mlp.gate_proj.weight": (intermediate, HIDDEN),
              "model.layers.0.mlp.up_proj.weight": (intermediate, HIDDEN),
              "model.layers.0.mlp.down_proj.weight": (HIDDEN, intermediate)}
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = 4
        for d in shape:
            n *= d
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    weights = folder / "model.safetensors"
    with open(weights, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        zeros = bytes(CHUNK)
        left = offset
        while left:
            n = min(left, CHUNK)
            f.write(zeros[:n])
            left -= n
    config = folder / "config.json"
    config.write_text(json.dumps(llama_config(intermediate)))
    return config, weights


def write_pickled(folder: Path, size_bytes: int) -> tuple[Path, Path]:
    """The same checkpoint with its tensors pickled by torch.save into pytorch_model.bin."""
    import torch
    from safetensors.torch import load_file

    config, weights = write_checkpoint(folder, size_bytes)
    binary = folder / "pytorch_model.bin"
    torch.save(load_file(weights), binary)
    weights.unlink()
    return config, binary


def manage(env, *args):
    done = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode:
        sys.exit(f"manage.py {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


SETUP = """
from django.contrib.auth.models import User
from leaderboard import tokens
from leaderboard.models import Protocol, Target
from worker.protocol import ProtocolSpec, TaskSpec
t = Target.objects.create(slug="tiny", name="tiny", path="/nonexistent", weights_sha256="0" * 64,
                          vocab_size=64, hidden_size=16, num_layers=4)
spec = ProtocolSpec(slug="bench", version=1, target="tiny", target_sha256="0" * 64,
                    engine="vllm", hardware="cpu", tasks=(TaskSpec("chat", "none", "", 1),),
                    batch_sizes=(1,), ks=(2,), baseline="shared")
Protocol.objects.create(target=t, spec=spec.to_dict())
u = User.objects.create_user("bench")
print("TOKEN" + tokens.create_token(u, "bench")[1])
"""


def peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def upload(port, token, files) -> tuple[int, str, float]:
    boundary = uuid.uuid4().hex
    fields = {"protocol": "bench@1", "method": "draft_model", "name": f"big {uuid.uuid4().hex[:6]}"}
    parts = [(f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n')
             .encode() for k, v in fields.items()]
    heads = [(f'--{boundary}\r\nContent-Disposition: form-data; name="files"; '
              f'filename="{p.name}"\r\nContent-Type: application/octet-stream\r\n\r\n').encode()
             for p in files]
    tail = f"--{boundary}--\r\n".encode()
    length = (sum(map(len, parts)) + sum(map(len, heads)) + sum(p.stat().st_size + 2 for p in files)
              + len(tail))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    t0 = time.monotonic()
    conn.putrequest("POST", "/api/drafters")
    conn.putheader("Authorization", f"Bearer {token}")
    conn.putheader("Content-Type", f"multipart/form-data; boundary={boundary}")
    conn.putheader("Content-Length", str(length))
    conn.endheaders()
    for part in parts:
        conn.send(part)
    for head, path in zip(heads, files):
        conn.send(head)
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(CHUNK), b""):
                conn.send(chunk)
        conn.send(b"\r\n")
    conn.send(tail)
    response = conn.getresponse()
    body = response.read().decode(errors="replace")
    return response.status, body, time.monotonic() - t0


def serve_and_upload(work: Path, label: str, port: int, uploads: list, warmup=()) -> dict:
    """A fresh site under gunicorn (one sync worker, its own SQLite database); each item of
    ``uploads`` (a list of files) sent as one request; the worker's peak RSS before and
    after all of them (``warmup`` uploads are sent before "before": the first request
    imports the site's modules, about 200 MiB that any request costs once)."""
    var = work / f"var-{label}"
    env = {**os.environ, "SPECBOARD_VAR_DIR": str(var), "DEBUG": "0",
           "DATABASE_URL": f"sqlite:///{var / 'db.sqlite3'}",
           "SPECBOARD_MAX_UPLOAD_BYTES": str(4 << 30), "SPECBOARD_SUBMISSIONS_PER_DAY": "0",
           "CELERY_BROKER_URL": "filesystem://", "SPECBOARD_BROKER_KEY_PREFIX": ""}
    var.mkdir(parents=True)
    manage(env, "migrate", "--noinput")
    token = manage(env, "shell", "-c", SETUP).split("TOKEN", 1)[1].strip()
    server = subprocess.Popen([sys.executable, "-m", "gunicorn", "leaderboard.wsgi", "-b",
                               f"127.0.0.1:{port}", "-w", "1", "--timeout", "3600"],
                              cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, start_new_session=True)
    try:
        for _ in range(200):
            try:
                http.client.HTTPConnection("127.0.0.1", port, timeout=2).request("GET", "/api/")
                break
            except OSError:
                time.sleep(0.3)
        worker = int(subprocess.run(["pgrep", "-P", str(server.pid)], capture_output=True,
                                    text=True).stdout.split()[0])
        for files in warmup:
            upload(port, token, files)
        before = peak_rss_kib(worker)
        answers = [upload(port, token, files) for files in uploads]
        peak = peak_rss_kib(worker)
    finally:
        server.terminate()
        server.wait(timeout=30)
    return {"answers": answers, "peak_before_mib": before / 1024, "peak_mib": peak / 1024,
            "checked": check_received(env, var, len(warmup))}


STATES = """
import json
from leaderboard.models import Submission
print("STATES" + json.dumps([[s.state, [p["message"][:120] for p in s.problems]]
                             for s in Submission.objects.order_by("pk")]))
"""


def check_received(env, var: Path, skip: int) -> list[dict]:
    """A real intake worker checks every submission received; each one's end state, time
    and the peak of the largest sandboxed child so far (the worker logs both)."""
    log_path = var / "intake.log"
    with open(log_path, "wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "leaderboard", "worker", "-Q", "intake", "-c",
             "1", "-n", f"bench-intake-{os.getpid()}@%h", "--loglevel", "INFO"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 3600
            while time.monotonic() < deadline:
                states = json.loads(manage(env, "shell", "-c", STATES).split("STATES", 1)[1])
                if all(state != "checking" for state, _ in states):
                    break
                time.sleep(3)
        finally:
            os.killpg(worker.pid, 15)
            worker.wait(timeout=60)
    ended = [line.split("submission ", 1)[1] for line in log_path.read_text().splitlines()
             if "the largest child process so far peaked" in line]
    return [{"state": state, "problems": problems, "log": ended[i] if i < len(ended) else ""}
            for i, (state, problems) in enumerate(states)][skip:]


def child_limit_gib() -> float:
    from worker.checkpoint.sandboxed import limits_for
    return limits_for(4 << 30).address_space / (1 << 30)


def measure(size_mib: int, work: Path, fmt: str = "safetensors") -> dict:
    ckpt = work / f"ckpt-{size_mib}-{fmt}"
    ckpt.mkdir()
    files = (write_pickled if fmt == "bin" else write_checkpoint)(ckpt, size_mib << 20)
    port = 18500 + size_mib % 400 + (1 if fmt == "bin" else 0)
    served = serve_and_upload(work, f"{size_mib}-{fmt}", port, [files])
    status, body, seconds = served["answers"][0]
    return {"size_mib": size_mib, "format": fmt, "bytes": sum(p.stat().st_size for p in files),
            "status": status, "seconds": seconds, "peak_before_mib": served["peak_before_mib"],
            "peak_mib": served["peak_mib"], "body": body[:300], "checked": served["checked"][0]}


def hostile_set(folder: Path) -> list[tuple[str, Path]]:
    """The uploads that cost a web worker hundreds of MiB when it parsed them itself
    (issue #31): four small zips each holding an 8 MiB JSON array as config.json, and a
    .tar.gz whose one member carries a 256 MiB pax extended header."""
    import tarfile
    import zipfile

    out = []
    for i in range(4):
        path = folder / f"array-{i}.zip"
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
            zf.writestr("config.json", b"[" + b"0.5," * (2 << 20) + b"0]")
        out.append(("8 MiB JSON array in a zip", path))
    path = folder / "pax.tar.gz"
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tf:
        info = tarfile.TarInfo("config.json")
        info.pax_headers = {"comment": "x" * (256 << 20)}
        data = b"{}"
        info.size = len(data)
        import io
        tf.addfile(info, io.BytesIO(data))
    out.append(("256 MiB pax header in a .tar.gz", path))
    return out


def measure_hostile(work: Path) -> None:
    folder = work / "hostile"
    folder.mkdir()
    cases = hostile_set(folder)
    warm = folder / "notes.txt"
    warm.write_text("not a checkpoint\n")
    served = serve_and_upload(work, "hostile", 18990, [[path] for _, path in cases],
                              warmup=[[warm]])
    print("\nhostile upload | file size | status | seconds   (after one refused warm-up upload)")
    for (what, path), (status, body, seconds) in zip(cases, served["answers"]):
        print(f"{what:32} | {path.stat().st_size / 1024:7.0f} KiB | {status} | {seconds:6.1f}")
    growth = served["peak_mib"] - served["peak_before_mib"]
    print(f"web worker peak RSS over the whole set: {served['peak_before_mib']:.0f} MiB -> "
          f"{served['peak_mib']:.0f} MiB (+{growth:.0f} MiB; goal: at most +50 MiB)")
    print_checked([what for what, _ in cases], served["checked"])


def print_checked(labels, checked) -> None:
    print(f"\nthe intake worker's checks (each in a sandboxed child limited to "
          f"{child_limit_gib():.1f} GiB of address space here):")
    for label, c in zip(labels, checked):
        print(f"{label:32} | {c['state']:8} | submission {c['log']}")
        for message in c["problems"][:2]:
            print(f"{'':32} |   {message}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="200,2048")
    parser.add_argument("--formats", default="safetensors",
                        help="safetensors and/or bin (pytorch_model.bin, converted by the site)")
    parser.add_argument("--work", default=None, help="folder for the files (default: a temp dir)")
    parser.add_argument("--hostile", action="store_true",
                        help="send the hostile set instead (JSON-array zips, a huge pax header)")
    args = parser.parse_args()
    if args.hostile:
        with tempfile.TemporaryDirectory(dir=args.work, prefix="specboard-upload-") as work:
            measure_hostile(Path(work))
        return
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    formats = [f for f in args.formats.split(",") if f]
    with tempfile.TemporaryDirectory(dir=args.work, prefix="specboard-upload-") as work:
        rows = [measure(s, Path(work), f) for s in sizes for f in formats]
    print("\nupload size | format | status | seconds | web worker peak RSS before -> after upload")
    for r in rows:
        print(f"{r['bytes'] / 2**20:9.0f} MiB | {r['format']:11} | {r['status']} | "
              f"{r['seconds']:7.1f} | {r['peak_before_mib']:.0f} MiB -> {r['peak_mib']:.0f} MiB")
        if r["status"] != 202:
            print(f"   answer: {r['body']}")
    print_checked([f"{r['bytes'] / 2**20:.0f} MiB {r['format']}" for r in rows],
                  [r["checked"] for r in rows])
    if len(rows) > 1:
        print(f"peak ratio largest / smallest upload: "
              f"{rows[-1]['peak_mib'] / rows[0]['peak_mib']:.2f}; highest / lowest peak of all: "
              f"{max(r['peak_mib'] for r in rows) / min(r['peak_mib'] for r in rows):.2f} "
              "(goal: about 1, flat)")


if __name__ == "__main__":
    main()
