"""Results: one row per measured cell with its provenance, as a JSON page or exported
whole as CSV or JSON, streamed in constant memory."""
from __future__ import annotations

import csv
import io
import json
from typing import Any, Literal, Optional

from django.db import connection
from django.http import StreamingHttpResponse
from django.utils import timezone
from ninja import Query, Router
from pydantic import Field

from ..selectors import results
from .common import ID_MAX, INT_MAX, METHODS, PROTOCOL_REF, SLUG, TASK, Out, PageOut, PageQuery
from .errors import error_responses

router = Router()


class ResultOut(Out):
    """One cell of a run's grid with its provenance (the columns of the CSV export, in
    the same order)."""
    id: int = Field(description="result id")
    run_id: int = Field(description="the run that measured the cell")
    protocol: str = Field(description="protocol slug")
    protocol_version: int = Field(description="protocol version")
    protocol_sha256: str = Field(description="sha256 of the protocol's canonical JSON")
    target: str = Field(description="target slug")
    engine: str = Field(description="engine of record")
    engine_version: str = Field(description="engine version the run used")
    hardware: str = Field(description="hardware class of the run")
    hardware_description: str = Field(description="the hardware, in words")
    run_state: str = Field(description="state of the run")
    drafter: Optional[str] = Field(description="drafter slug; null for the baseline")
    method: str = Field(description="drafter method, or baseline")
    task: str = Field(description="task")
    batch_size: int = Field(description="requests in flight at once")
    temperature: float = Field(description="sampling temperature")
    k: int = Field(description="speculation budget (0 for the baseline)")
    requests: int = Field(description="requests measured")
    generated_tokens: int = Field(description="tokens generated")
    wall_seconds: float = Field(description="wall time of the cell")
    drafts: int = Field(description="speculative steps that proposed at least one token")
    draft_tokens: int = Field(description="tokens drafted")
    accepted_tokens: int = Field(description="drafted tokens accepted (not the bonus token)")
    accepted_at: list[int] = Field(description="accepted_at[i-1]: drafts whose position i "
                                               "was accepted")
    acceptance_length: Optional[float] = Field(description="1 + accepted_tokens / drafts")
    acceptance_rate: Optional[float] = Field(description="accepted_tokens / draft_tokens")
    per_position_acceptance: list[float] = Field(description="alpha_i = accepted_at[i] / "
                                                             "drafts")
    conditional_acceptance: list[float] = Field(description="beta_i = accepted_at[i] / "
                                                            "accepted_at[i-1]")
    output_throughput: Optional[float] = Field(description="generated tokens / wall seconds")
    ttft_mean: Optional[float] = Field(description="time to first token, mean (s)")
    ttft_p50: Optional[float] = Field(description="time to first token, p50 (s)")
    ttft_p90: Optional[float] = Field(description="time to first token, p90 (s)")
    ttft_p99: Optional[float] = Field(description="time to first token, p99 (s)")
    tpot_mean: Optional[float] = Field(description="time per output token, mean (s)")
    tpot_p50: Optional[float] = Field(description="time per output token, p50 (s)")
    tpot_p90: Optional[float] = Field(description="time per output token, p90 (s)")
    tpot_p99: Optional[float] = Field(description="time per output token, p99 (s)")
    speedup: Optional[float] = Field(description="throughput / the baseline cell's; null "
                                                 "until the baseline is measured")
    lossless_share: Optional[float] = Field(description="at temperature 0: share of requests "
                                                        "equal to the baseline's output")
    measured_at: str = Field(description="when the cell was measured (ISO 8601, UTC)")
    repetitions: Optional[int] = Field(description="passes over the prompts (null before v2)")
    decode_tokens: Optional[int] = Field(description="tokens emitted by decode steps")
    decode_steps: Optional[int] = Field(description="decode steps, those that drafted "
                                                    "nothing included")
    tokens_per_step: Optional[float] = Field(description="decode tokens / decode steps, steps "
                                                         "that drafted nothing included (1.0 "
                                                         "for the baseline): compare this "
                                                         "across methods")
    engine_acceptance_length: Optional[float] = Field(description="AL from vLLM's own "
                                                                  "counters, uncorrected (what "
                                                                  "vllm bench serve prints)")
    output_throughput_low: Optional[float] = Field(description="95% interval, low")
    output_throughput_high: Optional[float] = Field(description="95% interval, high")
    acceptance_length_low: Optional[float] = Field(description="95% interval, low")
    acceptance_length_high: Optional[float] = Field(description="95% interval, high")
    speedup_low: Optional[float] = Field(description="95% interval of the speedup that the "
                                                     "leaderboard ranks by, low: a rerun on "
                                                     "the protocol's prompts (docs/"
                                                     "measurement.md, Two intervals)")
    speedup_high: Optional[float] = Field(description="95% interval of the speedup, high")
    pass_throughputs: Optional[list[float]] = Field(description="throughput of each pass")
    host_load: Optional[float] = Field(description="CPU cores used by other processes while "
                                                   "the cell was measured (mean)")
    loaded: Optional[bool] = Field(description="a kept pass was loaded: others above 0.5 "
                                   "cores of the machine or 0.1 cores on the engine's cores")
    checks: Optional[dict[str, Any]] = Field(description="the cell's self-checks")
    passes_stop: Optional[str] = Field(None, description="why the cell's group stopped "
                                       "measuring passes: fixed, target, budget, max")
    remeasured_passes: Optional[int] = Field(None, description="passes measured again "
                                             "because the engine's cores were loaded")
    engine_starts: Optional[int] = Field(None, description="engine starts the cell's passes "
                                         "came from; fewer than the protocol's "
                                         "engine_starts: still being measured (null before "
                                         "protocol v4)")
    speedup_prompts_low: Optional[float] = Field(None, description="95% interval of the "
                                                 "speedup across prompts, low (other prompts "
                                                 "of the task's kind)")
    speedup_prompts_high: Optional[float] = Field(None, description="its high bound")
    speedup_passes_se: Optional[float] = Field(None, description="standard error of the "
                                               "log-speedup from the passes, prompts fixed")
    speedup_between_run_variance: Optional[float] = Field(
        None, description="the protocol's between-run variance of the log-speedup in the "
        "intervals (null: not calibrated when the cell was divided)")
    baseline_result_id: Optional[int] = Field(description="the baseline cell speedup divides by")
    baseline_run_id: Optional[int] = Field(description="its run (the same run when paired)")
    run_drift: Optional[float] = Field(description="the run's drift between baseline passes")
    run_drift_flagged: Optional[bool] = Field(description="drift above the protocol's limit")
    checks_ok: Optional[bool] = Field(description="every self-check passed (null before v2)")
    checks_failed: Optional[list[str]] = Field(description="the reasons of failed checks")
    predicted_speedup: Optional[float] = Field(description="tokens per step x t_fwd(b) / "
                                                           "(draft cost + t_fwd(b, k+1)), "
                                                           "cost model of the baseline run")
    engine_efficiency: Optional[float] = Field(description="measured speedup / predicted")
    oracle_speedup: Optional[float] = Field(description="speedup if every step proposed "
                                                        "exactly the emitted tokens, up to k")
    no_waste_speedup: Optional[float] = Field(description="own steps, verifying only the "
                                                          "accepted tokens + 1")
    prefill_share: Optional[float] = Field(description="share of request time in TTFT")
    verification_share: Optional[float] = Field(description="share of request time in "
                                                            "verification (cost model)")
    drafting_other_share: Optional[float] = Field(description="share in drafting, rejection "
                                                              "sampling and other overhead")


class ResultPage(PageOut):
    items: list[ResultOut] = Field(description="this page")


class ResultFilters(PageQuery):
    protocol: Optional[str] = Field(None, pattern=PROTOCOL_REF, max_length=80,
                                    description='protocol slug, or "slug@version"')
    version: Optional[int] = Field(None, ge=1, le=INT_MAX, description="protocol version")
    target: Optional[str] = Field(None, pattern=SLUG, max_length=50, description="target slug")
    drafter: Optional[str] = Field(None, pattern=SLUG, max_length=50, description="drafter slug")
    method: Optional[Literal[METHODS + ("baseline",)]] = Field(  # type: ignore[valid-type]
        None, description="drafter method, or baseline for the baseline runs")
    task: Optional[str] = Field(None, pattern=TASK, max_length=50, description="task")
    batch_size: Optional[int] = Field(None, ge=1, le=INT_MAX, description="batch size")
    temperature: Optional[float] = Field(None, ge=0, le=1000, allow_inf_nan=False,
                                         description="sampling temperature")
    k: Optional[int] = Field(None, ge=0, le=INT_MAX, description="speculation budget (0: "
                                                                 "the baseline)")
    run: Optional[int] = Field(None, ge=1, le=ID_MAX, description="run id")
    run_state: Optional[Literal["queued", "running", "succeeded", "failed", "cancelled"]] = \
        Field(None, description="state of the run (default: every state)")
    format: Optional[Literal["csv", "json"]] = Field(
        None, description="csv or json: export every matching row at once, streamed, as a "
                          "file (limit and offset are ignored); absent: one JSON page")


RESULTS_EXTRA = {"responses": {200: {"content": {
    "text/csv": {"schema": {"type": "string"}},
}}}}


@router.get("/results", response={200: ResultPage, **error_responses(422)}, tags=["reads"],
            summary="Results: one row per cell, filtered; paginated JSON, or CSV/JSON export",
            openapi_extra=RESULTS_EXTRA)
def list_results(request, filters: Query[ResultFilters]):
    """One row per measured cell (run, task, batch size, temperature, k), each with the
    protocol slug, version and sha256, the engine version, the hardware class and the run
    id. Without `format`: one page (`limit`, `offset`). With `format=csv` or `format=json`:
    every matching row, streamed in constant memory, as a download named after the
    protocol and the date (`specboard-results-<protocol>-v<version>-<date>.csv`)."""
    qs = results.results_queryset(
        protocol=filters.protocol, version=filters.version, target=filters.target,
        drafter=filters.drafter, method=filters.method, task=filters.task,
        batch_size=filters.batch_size, temperature=filters.temperature, k=filters.k,
        run=filters.run, run_state=filters.run_state)
    if filters.format:
        return export_response(qs, filters.format, export_filename(filters, filters.format))
    count, items = results.results_page(qs, filters.limit, filters.offset)
    return {"count": count, "limit": filters.limit, "offset": filters.offset, "items": items}


# ---- export --------------------------------------------------------------------------

def export_filename(filters, ext: str) -> str:
    """specboard-results-<slug>[-v<version>]-<date>.<ext> (all-protocols without one)."""
    name = "all-protocols"
    if filters.protocol:
        slug, _, v = filters.protocol.partition("@")
        version = v or (str(filters.version) if filters.version else "")
        name = slug + (f"-v{version}" if version else "")
    elif filters.version:
        name = f"all-protocols-v{filters.version}"
    return f"specboard-results-{name}-{timezone.now().date().isoformat()}.{ext}"


ROWS_PER_WRITE = 2000
# On PostgreSQL the CSV lines are written by the database (COPY ... TO STDOUT), several
# times faster than csv.writer; elsewhere (SQLite) by csv.writer. Same columns and values.
CSV_BY_COPY = True
COPY_BLOCK_BYTES = 1 << 18


def csv_chunks(qs):
    """The CSV bytes of every row, a header first, in chunks (constant memory)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(results.RESULT_COLUMNS)
    if CSV_BY_COPY and connection.vendor == "postgresql":
        yield buf.getvalue().encode()
        yield from results.result_csv_blocks(qs, block_bytes=COPY_BLOCK_BYTES)
        return
    n = 0
    for row in results.result_rows(qs, json_as_text=True, chunk_size=ROWS_PER_WRITE):
        writer.writerow(row)
        n += 1
        if n == ROWS_PER_WRITE:
            yield buf.getvalue().encode()
            buf.seek(0)
            buf.truncate()
            n = 0
    if buf.tell():
        yield buf.getvalue().encode()


def json_chunks(qs):
    """A JSON array of row objects (the ResultOut fields), streamed."""
    columns = results.RESULT_COLUMNS
    dumps = json.JSONEncoder(ensure_ascii=False, allow_nan=False,
                             separators=(",", ":")).encode
    parts, sep = ["["], ""
    for row in results.result_rows(qs, chunk_size=ROWS_PER_WRITE):
        parts.append(sep + dumps(dict(zip(columns, row))))
        sep = ",\n"
        if len(parts) >= ROWS_PER_WRITE:
            yield "".join(parts)
            parts = []
    parts.append("]\n")
    yield "".join(parts)


def export_response(qs, fmt: str, filename: str) -> StreamingHttpResponse:
    if fmt == "csv":
        chunks, content_type = csv_chunks(qs), "text/csv; charset=utf-8"
    else:
        chunks, content_type = (c.encode() for c in json_chunks(qs)), "application/json"
    response = StreamingHttpResponse(chunks, content_type=content_type)
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    response["Cache-Control"] = "no-store"
    return response
