"""Trained drafters shipped with the repository (``drafters/`` at its root, or
SPECBOARD_SHIPPED_DRAFTERS_DIR): one folder per drafter holding the checkpoint the engines
load (config.json + *.safetensors) and ``training.json``, its training record.

- `register_shipped_drafters` (setup_demo): each folder becomes a drafter through
  `submit_drafter`, the upload path, so a bad file is refused with the upload's message and
  nothing is stored; a folder whose files are already a drafter of the target is skipped
  (running it twice registers nothing new; a changed file is a new drafter, as an upload).
- `ship_drafter` (``manage.py ship_drafter``): the other way, a trained drafter's stored
  files and training record written as such a folder.

training.json is flat, with train_recipe's names (worker/training: recipe, method,
data_sha256, seed, steps, seconds = training seconds, first_loss, final_loss, final_top1, tokens,
settings, options) and the data's figures under the names the API gives them
(data_slug, data_version, data_conversations, data_tokens, data_answer_tokens,
data_seconds), plus target and target_sha256.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from django.conf import settings
from django.core.files.storage import default_storage

from worker.checkpoint import Upload, checkpoint_content_sha256
from worker.prompts import file_sha256

from ..models import Drafter, Protocol, TrainingDataset
from ..selectors.shapes import DATA_FIGURES, heldout_of, training_data_figures
from .errors import ServiceError
from .submissions import SubmissionRefused, submit_drafter
from .training import DETAIL_KEYS, drafter_name, recipe_options_for

TRAINING_FILE = "training.json"
# Files of a shipped folder that are not part of the checkpoint (nor of its content hash).
NOT_CHECKPOINT = (TRAINING_FILE, "README.md")


class ShippedRefused(ServiceError):
    """A shipped folder that cannot be registered; the message names the folder and what to fix."""


@dataclass
class ShippedReport:
    registered: list[Drafter] = field(default_factory=list)
    present: list[Drafter] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)  # (folder, message)

    @property
    def drafters(self) -> list[Drafter]:
        """Registered or already present, in folder order, withdrawn and rejected ones left out."""
        return [d for d in self.registered + self.present
                if d.review_state not in ("withdrawn", "rejected")]


def shipped_folders(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def read_training_record(folder: Path) -> dict:
    """training.json of a shipped folder, its required fields checked."""
    from worker.training.recipes import RECIPES

    path = folder / TRAINING_FILE
    where = f"{folder.name}/{TRAINING_FILE}"
    if not path.is_file():
        raise ShippedRefused(f"{folder.name}: no {TRAINING_FILE} (the training record: recipe, "
                             "data, seed, training figures); write the folder with "
                             "`manage.py ship_drafter`")
    try:
        record = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ShippedRefused(f"{where}: not valid JSON ({e})") from None
    if not isinstance(record, dict):
        raise ShippedRefused(f"{where}: must be a JSON object")

    def need(key, kind, what):
        value = record.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ShippedRefused(f"{where}: field {key!r} must be {what}, got {value!r}")
        return value

    recipe = need("recipe", str, f"one of the recipes ({', '.join(sorted(RECIPES))})")
    if recipe not in RECIPES:
        raise ShippedRefused(f"{where}: unknown recipe {recipe!r}; known: {', '.join(sorted(RECIPES))}")
    if need("method", str, "a drafting method") != RECIPES[recipe].method:
        raise ShippedRefused(f"{where}: the {recipe} recipe trains {RECIPES[recipe].method} "
                             f"drafters, not {record['method']!r}")
    for key in ("target_sha256", "data_sha256"):
        value = need(key, str, "a sha256 (64 hex digits)")
        if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
            raise ShippedRefused(f"{where}: field {key!r} must be a sha256 (64 hex digits), got {value!r}")
    need("seed", int, "an integer")
    need("steps", int, "an integer")
    need("seconds", (int, float), "the training time in seconds")
    return record


def _uploads(folder: Path) -> list[Upload]:
    return [Upload(f.name, f, f.stat().st_size) for f in sorted(folder.iterdir())
            if f.is_file() and f.name not in NOT_CHECKPOINT]


def register_shipped(folder: Path, protocol: Protocol) -> tuple[Drafter, bool]:
    """(the drafter of a shipped folder, whether it was registered now). Registered without
    a run (setup_demo --queue-runs queues it). Raises ShippedRefused."""
    record = read_training_record(folder)
    target = protocol.target
    if record["target_sha256"] != target.weights_sha256:
        raise ShippedRefused(
            f"{folder.name}: trained for target {record.get('target', '?')} with weights sha256 "
            f"{record['target_sha256'][:12]}..., but {protocol} measures {target.slug} "
            f"({target.weights_sha256[:12]}...); ship a drafter of this target")
    try:
        recipe_options_for(protocol, record["recipe"], record.get("options"))
    except ServiceError as e:
        raise ShippedRefused(f"{folder.name}: {e}") from None
    uploads = _uploads(folder)
    content = checkpoint_content_sha256(
        sorted(folder.glob("*.safetensors")), json.loads((folder / "config.json").read_text()))
    existing = (Drafter.objects.filter(target=target, content_sha256=content)
                .order_by("created_at", "pk").first())
    if existing is not None:
        return existing, False
    dataset = (TrainingDataset.objects.filter(sha256=record["data_sha256"], target=target)
               .order_by("-version").first())
    recipe, seed = record["recipe"], record["seed"]
    figures = {k: record.get(k) for k in DATA_FIGURES}
    details = {**{k: record[k] for k in DETAIL_KEYS if k in record}, **figures,
               "shipped": folder.name}
    loss = record.get("final_loss")
    description = (
        f"Baseline drafter trained by the {recipe} recipe (`manage.py train_drafter --recipe "
        f"{recipe}`) on the target's own conversations {figures['data_slug'] or ''} "
        f"(sha256 {record['data_sha256'][:12]}...), seed {seed}, {record['steps']} steps in "
        f"{record['seconds'] / 60:.1f} min" + (f", final loss {loss:.4f}" if loss else "")
        + f"; shipped with SpecBoard in drafters/{folder.name}.")
    try:
        drafter, _ = submit_drafter(
            owner=None, protocol=protocol, method=record["method"],
            name=drafter_name(recipe, figures["data_slug"], figures["data_version"], seed,
                              heldout_of(record)),
            uploads=uploads, description=description,
            licence=f"as the target's ({target.name})", queue=False,
            extra_fields=dict(trained_by_recipe=recipe, training_data=dataset,
                              training_data_sha256=record["data_sha256"], training_seed=seed,
                              training_seconds=round(float(record["seconds"]), 3),
                              training_details=json.loads(json.dumps(details))))
    except SubmissionRefused as e:
        if e.existing is not None:
            return e.existing, False
        raise ShippedRefused(f"{folder.name}: refused as an upload would be: "
                             + "; ".join(str(p) for p in e.problems)) from None
    return drafter, True


def register_shipped_drafters(protocol: Protocol, root=None) -> ShippedReport:
    """Register every folder under ``root`` (default SHIPPED_DRAFTERS_DIR) for the
    protocol's target; a refused folder is reported and the others still registered."""
    report = ShippedReport()
    for folder in shipped_folders(Path(root or settings.SHIPPED_DRAFTERS_DIR)):
        try:
            drafter, created = register_shipped(folder, protocol)
        except ShippedRefused as e:
            report.refused.append((folder.name, str(e)))
            continue
        (report.registered if created else report.present).append(drafter)
    return report


def training_record(drafter: Drafter) -> dict:
    """The training.json of a trained drafter (see the module's docstring)."""
    if not drafter.trained_by_recipe:
        raise ServiceError(f"drafter {drafter.slug} was not trained by a recipe here, so it has "
                           "no training record to ship (only train_drafter's drafters ship)")
    details = drafter.training_details or {}
    figures = training_data_figures(drafter)
    return {"recipe": drafter.trained_by_recipe, "method": drafter.method,
            "target": drafter.target.slug, "target_sha256": drafter.target.weights_sha256,
            **figures, "seed": drafter.training_seed, "seconds": drafter.training_seconds,
            **{k: details[k] for k in DETAIL_KEYS if k in details}}


def ship_drafter(drafter: Drafter, root=None, folder_name: str | None = None,
                 replace: bool = False) -> tuple[Path, bool]:
    """Write a trained drafter's files and training record as ``root/folder_name`` (default:
    SHIPPED_DRAFTERS_DIR / its slug). (the folder, whether it changed): the same content
    already there is left as it is; other content is refused unless ``replace``."""
    record = training_record(drafter)
    files = list(drafter.files.order_by("name"))
    if not any(f.name == "config.json" for f in files):
        raise ServiceError(f"drafter {drafter.slug} has no stored config.json to ship")
    if any("/" in f.name for f in files):
        raise ServiceError(f"drafter {drafter.slug} has files in sub-folders; only flat "
                           "checkpoints ship")
    root = Path(root or settings.SHIPPED_DRAFTERS_DIR)
    dest = root / (folder_name or drafter.slug)
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".ship-") as tmp:
        out = Path(tmp) / dest.name
        out.mkdir()
        for f in files:
            with default_storage.open(f.file.name, "rb") as src, open(out / f.name, "wb") as dst:
                shutil.copyfileobj(src, dst)
            if file_sha256(out / f.name) != f.sha256:
                raise ServiceError(f"drafter {drafter.slug}: the stored {f.name} does not match "
                                   "its recorded sha256; nothing shipped")
        (out / TRAINING_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        if dest.exists():
            if _same_files(out, dest):
                return dest, False
            if not replace:
                raise ServiceError(f"{dest} holds other files; pass --replace to overwrite it")
            shutil.rmtree(dest)
        out.rename(dest)
    return dest, True


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return (names == sorted(p.name for p in b.iterdir())
            and all((b / n).is_file() and file_sha256(a / n) == file_sha256(b / n) for n in names))
