"""Training services: the shared training data of a target (make_training_data) and the
baseline drafters trained on it (train_drafter), registered and queued like a submission.

Writes go through here; the library that generates and trains is worker/training (no
Django). A dataset's file is stored through Django's storage (so remote workers can read
it) and read from a local copy under DATA_DIR.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from django.conf import settings
from django.core.files import File
from django.core.files.storage import default_storage
from django.db import transaction
from django.db.models import Q
from django.utils.text import slugify

from worker.checkpoint import Upload
from worker.prompts import file_sha256
from worker.protocol import parse_version

from ..models import Drafter, Prompt, Protocol, Target, TrainingDataset
from ..selectors.shapes import heldout_of
from .errors import ServiceError
from .submissions import SubmissionRefused, submit_drafter

# What train_recipe's summary holds (worker.training.TrainReport.to_dict, settings, options)
# that a drafter's training record repeats: training_details, a shipped training.json.
DETAIL_KEYS = ("steps", "first_loss", "final_loss", "final_top1", "heldout_top1",
               "train_sample_top1", "tokens", "settings", "options")


def find_target(slug: str) -> Target:
    target = Target.objects.filter(slug=slug).first()
    if target is None:
        known = ", ".join(Target.objects.values_list("slug", flat=True)) or "none (run setup_demo)"
        raise ServiceError(f"no target {slug!r}; known targets: {known}")
    if not target.path or not (Path(target.path) / "config.json").is_file():
        raise ServiceError(f"target {slug}: its checkpoint folder {target.path!r} is missing on "
                           "this machine (run setup_demo, or set the target's path)")
    return target


def find_dataset(spec: str) -> TrainingDataset:
    """``slug`` (the newest version) or ``slug@version``."""
    slug, _, version = spec.partition("@")
    qs = TrainingDataset.objects.filter(slug=slug)
    if version:
        if parse_version(version) is None:
            raise ServiceError(f"bad dataset version {version!r} in {spec!r}: use SLUG@N")
        qs = qs.filter(version=parse_version(version))
    row = qs.order_by("-version").first()
    if row is None:
        known = ", ".join(sorted(set(TrainingDataset.objects.values_list("slug", flat=True))))
        raise ServiceError(f"no training data {spec!r}; make it with `manage.py "
                           f"make_training_data` (known: {known or 'none'})")
    return row


def find_protocol(spec: str | None, target: Target) -> Protocol:
    """``slug`` (newest version) or ``slug@version``; None: the target's newest protocol."""
    if not spec:
        protocol = Protocol.objects.filter(target=target).order_by("-created_at").first()
        if protocol is None:
            raise ServiceError(f"target {target.slug} has no protocol to measure under; "
                               "create one (setup_demo) or pass --protocol")
        return protocol
    slug, _, version = spec.partition("@")
    qs = Protocol.objects.filter(slug=slug)
    if version:
        number = parse_version(version)
        qs = qs.filter(version=number) if number is not None else qs.none()
    protocol = qs.order_by("-version").first()
    if protocol is None:
        raise ServiceError(f"no protocol {spec!r}")
    if protocol.target_id != target.pk:
        raise ServiceError(f"protocol {protocol} measures target {protocol.target.slug}, "
                           f"not {target.slug}")
    return protocol


def evaluation_prompt_hashes() -> dict:
    """{hash of a normalised turn: a label naming the prompt} over every turn of every
    prompt of every prompt set (each is an evaluation set, used by a protocol or not yet)."""
    from worker.training.data import text_sha256

    used_by = {}
    for p in Protocol.objects.all():
        for task in p.spec.tasks:
            used_by.setdefault(task.prompt_set, []).append(f"{p.slug} v{p.version}")
    out = {}
    for prompt in Prompt.objects.select_related("prompt_set").iterator():
        slug = prompt.prompt_set.slug
        where = f" of protocol {', '.join(sorted(set(used_by[slug])))}" if slug in used_by else ""
        for i, turn in enumerate(prompt.turns or []):
            if isinstance(turn, str) and turn.strip():
                out.setdefault(text_sha256(turn),
                               f"{slug}#{prompt.external_id} (turn {i + 1}{where})")
    return out


def dataset_local_path(dataset: TrainingDataset) -> Path:
    """A local copy of the dataset's file (the storage's own path when it has one)."""
    try:
        path = Path(default_storage.path(dataset.path))
        if path.is_file():
            return path
    except NotImplementedError:  # an object store: copy it once
        pass
    local = settings.DATA_DIR / "training" / dataset.sha256 / "conversations.jsonl"
    if not local.is_file():
        local.parent.mkdir(parents=True, exist_ok=True)
        with default_storage.open(dataset.path, "rb") as src, open(local.with_suffix(".part"), "wb") as out:
            shutil.copyfileobj(src, out)
        local.with_suffix(".part").rename(local)
    return local


WRITERS = ("vllm", "reference")
DEFAULT_WRITE_BATCH = {"vllm": 256, "reference": 16}


def make_training_data(target: Target, n: int, *, slug: str | None = None, prompts_file=None,
                       seed: int = 0, max_question_tokens: int = 48, max_answer_tokens: int = 192,
                       answer_temperature: float = 0.0, batch_size: int | None = None,
                       engine: str = "vllm", skip_existing: bool = False,
                       question_starts_file=None, progress=None,
                       say=None) -> tuple[TrainingDataset, bool]:
    """Generate (or answer ``prompts_file``) ``n`` conversations with the target and store
    them as the next version of ``slug``. The same content as that slug's newest version is
    a no-op, and so is any existing version with ``skip_existing``. Evaluation prompts are
    refused (a prompts file) or dropped (generated).

    ``engine``: "vllm" (the engine of record, many sequences in flight) or "reference".
    ``question_starts_file``: JSON lines of openings the target continues into its questions
    (for data closer to the evaluation's tasks without their prompts).
    Finished rounds are kept under DATA_DIR/training/rounds/, so the same command run again
    after an interruption continues where it stopped, and a larger ``n`` extends them."""
    from worker.training import limit_threads
    from worker.training.data import (GenerationSettings, TrainingDataError, generate_conversations,
                                      kept_conversations, read_prompts_file)

    if n < 1:
        raise ServiceError("--n must be at least 1")
    if engine not in WRITERS:
        raise ServiceError(f"--engine must be one of {', '.join(WRITERS)}")
    origin = "prompts" if prompts_file else "starts" if question_starts_file else "self"
    slug = slug or slugify(f"{target.slug}-{origin}-chat")
    if skip_existing:
        existing = TrainingDataset.objects.filter(slug=slug, target=target).order_by("-version").first()
        if existing is not None:
            return existing, False
    forbidden = evaluation_prompt_hashes()
    prompts = read_prompts_file(prompts_file) if prompts_file else None
    if prompts is not None:
        from worker.training.data import check_not_evaluation

        try:
            check_not_evaluation(prompts, forbidden, where=f"{prompts_file}: ")
        except TrainingDataError as e:
            raise ServiceError(str(e)) from None
    starts = ()
    if question_starts_file:
        if prompts is not None:
            raise ServiceError("--question-starts opens questions the target writes; with "
                               "--prompts there are none")
        try:
            starts = tuple(read_prompts_file(question_starts_file))
        except TrainingDataError as e:
            raise ServiceError(f"--question-starts: {e}") from None
    gen = GenerationSettings(n=n, seed=seed, max_question_tokens=max_question_tokens,
                             max_answer_tokens=max_answer_tokens,
                             answer_temperature=answer_temperature,
                             batch_size=batch_size or DEFAULT_WRITE_BATCH[engine], engine=engine,
                             question_starts=starts)
    # Finished rounds are kept per generation settings (n aside), so an interrupted command
    # continues, and a larger --n extends a smaller one's conversations.
    key = hashlib.sha256(json.dumps([{k: v for k, v in gen.to_dict().items() if k != "n"},
                                     target.weights_sha256,
                                     file_sha256(prompts_file) if prompts_file else None],
                                    sort_keys=True).encode()).hexdigest()[:16]
    checkpoint = settings.DATA_DIR / "training" / "rounds" / key
    copy_shipped_rounds(key, checkpoint, say)
    held = kept_conversations(checkpoint)
    if say and held:
        say(f"{held} conversations of these settings are kept in {checkpoint}; "
            + (f"taking the first {n}" if held >= n else f"continuing from there to {n}"))
    limit_threads()
    if engine == "vllm":
        from worker.training.vllm_writer import VllmWriter

        writer = VllmWriter(target.path, hardware="cpu", seed=seed)
    else:
        from worker.engines.reference import ReferenceEngine

        writer = ReferenceEngine(target.path)
    try:
        records, stats = generate_conversations(writer, gen, prompts=prompts, forbidden=forbidden,
                                                progress=progress, checkpoint=checkpoint)
    except TrainingDataError as e:
        raise ServiceError(str(e)) from None
    finally:
        if hasattr(writer, "shutdown"):
            writer.shutdown()
    return store_dataset(records, slug, target,
                         source=Path(prompts_file).name if prompts_file else "generated",
                         params={"generation": gen.to_dict(), "stats": stats,
                                 "target_sha256": target.weights_sha256})


def store_dataset(records: list[dict], slug: str, target: Target, *, source: str,
                  params: dict) -> tuple[TrainingDataset, bool]:
    """Store ``records`` as the next version of ``slug``; (the newest version, False) when
    it has the same content already."""
    from worker.training.data import write_dataset

    with tempfile.TemporaryDirectory(dir=_tmp_root()) as tmp:
        local = Path(tmp) / "conversations.jsonl"
        sha = write_dataset(records, local)
        latest = TrainingDataset.objects.filter(slug=slug).order_by("-version").first()
        if latest is not None and latest.sha256 == sha:
            return latest, False
        if latest is not None and latest.target_id != target.pk:
            raise ServiceError(f"training data {slug!r} belongs to target {latest.target.slug}; "
                               "choose another --slug")
        version = (latest.version + 1) if latest else 1
        with transaction.atomic():
            with open(local, "rb") as fh:
                name = default_storage.save(f"training-data/{slug}/v{version}/conversations.jsonl", File(fh))
            row = TrainingDataset.objects.create(
                slug=slug, version=version, target=target, sha256=sha, n=len(records),
                tokens=sum(len(r["input_ids"]) for r in records), path=name, source=source,
                params=params)
    return row, True


def mix_training_data(slug: str, specs: list[str]) -> tuple[TrainingDataset, bool]:
    """The conversations of several datasets of one target as one dataset (the next
    version of ``slug``): interleaved in proportion, duplicates and evaluation prompts
    dropped (worker.training.data.mix_conversations). Its stats name each part's sha256,
    and its seconds are the sum of the parts' own."""
    from worker.training.data import TrainingDataError, mix_conversations, read_dataset

    parts = [find_dataset(spec) for spec in specs]
    if len({p.pk for p in parts}) < len(parts):
        raise ServiceError("a dataset is named twice; a mix takes each once")
    targets = {p.target.slug for p in parts}
    if len(targets) > 1:
        raise ServiceError(f"the datasets are of different targets ({', '.join(sorted(targets))}); "
                           "a drafter is trained for one target")
    if slug in {p.slug for p in parts}:
        raise ServiceError(f"--slug {slug!r} is one of the parts; name the mix otherwise")
    try:
        records, stats = mix_conversations(
            [(str(p), read_dataset(dataset_local_path(p))) for p in parts],
            forbidden=evaluation_prompt_hashes())
    except TrainingDataError as e:
        raise ServiceError(str(e)) from None
    for part, row in zip(stats["parts"], parts):
        part.update(slug=row.slug, version=row.version, sha256=row.sha256)
    # What the data cost is what its parts cost to write.
    seconds = [((row.params or {}).get("stats") or {}).get("seconds") for row in parts]
    stats["seconds"] = None if None in seconds else round(sum(seconds), 1)
    return store_dataset(records, slug, parts[0].target,
                         source="mix of " + ", ".join(str(p) for p in parts),
                         params={"stats": stats, "target_sha256": parts[0].target.weights_sha256})


def copy_shipped_rounds(key: str, checkpoint: Path, say=None) -> bool:
    """Rounds of a generation shipped with the repository (``training-data/rounds/KEY/``:
    ``rounds.jsonl.gz`` and ``state.json``, the demo data written on the project's machine),
    copied in where none are kept yet: the same command then continues them (or takes its
    first N) instead of writing them again. The copy holds the folder's generation lock, so
    it never overwrites rounds another generation has started appending, and state.json
    comes last, so a reader sees no rounds or all of them."""
    import gzip

    from worker.training.data import generation_lock

    shipped = Path(settings.SHIPPED_ROUNDS_DIR) / key
    if not (shipped / "state.json").is_file() or not (shipped / "rounds.jsonl.gz").is_file():
        return False
    if (checkpoint / "state.json").is_file():
        return False
    with generation_lock(checkpoint, f"copying the shipped rounds {shipped}"):
        if (checkpoint / "state.json").is_file():   # another call got there first
            return False
        with gzip.open(shipped / "rounds.jsonl.gz", "rb") as src, \
                open(checkpoint / "rounds.jsonl.part", "wb") as out:
            shutil.copyfileobj(src, out)
        (checkpoint / "rounds.jsonl.part").replace(checkpoint / "rounds.jsonl")
        shutil.copyfile(shipped / "state.json", checkpoint / "state.json.part")
        (checkpoint / "state.json.part").replace(checkpoint / "state.json")
    if say:
        say(f"rounds shipped in {shipped} copied to {checkpoint}")
    return True


def _tmp_root() -> Path:
    root = settings.DATA_DIR / "tmp"
    root.mkdir(parents=True, exist_ok=True)
    return root


def train_and_register(recipe: str, target: Target, dataset: TrainingDataset, protocol: Protocol,
                       *, seed: int = 0, steps=None, batch_size=None, lr=None, options=None,
                       out_dir=None, resume=False, checkpoint_minutes: float = 5.0,
                       progress=True, say=print, send=True, stop_after_steps=None,
                       heldout: int = 0):
    """Train ``recipe`` on ``dataset`` and register the result as a baseline drafter of
    ``protocol`` (files through the submission path, run queued). Returns (summary,
    drafter or None, run or None); an unfinished run (``stop_after_steps``) registers
    nothing and can be resumed. ``heldout``: the data's last conversations are left out of
    training and the drafter's top-1 is measured on them (worker.training.train_recipe)."""
    from worker.training import train_recipe
    from worker.training.data import check_not_evaluation, read_dataset

    if dataset.target_id != target.pk:
        raise ServiceError(f"training data {dataset} was written by target {dataset.target.slug}, "
                           f"not {target.slug}")
    local = dataset_local_path(dataset)
    # Protocols may have been added since the data were made: check again before training.
    try:
        check_not_evaluation([r.get("user", "") for r in read_dataset(local)],
                             evaluation_prompt_hashes(), where=f"training data {dataset}: ")
    except ValueError as e:
        raise ServiceError(str(e)) from None
    options = recipe_options_for(protocol, recipe, options)
    out_dir = Path(out_dir or settings.DATA_DIR / "training-runs" / f"{dataset.slug}-v{dataset.version}"
                   / (f"{recipe}-seed{seed}" + (f"-heldout{heldout}" if heldout else "")))
    if resume == "if_any":  # continue an interrupted run, start one otherwise
        from worker.training.loop import STATE_FILE

        resume = (out_dir / STATE_FILE).is_file()
    summary = train_recipe(recipe, target.path, local, target.weights_sha256, out_dir, seed=seed,
                           steps=steps, batch_size=batch_size, lr=lr, options=options,
                           resume=resume, checkpoint_every_s=checkpoint_minutes * 60,
                           progress=progress, stop_after_steps=stop_after_steps, say=say,
                           heldout=heldout)
    if not summary["finished"]:
        return summary, None, None
    drafter, run = register_drafter(summary, recipe, dataset, protocol, send=send)
    return summary, drafter, run


def recipe_options_for(protocol: Protocol, recipe: str, options: dict | None) -> dict:
    """The recipe's options for what the protocol measures (Recipe.options_for); a
    ServiceError naming the protocol when it cannot measure them (the message reads on
    from the protocol's name)."""
    from worker.training.recipes import RECIPES

    try:
        return RECIPES[recipe].options_for(protocol.spec.ks, options)
    except ValueError as e:
        raise ServiceError(f"protocol {protocol} {e}") from None


def register_drafter(summary: dict, recipe: str, dataset: TrainingDataset, protocol: Protocol,
                     send=True):
    """Store a trained drafter's folder like an upload and queue its run."""
    folder = Path(summary["drafter_dir"])
    uploads = [Upload(f.name, f, f.stat().st_size) for f in sorted(folder.iterdir()) if f.is_file()]
    loss = summary.get("final_loss")
    name = drafter_name(recipe, dataset.slug, dataset.version, summary["seed"],
                        heldout_of(summary))
    description = (f"Baseline drafter trained on this site by the {recipe} recipe "
                   f"(`manage.py train_drafter --recipe {recipe}`) on the target's own "
                   f"conversations {dataset.slug} v{dataset.version} (sha256 {dataset.sha256[:12]}...), "
                   f"seed {summary['seed']}, {summary['steps']} steps in "
                   f"{summary['seconds'] / 60:.1f} min" + (f", final loss {loss:.4f}" if loss else "") + ".")
    details = {k: summary[k] for k in DETAIL_KEYS if k in summary}
    try:
        return submit_drafter(
            owner=None, protocol=protocol, method=summary["method"], name=name, uploads=uploads,
            description=description, licence=f"as the target's ({dataset.target.name})", send=send,
            extra_fields=dict(trained_by_recipe=recipe, training_data=dataset,
                              training_data_sha256=dataset.sha256, training_seed=summary["seed"],
                              training_seconds=round(summary["seconds"], 3),
                              training_details=json.loads(json.dumps(details))))
    except SubmissionRefused as e:
        if e.existing is not None:
            raise ServiceError(f"this {recipe} drafter is already registered as "
                               f"{e.existing.slug} (same files): nothing to do") from None
        raise ServiceError("the trained drafter was refused: " + "; ".join(str(p) for p in e.problems)) from None


def drafter_name(recipe: str, data_slug, data_version, seed, heldout: int = 0) -> str:
    """A trained drafter's name: its recipe, data and seed (and the conversations it left
    out, if any)."""
    data = f"{data_slug} v{data_version}" if data_version else (data_slug or "data")
    return f"{recipe} ({data}, seed {seed}" + (f", {heldout} held out)" if heldout else ")")


def trained_drafter(recipe: str, dataset: TrainingDataset, seed: int,
                    heldout: int = 0) -> Drafter | None:
    """The drafter of this recipe, data, seed and held-out count: trained here on the
    dataset, or shipped (leaderboard/services/shipping.py) after training on the same file
    (its sha256). One trained with conversations held out is another drafter."""
    same_data = Q(training_data=dataset) | Q(training_data__isnull=True,
                                             training_data_sha256=dataset.sha256)
    candidates = (Drafter.objects.filter(same_data, trained_by_recipe=recipe, training_seed=seed,
                                         target=dataset.target_id)
                  .exclude(review_state="withdrawn").order_by("created_at", "pk"))
    return next((d for d in candidates if heldout_of(d.training_details) == heldout), None)
