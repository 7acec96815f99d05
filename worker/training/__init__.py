"""Baseline drafter training (no Django): shared target-generated data (data.py), recipes
(recipes.py) and one training loop with resumable checkpoints (loop.py).

    train_recipe("eagle", target_dir, dataset_file, target_sha256, out_dir, seed=0)

writes ``out_dir/drafter/`` (config.json + model.safetensors, the format the engines load
and worker/checkpoint accepts), ``out_dir/train-state.pt`` (the checkpoint) and
``out_dir/training.json`` (recipe, data sha256, seed, settings, loss, seconds).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from .loop import ResumeError, TrainReport, TrainSettings, train  # noqa: F401
from .recipes import RECIPES, build_recipe, load_target  # noqa: F401

MAX_THREADS = 2  # the machines this runs on are shared


def limit_threads():
    """At most 2 torch threads (SPECBOARD_TRAIN_THREADS for fewer); never more than the
    process already uses (a caller that chose 1 thread on a busy machine keeps it)."""
    threads = int(os.environ.get("SPECBOARD_TRAIN_THREADS", MAX_THREADS))
    torch.set_num_threads(max(1, min(threads, MAX_THREADS, torch.get_num_threads())))


def train_recipe(recipe_name, target_dir, dataset_file, target_sha256, out_dir, *, seed=0,
                 steps=None, batch_size=None, lr=None, options=None, resume=False,
                 checkpoint_every_s=300.0, progress=True, stop_after_steps=None,
                 say=print, target=None, heldout: int = 0) -> dict:
    """Train one recipe and write its drafter folder. Returns the training summary.
    ``target``: the target already loaded, (Llama, config.json dict), to skip loading it.
    ``heldout``: the data's last conversations are not trained on (nor used to choose a
    reduced vocabulary); at the end the drafter's top-1 is measured on them and on as many
    training conversations (``heldout_top1``, ``train_sample_top1``): the gap between the
    two is over-fitting, which more data would close."""
    from .data import load_training_data

    limit_threads()
    if recipe_name not in RECIPES:
        raise ValueError(f"unknown recipe {recipe_name!r}; known: {', '.join(sorted(RECIPES))}")
    cls = RECIPES[recipe_name]
    options = {k: v for k, v in (options or {}).items() if v is not None}
    torch.manual_seed(seed)  # the head's initial weights
    target, target_hf = target or load_target(target_dir)
    recipe = build_recipe(recipe_name, target, target_hf, **options)
    which = f" after layers {', '.join(map(str, recipe.feature_layers))}" if recipe.feature_layers else ""
    say(f"[{recipe_name}] target hidden states{which} for the training data "
        "(computed once per dataset and cached beside it) ...")
    bar = None
    if progress:
        from tqdm import tqdm

        def show(event):
            nonlocal bar
            _, done, total = event
            bar = bar or tqdm(total=total, desc="hidden states", unit="conv", file=sys.stderr)
            bar.update(done - bar.n)
    data = load_training_data(dataset_file, target, target_sha256, layers=recipe.feature_layers,
                              progress=show if progress else None)
    if bar is not None:
        bar.close()
    held = None
    if heldout:
        data, held = data.split(heldout)
    recipe.set_vocabulary(data.vocabulary(), data)
    settings = TrainSettings(
        steps=steps or RECIPES[recipe_name].default_steps, seed=seed,
        batch_size=batch_size or cls.defaults.get("batch_size", 4),
        lr=lr or cls.defaults.get("lr", 1e-3), checkpoint_every_s=checkpoint_every_s,
        heldout=heldout)
    settings.warmup_steps = max(1, settings.steps // 20)
    say(f"[{recipe_name}] {len(data)} conversations, {data.tokens} tokens "
        f"({len(recipe.vocab)} distinct); {settings.steps} steps "
        f"of {settings.batch_size} conversations, lr {settings.lr}, seed {seed}")
    out_dir = Path(out_dir)
    report = train(recipe, data, out_dir, settings, resume=resume, progress=progress,
                   stop_after_steps=stop_after_steps)
    drafter_dir = out_dir / "drafter"
    recipe.save(drafter_dir)
    summary = {**report.to_dict(), "method": recipe.method, "data_sha256": data.sha256,
               "seed": seed, "settings": settings.__dict__, "options": recipe.describe(),
               "finished": report.steps >= settings.steps, "drafter_dir": str(drafter_dir)}
    if held is not None and summary["finished"]:
        from .loop import evaluate_top1

        sample = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))
        summary["heldout_top1"] = evaluate_top1(recipe, held, list(range(len(held))))
        summary["train_sample_top1"] = evaluate_top1(recipe, data, sample[:len(held)].tolist())
        say(f"[{recipe_name}] top-1 on {len(held)} held-out conversations "
            f"{summary['heldout_top1']:.3f}, on as many training ones "
            f"{summary['train_sample_top1']:.3f}")
    (out_dir / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def acceptance(target_dir, method, drafter_dir, prompts, k=3, max_new_tokens=64, engine=None):
    """Acceptance length of a drafter on chat prompts with the reference engine (greedy),
    and whether every output equals the target's own greedy output."""
    from worker import metrics, traces
    from worker.engines.reference import ReferenceEngine
    from worker.methods import make_proposer

    engine = engine or ReferenceEngine(target_dir)
    ids = [engine.encode_chat(p) for p in prompts]
    plain = engine.generate(ids, max_new_tokens=max_new_tokens)
    spec = engine.generate(ids, proposer=make_proposer(method, str(drafter_dir)), k=k,
                           max_new_tokens=max_new_tokens)
    counts = traces.spec_counts(spec)
    lossless = all(a.output_ids == b.output_ids for a, b in zip(plain, spec))
    plain_s = sum(r.timings["wall"] for r in plain) / len(plain)
    spec_s = sum(r.timings["wall"] for r in spec) / len(spec)
    return {"acceptance_length": metrics.acceptance_length(counts), "lossless": lossless,
            "drafts": counts.drafts,
            "plain_seconds": round(plain_s, 2), "speculative_seconds": round(spec_s, 2)}
