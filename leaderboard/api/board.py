"""The leaderboard table: the page's rows for the same filters, ranked by speedup, with
ties and each row's plausible rank range; as JSON or as a CSV download."""
from __future__ import annotations

import csv
import io
import json
from typing import Literal, Optional

from django.http import HttpResponse
from django.utils import timezone
from ninja import Query, Router, Schema
from pydantic import Field

from ..selectors import board
from .catalog import PROTOCOL_SLUG, PROTOCOL_VERSION, ProtocolSummaryOut, protocol_or_404
from .common import INT_MAX, METHODS, TASK, Out
from .errors import ApiError, error_responses, problem

router = Router()


class LeaderboardRowOut(Out):
    """One row of the leaderboard: a drafter's figures at one batch size, temperature and k
    over the task chosen (or all tasks); the columns of the CSV, in the same order."""
    rank: Optional[int] = Field(description="rank by speedup, best first; a row whose "
                                            "speedup interval overlaps the row above's "
                                            "shares its rank (tied); null: not ranked (a run "
                                            "still measuring, or no speedup yet)")
    tied: bool = Field(description="the row shares its rank with a neighbour whose speedup "
                                   "interval overlaps its own")
    rank_low: Optional[int] = Field(description="best plausible rank: 1 + the ranked rows "
                                                "whose whole speedup interval lies above "
                                                "this row's; null when not ranked")
    rank_high: Optional[int] = Field(description="worst plausible rank: the ranked rows "
                                                 "whose speedup interval does not lie wholly "
                                                 "below this row's, itself included; null "
                                                 "when not ranked")
    drafter: str = Field(description="drafter slug")
    drafter_name: str = Field(description="drafter name")
    method: str = Field(description="drafter method")
    owner: Optional[str] = Field(description="the drafter's owner (null: shipped)")
    run_id: int = Field(description="the run the figures come from")
    measuring: bool = Field(description="that run is still measuring: the row is "
                                        "provisional and takes no rank")
    task: str = Field(description='task, or "all" (figures over every task)')
    batch_size: int = Field(description="requests in flight at once")
    temperature: float = Field(description="sampling temperature")
    k: int = Field(description="speculation budget")
    cells: int = Field(description="cells pooled into the row")
    requests: int = Field(description="requests measured")
    acceptance_length: Optional[float] = Field(description="1 + accepted / drafts, summed "
                                                           "over the cells")
    acceptance_length_low: Optional[float] = Field(description="95% interval, low")
    acceptance_length_high: Optional[float] = Field(description="95% interval, high")
    engine_acceptance_length: Optional[float] = Field(description="AL from vLLM's own "
                                                                  "counters, uncorrected")
    tokens_per_step: Optional[float] = Field(description="decode tokens / decode steps, "
                                                         "steps that drafted nothing "
                                                         "included")
    acceptance_rate: Optional[float] = Field(description="accepted / drafted tokens")
    output_throughput: Optional[float] = Field(description="generated tokens / wall seconds")
    output_throughput_low: Optional[float] = Field(description="95% interval, low")
    output_throughput_high: Optional[float] = Field(description="95% interval, high")
    speedup: Optional[float] = Field(description="throughput / the pinned baseline cells' "
                                                 "(worker/analysis/speedups.py); null until "
                                                 "they are measured")
    speedup_low: Optional[float] = Field(description="95% interval of the speedup, low: "
                                                     "the one ranks come from (a rerun on "
                                                     "the protocol's prompts)")
    speedup_high: Optional[float] = Field(description="95% interval of the speedup, high")
    speedup_prompts_low: Optional[float] = Field(None, description="95% interval of the "
                                                 "speedup across prompts, low")
    speedup_prompts_high: Optional[float] = Field(None, description="its high bound")
    lossless_share: Optional[float] = Field(description="at temperature 0: share of requests "
                                                        "equal to the baseline's output")
    baseline_throughput: Optional[float] = Field(description="throughput of the baseline "
                                                             "cells the speedup divides by")
    baseline_run_ids: list[int] = Field(description="the runs of those baseline cells")
    engine_version: str = Field(description="engine version the run used")
    hardware_description: str = Field(description="the hardware, in words")
    url: str = Field(description="the drafter's page")


LEADERBOARD_COLUMNS = tuple(LeaderboardRowOut.model_fields)


class LeaderboardFiltersOut(Out):
    task: str = Field(description='task, or "all"')
    batch_size: Optional[int] = Field(description="batch size; null: every batch size")
    temperature: Optional[float] = Field(description="temperature; null: every temperature")
    k: Optional[int] = Field(description="k; null: every k")
    method: Optional[str] = Field(description="drafter method; null: every method")


class LeaderboardOut(Out):
    protocol: ProtocolSummaryOut = Field(description="the protocol")
    filters: LeaderboardFiltersOut = Field(description="the filters applied, defaults "
                                                       "resolved")
    rows: list[LeaderboardRowOut] = Field(description="rows by speedup, best first; rows "
                                                      "without a speedup last")


class LeaderboardQuery(Schema):
    task: Optional[str] = Field(None, pattern=TASK, max_length=50,
                                description="task (default: figures over every task)")
    batch_size: Optional[str] = Field(None, pattern=r"^([0-9]{1,9}|all)$",
                                      description='batch size, or "all" (default: the '
                                                  "smallest with rows, as on the page)")
    temperature: Optional[str] = Field(None, pattern=r"^([0-9]{1,4}(\.[0-9]{1,6})?|all)$",
                                       description='temperature, or "all" (default: the '
                                                   "protocol's first, as on the page)")
    k: Optional[int] = Field(None, ge=1, le=INT_MAX, description="k (default: every k)")
    method: Optional[Literal[METHODS]] = Field(  # type: ignore[valid-type]
        None, description="drafter method (default: every method)")
    format: Optional[Literal["csv"]] = Field(
        None, description="csv: the rows as a CSV download (LeaderboardRowOut's fields as "
                          "columns); absent: JSON")


CSV_EXTRA = {"responses": {200: {"content": {"text/csv": {"schema": {"type": "string"}}}}}}


def flat_row(r: dict) -> dict:
    """A leaderboard row (selectors.board.leaderboard) as LeaderboardRowOut's fields."""
    d = r["drafter"]
    return {**{c: r.get(c) for c in LEADERBOARD_COLUMNS}, "tied": bool(r.get("tied")),
            "drafter": d["slug"], "drafter_name": d["name"], "method": d["method"],
            "owner": d["owner"], "measuring": r["run"]["measuring"], "url": d["url"],
            "baseline_run_ids": [b["id"] for b in r.get("baseline_runs") or ()]}


def csv_text(rows: list[dict]) -> str:
    """The CSV of flat rows: a header, None as an empty cell, lists as JSON text."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(LEADERBOARD_COLUMNS)
    for r in rows:
        writer.writerow([json.dumps(r[c]) if isinstance(r[c], list) else r[c]
                         for c in LEADERBOARD_COLUMNS])
    return buf.getvalue()


@router.get("/protocols/{slug}/{version}/leaderboard",
            response={200: LeaderboardOut, **error_responses(404, 422)}, tags=["reads"],
            url_name="protocol_leaderboard", openapi_extra=CSV_EXTRA,
            summary="The leaderboard table: ranks, ties and plausible rank ranges by speedup")
def protocol_leaderboard(request, q: Query[LeaderboardQuery], slug: str = PROTOCOL_SLUG,
                         version: int = PROTOCOL_VERSION):
    """The rows the leaderboard page shows for the same filters (its defaults too), sorted
    by speedup, best first. `rank_low`..`rank_high` is each ranked row's plausible rank
    range from the speedup intervals (worker.analysis.speedups.rank_ranges), over the rows
    of this table. With `format=csv` the rows as a download named after the protocol and
    the date."""
    protocol = protocol_or_404(slug, version)
    try:
        filters = board.resolve_filters(protocol, task=q.task, batch_size=q.batch_size,
                                        temperature=q.temperature, k=q.k, method=q.method)
    except ValueError as e:
        field, message = e.args
        raise ApiError(422, problem("(query)", field, message)) from None
    table = board.leaderboard(protocol, **filters, sort="speedup", descending=True)
    rows = [flat_row(r) for r in table["rows"]]
    if q.format == "csv":
        response = HttpResponse(csv_text(rows), content_type="text/csv; charset=utf-8")
        name = (f"specboard-leaderboard-{protocol.slug}-v{protocol.version}-"
                f"{timezone.now().date().isoformat()}.csv")
        response["Content-Disposition"] = f'attachment; filename="{name}"'
        return response
    return {"protocol": table["protocol"], "rows": rows,
            "filters": {f: table["filters"][f] for f in LeaderboardFiltersOut.model_fields}}
