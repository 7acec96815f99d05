"""Reads of targets and protocols: lists, the protocol page (spec, prompt sets, metric
definitions), which protocol a page shows."""
from __future__ import annotations

import inspect
import re
from collections import Counter, defaultdict

from django.db.models import Count, Exists, OuterRef, Q
from django.urls import reverse

import worker.protocol
from worker import metrics
from worker.protocol import parse_version

from worker import calibration, intervals

from ..baseline_rule import PAIRED_RULE, PINNED_RULE
from worker.analysis import speedups
from ..models import Prompt, PromptSet, Protocol, ProtocolCalibration, Result, Run, Target
from .shapes import HIDDEN_REVIEW_STATES, protocol_label, protocol_ref, protocol_summary


def protocols_with_results(target_slug: str | None = None):
    """Protocols that have results, newest first (a queryset with the target joined)."""
    qs = Protocol.objects.select_related("target").filter(
        Exists(Result.objects.filter(run__protocol=OuterRef("pk"))))
    if target_slug:
        qs = qs.filter(target__slug=target_slug)
    return qs.order_by("-created_at", "-version", "-pk")


def get_protocol(ref: str | None = None, target_slug: str | None = None) -> Protocol | None:
    """A protocol by `slug@version` or `slug` (its newest version); without a ref, the
    newest protocol with results (or, if none has any, the newest protocol)."""
    qs = Protocol.objects.select_related("target")
    if ref:
        slug, _, version = ref.partition("@")
        qs = qs.filter(slug=slug)
        if version:
            if parse_version(version) is None:
                return None
            qs = qs.filter(version=parse_version(version))
        return qs.order_by("-version").first()
    return (protocols_with_results(target_slug).first()
            or (qs.filter(target__slug=target_slug) if target_slug else qs)
            .order_by("-created_at", "-version", "-pk").first())


def protocol_list() -> list[dict]:
    """Every protocol with its number of runs and whether it has results."""
    qs = (Protocol.objects.select_related("target")
          .annotate(runs_count=Count("runs", distinct=True),
                    succeeded=Count("runs", filter=Q(runs__state=Run.SUCCEEDED), distinct=True))
          .order_by("slug", "-version"))
    return [{**protocol_summary(p), "runs_count": p.runs_count, "succeeded_runs": p.succeeded}
            for p in qs]


def multi_turn_policy() -> str:
    """The comment above worker.protocol.MULTI_TURN_FIRST_TURN (not retyped here)."""
    lines = inspect.getsource(worker.protocol).splitlines()
    end = next(i for i, line in enumerate(lines) if line.startswith("MULTI_TURN_FIRST_TURN"))
    start = end
    while start > 0 and lines[start - 1].startswith("#"):
        start -= 1
    return " ".join(line.lstrip("# ").strip() for line in lines[start:end])


def protocol_detail(p: Protocol) -> dict:
    """The whole spec (canonical JSON and its sha256), each task's prompt set with counts
    and hashes, the multi-turn policy and the definition of every metric."""
    spec = p.spec
    slugs = {t.prompt_set for t in spec.tasks}
    sets = {ps.slug: ps for ps in PromptSet.objects.filter(slug__in=slugs)}
    per_category = defaultdict(Counter)
    for row in (Prompt.objects.filter(prompt_set__slug__in=slugs)
                .values("prompt_set__slug", "category").annotate(n=Count("id"))):
        per_category[row["prompt_set__slug"]][row["category"]] = row["n"]
    chosen = p.task_prompts()
    tasks = []
    for t in spec.tasks:
        ps = sets.get(t.prompt_set)
        cats = per_category.get(t.prompt_set, Counter())
        available = sum(n for c, n in cats.items() if not t.categories or c in t.categories)
        tasks.append({
            "task": t.task, "prompt_set": t.prompt_set, "categories": list(t.categories),
            "prompts": t.prompts, "spec_sha256": t.prompt_set_sha256,
            "imported": ps is not None,
            "name": ps.name if ps else None, "format": ps.format if ps else None,
            "source_name": ps.source_name if ps else None,
            "source_sha256": ps.source_sha256 if ps else None,
            "sha256_matches": bool(ps and ps.source_sha256 == t.prompt_set_sha256),
            "set_count": sum(cats.values()), "available": available,
            "category_counts": dict(sorted(cats.items())),
            "selection": chosen[t.task]["selection"],
            "prompt_ids": chosen[t.task]["categories"],
            "prompt_ids_error": chosen[t.task]["error"],
        })
    counts = Run.objects.filter(protocol=p).aggregate(
        runs=Count("id"), succeeded=Count("id", filter=Q(state=Run.SUCCEEDED)))
    return {
        "protocol": protocol_summary(p), "spec": p.spec_json, "canonical_json": p.canonical_json,
        "sha256": p.sha256, "tasks": tasks, "multi_turn": spec.multi_turn,
        "multi_turn_policy": multi_turn_policy(), "metrics": metrics.definitions(),
        "runs": counts["runs"], "succeeded_runs": counts["succeeded"],
        "cells_per_drafter_run": len(spec.run_cells("drafter")),
        "cells_per_baseline_run": len(spec.cells(with_drafter=False)),
        "baseline_mode": spec.baseline,
        "baseline_rule": PAIRED_RULE if spec.baseline == "paired" else PINNED_RULE,
        "pinned_rule": PINNED_RULE,
        "repetitions": spec.repetitions, "max_drift": spec.max_drift,
        "interval_method": intervals.__doc__.strip(),
        "calibration": (ProtocolCalibration.objects.filter(protocol=p)
                        .order_by("-created_at", "-pk").values(
                            "between_run_variance", "cells", "degrees_of_freedom",
                            "drafters", "created_at", "held_out_pairs", "held_out_within",
                            "inherited_from__protocol__version",
                            "inherited_from__protocol__spec_json__engine_version").first()),
        "calibration_method": calibration.__doc__.strip(),
        "aggregate_interval_method": speedups.__doc__.strip(),
        "engine_version": spec.engine_version, "queue": spec.queue,
        "engine_family": engine_family(p),
    }


def protocol_family(protocol: Protocol) -> list[Protocol]:
    """The protocol versions of `protocol`'s family (ProtocolSpec.family_sha256: they
    measure the same thing and differ only by the engine version they pin), itself
    included, by slug and version. The family hash covers the target, so only the
    target's protocols are read (one query)."""
    family = protocol.spec.family_sha256()
    return [p for p in Protocol.objects.select_related("target")
            .filter(target_id=protocol.target_id).order_by("slug", "version")
            if p.spec.family_sha256() == family]


def engine_family(protocol: Protocol) -> list[dict]:
    """Each protocol version of `protocol`'s family (protocol_family) with the engine
    version it is measured on: the one it pins, or for a protocol that pins none "default: "
    and the versions its succeeded runs recorded; its queue, and how many drafters (not
    withdrawn or rejected) have a succeeded run under it. Three queries."""
    members = protocol_family(protocol)
    ids = [p.pk for p in members]
    succeeded = Run.objects.filter(protocol_id__in=ids, state=Run.SUCCEEDED)
    recorded = defaultdict(set)
    for protocol_id, version in (succeeded.exclude(engine_version="")
                                 .values_list("protocol_id", "engine_version").distinct()):
        recorded[protocol_id].add(version)
    drafters = dict(succeeded.filter(drafter__isnull=False)
                    .exclude(drafter__review_state__in=HIDDEN_REVIEW_STATES)
                    .values("protocol_id").annotate(n=Count("drafter", distinct=True))
                    .values_list("protocol_id", "n"))
    out = []
    for p in members:
        spec = p.spec
        versions = sorted(recorded[p.pk], key=release_order)
        if spec.engine_version:
            label = spec.engine_version
        else:
            label = "default: " + (", ".join(versions) if versions else "none measured yet")
        out.append({
            "slug": p.slug, "version": p.version, "label": protocol_label(p),
            "ref": protocol_ref(p), "title": p.title, "engine": p.engine,
            "engine_version": spec.engine_version, "recorded_engine_versions": versions,
            "engine_version_label": label, "queue": spec.queue,
            "drafters_measured": drafters.get(p.pk, 0), "current": p.pk == protocol.pk,
            "url": reverse("protocol", args=[p.slug, p.version]),
        })
    return out


def release_order(version: str) -> tuple:
    """Sort key of an engine version: its release numbers as numbers ("0.9.2" before
    "0.31.0"), then the rest as text."""
    head = re.match(r"[0-9]+(\.[0-9]+)*", version)
    numbers = tuple(int(n) for n in head.group().split(".")) if head else ()
    return numbers, version[head.end():] if head else version


def target_list() -> list[dict]:
    """Every target model. One query."""
    return list(Target.objects.order_by("slug").values(
        "slug", "name", "family", "hub_id", "revision", "weights_sha256", "vocab_size",
        "hidden_size", "num_layers", "has_chat_template", "created_at"))


def protocol_list_with_specs() -> list[dict]:
    """protocol_list() with each protocol's spec and its canonical JSON (whose sha256 is
    the row's sha256). Two queries."""
    rows = protocol_list()
    specs = dict(Protocol.objects.filter(pk__in=[r["id"] for r in rows])
                 .values_list("pk", "spec_json"))
    for r in rows:
        spec = specs.get(r["id"], {})
        r["spec"] = spec
        r["canonical_json"] = worker.protocol.canonical_json(spec)
    return rows

