"""The training loop every recipe shares: seeded data order, AdamW with warm-up and cosine
decay, gradient clipping, a progress bar, and a resumable checkpoint every few minutes.

The data order is a function of (seed, step) only, so a run resumed from a checkpoint sees
exactly the batches an uninterrupted run would have seen. The checkpoint
(``<out>/train-state.pt``) holds the trainable weights, the optimizer, the step, the loss
history and the training seconds so far; it is written atomically (a killed job leaves the
previous one intact) and refused on resume when the recipe, data or seed differ.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

STATE_FILE = "train-state.pt"


class ResumeError(ValueError):
    """The checkpoint cannot be resumed; the message says why."""


@dataclass
class TrainSettings:
    steps: int
    batch_size: int = 4
    lr: float = 1e-3
    seed: int = 0
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    checkpoint_every_s: float = 300.0
    heldout: int = 0   # the data's last conversations, never trained on (train_recipe)


@dataclass
class TrainReport:
    recipe: str
    steps: int
    seconds: float
    losses: list = field(default_factory=list)
    tokens: int = 0
    # Per step, the share of the batch's first drafted tokens that match the target's
    # (the recipe's "top1"): what a greedy verifier accepts at position 1, on training data.
    top1s: list = field(default_factory=list)

    @staticmethod
    def _tenth_mean(values, last: bool):
        """Mean of the first (or last) tenth of the steps' values; None without any."""
        n = max(1, len(values) // 10)
        part = values[-n:] if last else values[:n]
        return sum(part) / len(part) if part else None

    @property
    def first_loss(self):
        return self._tenth_mean(self.losses, last=False)

    @property
    def final_loss(self):
        return self._tenth_mean(self.losses, last=True)

    @property
    def final_top1(self):
        """Mean top-1 agreement over the last tenth of the steps: set beside the measured
        position-1 acceptance on the evaluation prompts, the gap is how much the drafter
        learnt that does not carry to unseen prompts (the recipe page shows both)."""
        return self._tenth_mean(self.top1s, last=True)

    def to_dict(self):
        return {"recipe": self.recipe, "steps": self.steps, "seconds": round(self.seconds, 3),
                "first_loss": self.first_loss, "final_loss": self.final_loss,
                "final_top1": self.final_top1, "tokens": self.tokens}


@torch.no_grad()
def evaluate_top1(recipe, data, indices, batch_size: int = 8) -> float | None:
    """The recipe's top-1 (the share of first drafted tokens equal to the target's) over the
    conversations ``indices`` of ``data`` with the current weights, weighted by answer
    tokens; None when there are none."""
    was_training = recipe.module.training
    recipe.module.eval()
    total = weight = 0.0
    try:
        for start in range(0, len(indices), batch_size):
            batch = data.batch(indices[start:start + batch_size])
            _, metrics = recipe.loss(batch)
            if metrics.get("top1") is None:
                continue
            answers = float((batch["lengths"] - batch["prompt_lens"]).sum())
            total += metrics["top1"] * answers
            weight += answers
    finally:
        recipe.module.train(was_training)
    return total / weight if weight else None


def batch_indices(n: int, batch_size: int, seed: int, step: int) -> list[int]:
    """Conversations of batch ``step``: a fresh seeded permutation per pass over the data."""
    per_epoch = max(1, n // batch_size)
    epoch, slot = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
    return perm[slot * batch_size:(slot + 1) * batch_size].tolist()


def lr_at(step: int, s: TrainSettings) -> float:
    if s.warmup_steps and step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(recipe, data, out_dir, settings: TrainSettings, resume: bool = False,
          progress: bool = True, stop_after_steps: int | None = None) -> TrainReport:
    """Train ``recipe`` (worker.training.recipes) on ``data`` (TrainingData). Checkpoints to
    ``out_dir``; with ``resume`` continues from its checkpoint. ``stop_after_steps`` ends
    the run early after a checkpoint at that step, as a killed job would (for tests)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state_path = out_dir / STATE_FILE
    torch.manual_seed(settings.seed)
    params = [p for p in recipe.module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    identity = {"recipe": recipe.name, "data_sha256": data.sha256, "seed": settings.seed,
                "settings": {k: v for k, v in asdict(settings).items() if k != "checkpoint_every_s"}}
    report = TrainReport(recipe.name, 0, 0.0)
    if resume:
        if not state_path.is_file():
            raise ResumeError(f"nothing to resume: {state_path} does not exist (train without --resume)")
        state = torch.load(state_path, weights_only=True)
        written = dict(state["identity"])
        # Checkpoints from before held-out data trained on all of it.
        written["settings"] = {"heldout": 0, **written["settings"]}
        for key in ("recipe", "data_sha256", "seed", "settings"):
            if written[key] != identity[key]:
                raise ResumeError(f"{state_path} was written with {key} {written[key]!r}, "
                                  f"this run has {identity[key]!r}: resume with the same settings "
                                  "or train into another folder")
        recipe.module.load_state_dict(state["module"])
        optimizer.load_state_dict(state["optimizer"])
        report = TrainReport(recipe.name, state["step"], state["seconds"], list(state["losses"]),
                             state["tokens"], list(state.get("top1s", [])))

    def save_state():
        tmp = state_path.with_suffix(".part")
        torch.save({"identity": identity, "module": recipe.module.state_dict(),
                    "optimizer": optimizer.state_dict(), "step": report.steps,
                    "seconds": report.seconds, "losses": report.losses, "tokens": report.tokens,
                    "top1s": report.top1s}, tmp)
        tmp.replace(state_path)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=settings.steps, initial=report.steps, desc=recipe.name, unit="step",
                   file=sys.stderr, dynamic_ncols=True)
    recipe.module.train()
    last_save = time.monotonic()
    started = time.monotonic() - report.seconds
    while report.steps < settings.steps:
        step = report.steps
        batch = data.batch(batch_indices(len(data), settings.batch_size, settings.seed, step))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, settings)
        loss, metrics = recipe.loss(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if settings.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
        optimizer.step()
        report.steps += 1
        report.losses.append(float(loss.detach()))
        report.tokens += int(batch["lengths"].sum())
        if metrics.get("top1") is not None:
            report.top1s.append(float(metrics["top1"]))
        report.seconds = time.monotonic() - started
        if bar is not None:
            bar.set_postfix(loss=f"{report.losses[-1]:.4f}", **{k: f"{v:.3f}" for k, v in metrics.items()})
            bar.update(1)
        if time.monotonic() - last_save >= settings.checkpoint_every_s:
            save_state()
            last_save = time.monotonic()
        if stop_after_steps is not None and report.steps >= stop_after_steps:
            break
    save_state()
    if bar is not None:
        bar.close()
    recipe.module.eval()
    return report
