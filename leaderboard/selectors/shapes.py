"""The small shapes every read returns (a protocol, a drafter, a run as plain dicts) and the
aggregation of cells: figures over several cells come from their summed counts with
worker.metrics, never by averaging ratios:

    acceptance length = 1 + sum accepted_tokens / sum drafts
    acceptance rate   = sum accepted_tokens / sum draft_tokens
    throughput        = sum generated_tokens / sum wall_seconds
"""
from __future__ import annotations

import functools

from django.db.models import Count, ExpressionWrapper, F, FloatField, Q, Sum
from django.urls import reverse

from worker import metrics

from ..models import Drafter, Protocol, Run


HIDDEN_REVIEW_STATES = ("withdrawn", "rejected")
ALL = "all"
SUMS = ("requests", "generated_tokens", "wall_seconds", "drafts", "draft_tokens",
        "accepted_tokens")


def filtered(qs, **lookups):
    """qs filtered on each lookup that is given (None and "" mean every value)."""
    return qs.filter(**{k: v for k, v in lookups.items() if v is not None and v != ""})


def protocol_ref_lookups(ref: str | None, prefix: str = "") -> dict:
    """The lookups of a protocol named `slug` or `slug@version` (a slug alone: every version)."""
    if not ref:
        return {}
    slug, _, version = ref.partition("@")
    return {f"{prefix}protocol__slug": slug,
            f"{prefix}protocol__version": int(version) if version else None}


def protocol_label(p: Protocol) -> str:
    return f"{p.slug} v{p.version}"


def protocol_ref(p: Protocol) -> str:
    """How a protocol is named in a URL query: slug@version."""
    return f"{p.slug}@{p.version}"


def protocol_summary(p: Protocol) -> dict:
    spec = p.spec
    return {
        "id": p.pk, "slug": p.slug, "version": p.version, "label": protocol_label(p),
        "ref": protocol_ref(p), "title": p.title, "engine": p.engine, "hardware": p.hardware,
        "sha256": p.sha256, "created_at": p.created_at,
        "target": {"slug": p.target.slug, "name": p.target.name},
        "tasks": list(spec.task_names), "batch_sizes": list(spec.batch_sizes),
        "temperatures": list(spec.temperatures), "ks": list(spec.ks),
        "url": reverse("protocol", args=[p.slug, p.version]),
    }


def drafter_summary(d: Drafter | None) -> dict | None:
    if d is None:
        return None
    return {
        "id": d.pk, "slug": d.slug, "name": d.name, "method": d.method,
        "method_label": d.get_method_display(),
        "owner": d.owner.username if d.owner_id else None, "owner_id": d.owner_id,
        "review_state": d.review_state, "url": reverse("drafter", args=[d.slug]),
        "claimed_acceptance_length": d.claimed_acceptance_length,
        "claimed_speedup": d.claimed_speedup, "claimed_source": d.claimed_source,
    }


def run_summary(run: Run, position: int | None = None) -> dict:
    """A run for the queue, the drafter page and the API. The drafter (if any) and the
    protocol must be select_related by the caller."""
    return {
        "id": run.pk, "state": run.state, "is_baseline": run.drafter_id is None,
        "drafter": drafter_summary(run.drafter) if run.drafter_id else None,
        "protocol": {"slug": run.protocol.slug, "version": run.protocol.version,
                     "label": protocol_label(run.protocol),
                     "url": reverse("protocol", args=[run.protocol.slug, run.protocol.version])},
        "hardware": run.hardware, "queue": run.queue, "position": position,
        "cells_done": run.cells_done, "cells_total": run.cells_total,
        "progress": run.progress, "eta_seconds": run.eta_seconds,
        "cancel_requested": run.cancel_requested, "attempts": run.attempts,
        "worker_host": run.worker_host, "engine_version": run.engine_version,
        "versions": run.versions, "hardware_description": run.hardware_description,
        "engine_args": run.engine_args, "error": run.error, "log_tail": run.log_tail,
        "artifact_url": reverse("run_artifact", args=[run.pk]) if run.artifact else None,
        "queued_at": run.queued_at, "started_at": run.started_at,
        "heartbeat_at": run.heartbeat_at, "finished_at": run.finished_at,
        "owner_id": run.drafter.owner_id if run.drafter_id else None,
        "drift": run.drift, "drift_flagged": run.drift_flagged,
        "url": fast_url("run", run.pk),
    }


def run_progress_summary(run: Run, position: int | None = None) -> dict:
    """The small, JSON-ready part of a run that the queue page polls."""
    return {
        "id": run.pk, "state": run.state, "position": position,
        "cells_done": run.cells_done, "cells_total": run.cells_total,
        "progress": round(run.progress, 4), "eta_seconds": run.eta_seconds,
        "cancel_requested": run.cancel_requested, "error": run.error[:300],
    }


def figures_from_sums(s: dict) -> dict:
    """Figures of a group of cells from their summed counts (keys of SUMS)."""
    counts = metrics.SpecCounts(s.get("drafts") or 0, s.get("draft_tokens") or 0,
                                s.get("accepted_tokens") or 0, list(s.get("accepted_at") or []))
    out = {
        "acceptance_length": metrics.acceptance_length(counts),
        "acceptance_rate": metrics.acceptance_rate(counts),
        "output_throughput": metrics.output_throughput(s.get("generated_tokens") or 0,
                                                       s.get("wall_seconds") or 0.0),
    }
    if s.get("accepted_at") is not None:
        out["per_position_acceptance"] = metrics.per_position_acceptance(counts)
        out["conditional_acceptance"] = metrics.conditional_acceptance(counts)
    lossless_n = s.get("lossless_requests") or 0
    out["lossless_share"] = (s["lossless_weighted"] / lossless_n) if lossless_n else None
    return out


def aggregate_cells(cells: list[dict], keys: tuple[str, ...]) -> dict[tuple, dict]:
    """Group cell dicts (see `cell_dict`) by `keys` and compute each group's figures from
    the summed counts, accepted_at included (per-position acceptance)."""
    groups: dict[tuple, dict] = {}
    for c in cells:
        key = tuple(c[k] for k in keys)
        g = groups.setdefault(key, {**{s: 0 for s in SUMS}, "counts": metrics.SpecCounts(),
                                    "lossless_weighted": 0.0, "lossless_requests": 0,
                                    "cells": 0})
        for s in SUMS:
            g[s] += c[s] or 0
        g["counts"] = g["counts"] + metrics.SpecCounts(c["drafts"], c["draft_tokens"],
                                                       c["accepted_tokens"], c["accepted_at"])
        if c["lossless_share"] is not None:
            g["lossless_weighted"] += c["lossless_share"] * c["requests"]
            g["lossless_requests"] += c["requests"]
        g["cells"] += 1
    out = {}
    for key, g in groups.items():
        sums = {**g, "accepted_at": g["counts"].accepted_at}
        out[key] = {**{s: g[s] for s in SUMS}, "cells": g["cells"], **figures_from_sums(sums)}
    return out


def sum_annotations():
    """Sum(...) of each count, named sum_<field> (see `unprefix`)."""
    lossless = ExpressionWrapper(F("lossless_share") * F("requests"), output_field=FloatField())
    return dict(
        **{f"sum_{s}": Sum(s) for s in SUMS},
        sum_lossless_weighted=Sum(lossless, filter=Q(lossless_share__isnull=False)),
        sum_lossless_requests=Sum("requests", filter=Q(lossless_share__isnull=False)),
        sum_cells=Count("id"),
    )


def unprefix(row: dict) -> dict:
    return {k[4:] if k.startswith("sum_") else k: v for k, v in row.items()}


METHOD_LABELS = dict(Drafter.METHODS)


@functools.lru_cache(maxsize=None)
def _url_pattern(name: str, placeholder: str) -> str:
    return reverse(name, args=[placeholder])


def fast_url(name: str, value, placeholder: str = "9876543210") -> str:
    """reverse() for one-argument URLs, without resolving the pattern for every row."""
    return _url_pattern(name, placeholder).replace(placeholder, str(value), 1)


# The training data's figures as a drafter records them: from its TrainingDataset row, or
# for a shipped drafter whose data were written on another machine, from its training
# details (the figures of its training.json, leaderboard/services/shipping.py).
DATA_FIGURES = ("data_slug", "data_version", "data_conversations", "data_tokens",
                "data_answer_tokens", "data_seconds")


def training_data_figures(d: Drafter) -> dict:
    """{data_slug, data_version, data_sha256, data_conversations, data_tokens,
    data_answer_tokens, data_seconds} of a trained drafter (None where unknown)."""
    data = d.training_data  # select_related by list callers
    if data is not None:
        stats = (data.params or {}).get("stats") or {}
        return {"data_slug": data.slug, "data_version": data.version,
                "data_sha256": data.sha256, "data_conversations": data.n,
                "data_tokens": data.tokens, "data_answer_tokens": stats.get("answer_tokens"),
                "data_seconds": stats.get("seconds")}
    details = d.training_details or {}
    return {**{k: details.get(k) for k in DATA_FIGURES}, "data_sha256": d.training_data_sha256}


def heldout_of(record: dict | None) -> int:
    """Conversations a training left out of its data (``--heldout``), from a training
    record or summary (its settings); 0 for one trained on all of it, or before the option."""
    return ((record or {}).get("settings") or {}).get("heldout") or 0


def training_summary(d: Drafter) -> dict | None:
    """How a baseline drafter was trained (here, or shipped with the repository:
    leaderboard/services/training.py, shipping.py); None otherwise."""
    if not d.trained_by_recipe:
        return None
    details = d.training_details or {}
    return {"recipe": d.trained_by_recipe, **training_data_figures(d),
            "seed": d.training_seed, "seconds": d.training_seconds,
            "steps": details.get("steps"), "first_loss": details.get("first_loss"),
            "final_loss": details.get("final_loss"), "final_top1": details.get("final_top1"),
            "heldout": heldout_of(details),
            "heldout_top1": details.get("heldout_top1"),
            "train_sample_top1": details.get("train_sample_top1"),
            "shipped": details.get("shipped")}
