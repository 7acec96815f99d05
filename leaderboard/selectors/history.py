"""Reads of drafters across engine versions: a drafter's history (its page's section "Across
engine versions" and GET /api/drafters/{slug}/history), one upgrade (every drafter measured
on two engine versions of one protocol family, worst first) and the upgrades there are.

A *protocol family* is the protocol versions with one ``ProtocolSpec.family_sha256()``: they
measure the same thing and differ only by the engine version they pin. Older protocols pin
none, so a family's history is keyed by the engine version each run recorded
(``Run.engine_version``): per (family, engine version) the latest succeeded run counts.
The comparison itself is worker.analysis.engine_history; greedy cells' records are read
through leaderboard.records, only for cells that are compared.
"""
from __future__ import annotations

import re
from collections import defaultdict

from django.db.models import F
from django.urls import reverse

from worker.analysis import engine_history

from .. import records
from ..models import Drafter, Protocol, Result, Run
from .shapes import HIDDEN_REVIEW_STATES, drafter_summary, protocol_label

FAMILY_HASH = re.compile(r"[0-9a-f]{64}")
# The Result fields the comparison and the history table read.
HISTORY_FIELDS = (
    "run_id", "task", "batch_size", "temperature", "k", "repetitions", "drafts",
    "draft_tokens", "accepted_tokens", "accepted_at", "acceptance_length",
    "acceptance_length_low", "acceptance_length_high", "engine_acceptance_length",
    "decode_tokens", "decode_steps", "tokens_per_step", "per_position_acceptance", "speedup",
    "speedup_low", "speedup_high", "speedup_between_run_variance",
)


def family_of(protocol: Protocol) -> str:
    return protocol.spec.family_sha256()


def version_sorted(versions) -> list[str]:
    """Engine versions in version order (0.9.0 before 0.10.0)."""
    return sorted(versions, key=engine_history.version_key)


def upgrade_url(ref: str, from_version: str, to_version: str) -> str:
    return reverse("upgrade", args=[ref, f"{from_version}...{to_version}"])


def _measured_runs(**filters) -> dict:
    """{(drafter id, family, engine version): the latest succeeded run} of drafter runs that
    recorded their engine version, among `filters`. One query."""
    qs = (Run.objects.filter(state=Run.SUCCEEDED, drafter__isnull=False, **filters)
          .exclude(engine_version="").select_related("protocol", "drafter", "drafter__owner")
          .order_by(F("finished_at").desc(nulls_last=True), "-pk"))
    latest, families = {}, {}
    for run in qs:
        # every row carries its own Protocol instance: hash each protocol's spec once
        if run.protocol_id not in families:
            families[run.protocol_id] = family_of(run.protocol)
        latest.setdefault((run.drafter_id, families[run.protocol_id], run.engine_version), run)
    return latest


def _version_entry(run: Run) -> dict:
    p = run.protocol
    return {"engine_version": run.engine_version, "run_id": run.pk,
            "run_url": reverse("run", args=[run.pk]), "finished_at": run.finished_at,
            "protocol": {"slug": p.slug, "version": p.version, "label": protocol_label(p),
                         "url": reverse("protocol", args=[p.slug, p.version])}}


def _cells_of(runs) -> dict:
    """{run id: [drafter cell dicts]} of the runs, in grid order. One query (none without runs)."""
    out = defaultdict(list)
    if not runs:
        return out
    # the drafter's cells: a paired run's baseline cells (k = 0) have no speedup or drafts
    qs = (Result.objects.filter(run_id__in=[r.pk for r in runs], k__gt=0)
          .order_by("task", "batch_size", "temperature", "k").values(*HISTORY_FIELDS))
    for row in qs:
        row["temperature"] = float(row["temperature"])
        row["accepted_at"] = list(row["accepted_at"] or [])
        row["per_position_acceptance"] = list(row["per_position_acceptance"] or [])
        if row["tokens_per_step"] is None:
            row["tokens_per_step"] = engine_history.tokens_per_step_of(row)
        out[row["run_id"]].append(row)
    return out


def _with_records(run_id: int, cells: list[dict], keys) -> list[dict]:
    """The cells, greedy ones among `keys` with their records (leaderboard.records)."""
    run_records = records.RunRecords(run_id)
    return [{**c, "records": run_records.cell(c)}
            if c["temperature"] == 0 and engine_history.cell_key(c) in keys else c
            for c in cells]


def _compare(old_run: Run, new_run: Run, cells: dict) -> dict:
    old, new = cells.get(old_run.pk, []), cells.get(new_run.pk, [])
    both = ({engine_history.cell_key(c) for c in old}
            & {engine_history.cell_key(c) for c in new})
    return engine_history.compare_versions(_with_records(old_run.pk, old, both),
                                           _with_records(new_run.pk, new, both))


def _family_ref(family: str, protocols: list[Protocol]) -> str:
    """How an upgrade of this family is named in a URL: its protocols' slug when that slug
    holds no other family, else the family hash."""
    slugs = {p.slug for p in protocols}
    if len(slugs) == 1:
        others = Protocol.objects.filter(slug=next(iter(slugs)))
        if all(family_of(p) == family for p in others):
            return next(iter(slugs))
    return family


def drafter_history(drafter: Drafter | str) -> dict | None:
    """A drafter's figures per engine version in every protocol family where it has
    succeeded runs, and the comparison of each consecutive pair of versions. None if there is
    no such drafter. One query for a drafter measured on one engine version per family (its
    page's budget); with more, two more (the cells, the family's protocols), plus the records
    of compared greedy cells.

    Returns {"drafter", "families": [{"family", "slug", "label", "ref" (None for a family on
    one version), "versions": [{"engine_version", "run_id", "run_url", "finished_at",
    "protocol"}], "rows" (empty for a family on one version): [{"task", "batch_size",
    "temperature", "k", "versions": [{"engine_version", "run", "cell" (its figures, or None),
    "change" (compared with the previous version's, or None)}]}], "comparisons": [{"from",
    "to", "url", "summary", "cells", "only_old", "only_new"}]}], "multi_version": whether
    any family has two or more versions}."""
    slug = drafter if isinstance(drafter, str) else drafter.slug
    latest = _measured_runs(drafter__slug=slug)
    if latest:
        drafter = next(iter(latest.values())).drafter
    elif isinstance(drafter, str):
        drafter = Drafter.objects.select_related("owner").filter(slug=slug).first()
        if drafter is None:
            return None
    by_family = defaultdict(dict)
    for (_, family, version), run in latest.items():
        by_family[family][version] = run
    cells = _cells_of([run for runs in by_family.values() if len(runs) > 1
                       for run in runs.values()])
    families = []
    for family, runs in by_family.items():
        versions = version_sorted(runs)
        newest = runs[versions[-1]].protocol
        entry = {"family": family, "slug": newest.slug, "label": protocol_label(newest),
                 "ref": None, "versions": [_version_entry(runs[v]) for v in versions],
                 "rows": [], "comparisons": []}
        families.append(entry)
        if len(versions) < 2:
            continue
        entry["ref"] = _family_ref(family, [r.protocol for r in runs.values()])
        for old, new in zip(versions, versions[1:]):
            compared = _compare(runs[old], runs[new], cells)
            entry["comparisons"].append({"from": old, "to": new,
                                         "url": upgrade_url(entry["ref"], old, new),
                                         **compared})
        per_version = [{engine_history.cell_key(c): c for c in cells.get(runs[v].pk, [])}
                       for v in versions]
        changes = [{(c["task"], c["batch_size"], c["temperature"], c["k"]): c
                    for c in comp["cells"]} for comp in entry["comparisons"]]
        for key in sorted(set().union(*per_version)):
            task, b, t, k = key
            entry["rows"].append({
                "task": task, "batch_size": b, "temperature": t, "k": k,
                "versions": [{"engine_version": v, "run": entry["versions"][i],
                              "cell": per_version[i].get(key),
                              "change": changes[i - 1].get(key) if i else None}
                             for i, v in enumerate(versions)],
            })
    families.sort(key=lambda f: (-len(f["versions"]), f["label"]))
    return {"drafter": drafter_summary(drafter), "families": families,
            "multi_version": any(len(f["versions"]) > 1 for f in families)}


def _families_of(ref: str) -> list[tuple[str, list[Protocol]]]:
    """(family, its protocols) named by `ref`: a family hash, or a protocol slug (each family
    among the slug's versions, the newest version's first)."""
    protocols = list(Protocol.objects.select_related("target").order_by("slug", "-version"))
    groups = defaultdict(list)
    for p in protocols:
        groups[family_of(p)].append(p)
    if FAMILY_HASH.fullmatch(ref):
        return [(ref, groups[ref])] if ref in groups else []
    named = [p for p in protocols if p.slug == ref]
    order = list(dict.fromkeys(family_of(p) for p in named))
    return [(f, groups[f]) for f in order]


def upgrade(ref: str, from_version: str, to_version: str) -> dict | None:
    """Every visible drafter measured on both engine versions in the protocol family `ref`
    names (a family hash or a protocol slug: then its family with drafters on both, newest
    protocol version first), its change and flags, worst first: flagged drafters first, then
    by the largest relative speedup drop. None when `ref` names no protocol.

    Returns {"family", "slug", "label", "ref", "from", "to", "url", "flagged_drafters",
    "drafters": [{"drafter", "from_run", "to_run", "summary", "cells", "flags"}]}."""
    families = _families_of(ref)
    if not families:
        return None
    chosen = None
    for family, protocols in families:
        latest = _measured_runs(protocol__in=protocols,
                                engine_version__in=[from_version, to_version])
        pairs = defaultdict(dict)
        for (drafter_id, _, version), run in latest.items():
            if run.drafter.review_state not in HIDDEN_REVIEW_STATES:
                pairs[drafter_id][version] = run
        pairs = {d: v for d, v in pairs.items() if from_version in v and to_version in v}
        if pairs or chosen is None:
            chosen = (family, protocols, pairs)
        if pairs:
            break
    family, protocols, pairs = chosen
    newest = max(protocols, key=lambda p: p.version)
    cells = _cells_of([run for runs in pairs.values() for run in runs.values()])
    drafters = []
    for runs in pairs.values():
        old, new = runs[from_version], runs[to_version]
        compared = _compare(old, new, cells)
        drafters.append({
            "drafter": drafter_summary(old.drafter),
            "from_run": _version_entry(old), "to_run": _version_entry(new),
            "summary": compared["summary"], "cells": compared["cells"],
            "flags": [{"task": c["task"], "batch_size": c["batch_size"],
                       "temperature": c["temperature"], "k": c["k"], "flag": flag}
                      for c in compared["cells"] for flag in c["flags"]],
        })
    drafters.sort(key=lambda d: (not d["summary"]["flagged"], -d["summary"]["speedup_drop"],
                                 d["drafter"]["name"]))
    family_ref = _family_ref(family, protocols)
    return {"family": family, "slug": newest.slug, "label": protocol_label(newest),
            "ref": family_ref, "from": from_version, "to": to_version,
            "url": upgrade_url(family_ref, from_version, to_version),
            "flagged_drafters": sum(d["summary"]["flagged"] for d in drafters),
            "drafters": drafters}


def upgrade_pairs() -> list[dict]:
    """The (family, from version, to version) pairs, from older to newer, that have at least
    one visible drafter measured on both: [{"family", "slug", "label", "ref", "from", "to",
    "drafters" (how many), "url"}], by protocol, then version. Two queries."""
    latest = _measured_runs(drafter__review_state__in=[
        s for s, _ in Drafter.REVIEW_STATES if s not in HIDDEN_REVIEW_STATES])
    versions = defaultdict(lambda: defaultdict(set))   # family -> version -> drafter ids
    protocols = defaultdict(dict)
    for (drafter_id, family, version), run in latest.items():
        versions[family][version].add(drafter_id)
        protocols[family][run.protocol_id] = run.protocol
    out = []
    for family, by_version in versions.items():
        ordered = version_sorted(by_version)
        newest = max(protocols[family].values(), key=lambda p: p.version)
        ref = None
        for i, old in enumerate(ordered):
            for new in ordered[i + 1:]:
                both = by_version[old] & by_version[new]
                if not both:
                    continue
                ref = ref or _family_ref(family, list(protocols[family].values()))
                out.append({"family": family, "slug": newest.slug,
                            "label": protocol_label(newest), "ref": ref, "from": old,
                            "to": new, "drafters": len(both),
                            "url": upgrade_url(ref, old, new)})
    out.sort(key=lambda p: (p["label"], engine_history.version_key(p["from"]),
                            engine_history.version_key(p["to"])))
    return out
