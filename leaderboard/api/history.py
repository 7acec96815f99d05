"""Drafters across engine versions: a drafter's history (its figures per engine version in
every protocol family, each consecutive pair compared, regressions flagged), the engine
upgrades there are and one upgrade's drafters, worst first. Reads of
leaderboard.selectors.history, the same as the drafter page's section "Across engine
versions" and the /upgrades/ pages; the rules are in docs/measurement.md."""
from __future__ import annotations

from datetime import datetime
from typing import Optional

from ninja import Path, Router
from pydantic import Field

from .. import permissions
from ..selectors import history
from .common import SLUG, Out
from .drafters import DRAFTER_SLUG
from .errors import error_responses, not_found

router = Router()

ENGINE_VERSION = r"^[0-9A-Za-z][0-9A-Za-z.+_-]{0,49}$"
FAMILY_REF = Path(..., pattern=SLUG, max_length=64,
                  description="a protocol slug (its family with drafters on both versions, "
                              "newest protocol version first) or a protocol family's sha256")
FROM_VERSION = Path(..., pattern=ENGINE_VERSION, max_length=50,
                    description="the engine version upgraded from, as runs record it "
                                "(e.g. 0.31.0)")
TO_VERSION = Path(..., pattern=ENGINE_VERSION, max_length=50,
                  description="the engine version upgraded to, as runs record it (e.g. 0.32.0)")
FLAGGED_HOW = ("flagged (outside both 95% intervals: the new value outside the old interval "
               "and the old outside the new one), within (either interval covers the other's "
               "value) or not judged (a value or an interval missing, or, for the speedup, "
               "a protocol not calibrated between runs: `reason` says which)")


class HistoryDrafterOut(Out):
    slug: str = Field(description="drafter slug")
    name: str = Field(description="display name")
    method: str = Field(description="drafting method")
    method_label: str = Field(description="the method in words")
    review_state: str = Field(description="pending, approved, rejected or withdrawn")
    url: str = Field(description="the drafter's page")


class HistoryProtocolOut(Out):
    slug: str = Field(description="protocol slug")
    version: int = Field(description="protocol version")
    label: str = Field(description="slug and version in words")
    url: str = Field(description="the protocol's page")


class MeasuredVersionOut(Out):
    engine_version: str = Field(description="the engine version the run recorded")
    run_id: int = Field(description="the latest succeeded run of the drafter on it")
    run_url: str = Field(description="that run's page")
    finished_at: Optional[datetime] = Field(description="when that run finished")
    protocol: HistoryProtocolOut = Field(description="the protocol version that run measured")


class CellRefOut(Out):
    task: str = Field(description="task")
    batch_size: int = Field(description="batch size")
    temperature: float = Field(description="sampling temperature")
    k: int = Field(description="speculation budget")


class CellFiguresOut(CellRefOut):
    repetitions: Optional[int] = Field(description="passes the cell was measured in")
    drafts: int = Field(description="verification steps that drafted (summed over passes)")
    draft_tokens: int = Field(description="drafted tokens (summed over passes)")
    accepted_tokens: int = Field(description="accepted drafted tokens (summed over passes)")
    accepted_at: list[int] = Field(description="accepted drafts per position 1..k")
    engine_acceptance_length: Optional[float] = Field(
        description="acceptance length as vLLM's counters report it")
    acceptance_length: Optional[float] = Field(
        description="acceptance length, end-of-output corrected")
    acceptance_length_low: Optional[float] = Field(description="its 95% interval, low end")
    acceptance_length_high: Optional[float] = Field(description="its 95% interval, high end")
    tokens_per_step: Optional[float] = Field(description="decode tokens / decode steps")
    per_position_acceptance: list[float] = Field(
        description="share of drafts accepted at each position 1..k")
    speedup: Optional[float] = Field(description="throughput over the pinned baseline cell's")
    speedup_low: Optional[float] = Field(description="its 95% interval, low end")
    speedup_high: Optional[float] = Field(description="its 95% interval, high end")


class FigureChangeOut(Out):
    figure: str = Field(description="engine_acceptance_length, acceptance_length, "
                                    "tokens_per_step or speedup")
    label: str = Field(description="the figure in words")
    old: Optional[float] = Field(description="its value on the older engine version")
    new: Optional[float] = Field(description="its value on the newer engine version")
    change: Optional[float] = Field(description="new - old")
    relative: Optional[float] = Field(description="new / old - 1")
    old_low: Optional[float] = Field(description="the old value's 95% interval, low end "
                                                 "(none for figures without an interval)")
    old_high: Optional[float] = Field(description="the old value's 95% interval, high end")
    new_low: Optional[float] = Field(description="the new value's 95% interval, low end")
    new_high: Optional[float] = Field(description="the new value's 95% interval, high end")
    verdict: str = Field(description=FLAGGED_HOW)
    reason: str = Field(description="why a figure is not judged (empty when it is)")
    uncalibrated: bool = Field(description="the speedup is not judged because a protocol "
                                           "version is not calibrated between runs")


class PositionChangeOut(Out):
    position: int = Field(description="draft position, 1..k")
    old: Optional[float] = Field(description="acceptance at it on the older engine version")
    new: Optional[float] = Field(description="acceptance at it on the newer engine version")
    change: Optional[float] = Field(description="new - old")


class FirstDifferenceOut(Out):
    prompt_id: str = Field(description="the first prompt whose drafts differ")
    step: Optional[int] = Field(description="the first engine step (0: the prefill's token) "
                                            "that delivered other tokens; none without "
                                            "step records")


class ExactOut(Out):
    compared: bool = Field(description="compared exactly (temperature 0 only)")
    reason: str = Field(description="why not, or why counts only")
    counts_differ: list[str] = Field(description="the acceptance counts that differ (drafts, "
                                                 "draft_tokens, accepted_tokens, accepted_at; "
                                                 "per pass)")
    records_compared: bool = Field(description="per-request records compared on both sides")
    prompts_compared: int = Field(description="prompts on both sides")
    prompts_differ: int = Field(description="prompts whose outputs or tokens per engine step "
                                            "differ")
    first: Optional[FirstDifferenceOut] = Field(description="the first differing prompt")
    prompts_unmatched: int = Field(description="prompts on one side only")


class CellChangeOut(CellRefOut):
    figures: list[FigureChangeOut] = Field(description="each figure's change and verdict")
    per_position: list[PositionChangeOut] = Field(description="per-position acceptance")
    exact: ExactOut = Field(description="the exact comparison of greedy counts and drafts")
    flags: list[str] = Field(description="why the cell is flagged, in words")
    flagged: bool = Field(description="any flag")


class ChangeSummaryOut(Out):
    cells: int = Field(description="cells both versions measured")
    flagged_cells: int = Field(description="cells flagged")
    flagged: bool = Field(description="any cell flagged")
    worst_speedup_change: Optional[float] = Field(
        description="the most negative relative speedup change over the cells")
    worst_speedup_cell: Optional[CellRefOut] = Field(description="the cell it is of")
    speedup_drop: float = Field(description="max(0, -worst_speedup_change): what 'worst "
                                            "first' sorts by")
    acceptance_length_old: Optional[float] = Field(description="mean AL over the cells, old")
    acceptance_length_new: Optional[float] = Field(description="mean AL over the cells, new")
    acceptance_length_change: Optional[float] = Field(description="new mean - old mean")


class ComparisonOut(Out):
    from_version: str = Field(description="the older engine version")
    to_version: str = Field(description="the newer engine version")
    url: str = Field(description="the upgrade's page (every drafter on it)")
    summary: ChangeSummaryOut = Field(description="the drafter's change, in short")
    cells: list[CellChangeOut] = Field(description="every cell both versions measured")


class RowVersionOut(Out):
    engine_version: str = Field(description="engine version")
    cell: Optional[CellFiguresOut] = Field(description="the cell's figures on it, if measured")
    change: Optional[CellChangeOut] = Field(description="its change from the previous "
                                                        "version, if both measured it")


class HistoryRowOut(CellRefOut):
    versions: list[RowVersionOut] = Field(description="per engine version, oldest first")


class FamilyOut(Out):
    family: str = Field(description="the protocol family's sha256 (ProtocolSpec."
                                    "family_sha256: all but version and engine_version)")
    slug: str = Field(description="slug of its newest protocol version measured")
    label: str = Field(description="that protocol version in words")
    ref: Optional[str] = Field(description="how /api/upgrades names the family: the slug, "
                                           "or the family hash when the slug holds another "
                                           "family (none for a family on one version)")
    versions: list[MeasuredVersionOut] = Field(description="engine versions measured, oldest "
                                                           "first (ordered as versions)")
    rows: list[HistoryRowOut] = Field(description="per cell, its figures per version "
                                                  "(empty for a family on one version)")
    comparisons: list[ComparisonOut] = Field(description="each consecutive pair of versions")


class HistoryOut(Out):
    drafter: HistoryDrafterOut = Field(description="the drafter")
    families: list[FamilyOut] = Field(description="every protocol family it has succeeded "
                                                  "runs in, most versions first")
    multi_version: bool = Field(description="some family has two or more engine versions")


class UpgradePairOut(Out):
    family: str = Field(description="the protocol family's sha256")
    slug: str = Field(description="slug of its newest protocol version")
    label: str = Field(description="that protocol version in words")
    ref: str = Field(description="the family as /api/upgrades/{ref}/... names it")
    from_version: str = Field(description="the older engine version")
    to_version: str = Field(description="the newer engine version")
    drafters: int = Field(description="visible drafters measured on both")
    url: str = Field(description="the upgrade's page")


class FlagOut(CellRefOut):
    flag: str = Field(description="the flag in words")


class UpgradeDrafterOut(Out):
    drafter: HistoryDrafterOut = Field(description="the drafter")
    from_run: MeasuredVersionOut = Field(description="its run on the older version")
    to_run: MeasuredVersionOut = Field(description="its run on the newer version")
    summary: ChangeSummaryOut = Field(description="its change, in short")
    cells: list[CellChangeOut] = Field(description="every cell both runs measured")
    flags: list[FlagOut] = Field(description="every flag, by cell")


class UpgradeOut(Out):
    family: str = Field(description="the protocol family's sha256")
    slug: str = Field(description="slug of its newest protocol version")
    label: str = Field(description="that protocol version in words")
    ref: str = Field(description="the family as this endpoint names it")
    from_version: str = Field(description="the older engine version")
    to_version: str = Field(description="the newer engine version")
    url: str = Field(description="the upgrade's page")
    flagged_drafters: int = Field(description="drafters with a flagged cell")
    drafters: list[UpgradeDrafterOut] = Field(description="every visible drafter measured on "
                                                          "both, flagged first, then by the "
                                                          "largest speedup drop")


def _versions_named(d: dict) -> dict:
    """A selector's dict with "from" and "to" named from_version and to_version."""
    out = {k: v for k, v in d.items() if k not in ("from", "to")}
    return {**out, "from_version": d["from"], "to_version": d["to"]}


@router.get("/drafters/{slug}/history", response={200: HistoryOut, **error_responses(404)},
            tags=["reads"], summary="One drafter across engine versions, regressions flagged")
def drafter_history(request, slug: str = DRAFTER_SLUG):
    """Per protocol family, the drafter's figures on each engine version (its latest
    succeeded run there) and each consecutive pair compared: flagged where a change lies
    outside both 95% intervals, and at temperature 0 where the counts or drafts differ."""
    page = history.drafter_history(slug)
    if page is None or not permissions.can_see(request.user, page["drafter"]["review_state"]):
        raise not_found("slug", f"no drafter {slug!r}: see /api/drafters")
    for family in page["families"]:
        family["comparisons"] = [_versions_named(c) for c in family["comparisons"]]
    return page


@router.get("/upgrades", response={200: list[UpgradePairOut]}, tags=["reads"],
            summary="Engine upgrades: the version pairs with drafters measured on both")
def upgrade_pairs(request):
    return [_versions_named(p) for p in history.upgrade_pairs()]


@router.get("/upgrades/{ref}/{from_version}/{to_version}",
            response={200: UpgradeOut, **error_responses(404, 422)}, tags=["reads"],
            summary="One engine upgrade: every drafter's change, worst first")
def upgrade(request, ref: str = FAMILY_REF, from_version: str = FROM_VERSION,
            to_version: str = TO_VERSION):
    page = history.upgrade(ref, from_version, to_version)
    if page is None:
        raise not_found("ref", f"no protocol {ref!r}: see /api/upgrades")
    return _versions_named(page)
