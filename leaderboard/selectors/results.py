"""Result rows for the REST API and its export: filters, pages, and the CSV stream that
PostgreSQL writes itself (COPY ... TO STDOUT). Rows reuse the page shapes (Result.CELL_FIELDS),
so a page and the export show the same fields under the same names."""
from __future__ import annotations

from django.db import connection
from django.db.models import BooleanField, Case, F, Func, TextField, Value, When
from django.db.models.fields.json import KeyTransform
from django.db.models.functions import Cast, Coalesce

from worker.analysis import EXPORT_COLUMNS

from ..models import Result
from .shapes import HIDDEN_REVIEW_STATES, filtered, protocol_ref_lookups


RESULT_PROVENANCE = (
    "id", "run_id", "protocol", "protocol_version", "protocol_sha256", "target", "engine",
    "engine_version", "hardware", "hardware_description", "run_state", "drafter", "method",
)
# The columns of a result row, in export order: provenance, then the cell, then what "When
# does it pay?" computed from the run's raw records (worker.analysis, stored by the run
# service when the run succeeds; null where there are none).
# Then which baseline cell (and run) the speedup divides by, the run's drift, and the
# cell's self-checks as two flat columns.
RESULT_COLUMNS = (RESULT_PROVENANCE + Result.CELL_FIELDS
                  + ("baseline_result_id", "baseline_run_id", "run_drift", "run_drift_flagged",
                     "checks_ok", "checks_failed")
                  + tuple(c for c in EXPORT_COLUMNS if c not in Result.CELL_FIELDS))
RESULT_JSON_COLUMNS = ("accepted_at", "per_position_acceptance", "conditional_acceptance",
                       "pass_throughputs", "checks", "checks_failed")
RESULT_BOOL_COLUMNS = ("run_drift_flagged", "checks_ok")
BASELINE_METHOD = "baseline"


def results_queryset(*, protocol: str | None = None, version: int | None = None,
                     target: str | None = None, drafter: str | None = None,
                     method: str | None = None, task: str | None = None,
                     batch_size: int | None = None, temperature: float | None = None,
                     k: int | None = None, run: int | None = None,
                     run_state: str | None = None):
    """Result cells (one row per cell of a run's grid) with their provenance, in grid
    order (run, task, batch size, temperature, k). `protocol` is a slug or slug@version;
    `method` "baseline" selects the baseline runs. Cells of withdrawn or rejected drafters
    are left out, as on the leaderboard. None for a filter means every value."""
    qs = Result.objects.exclude(run__drafter__review_state__in=HIDDEN_REVIEW_STATES)
    if method == BASELINE_METHOD:
        qs = qs.filter(run__drafter__isnull=True)
        method = None
    qs = filtered(qs, **protocol_ref_lookups(protocol, "run__"))
    qs = filtered(qs, run__protocol__version=version, run__protocol__target__slug=target,
                  run__drafter__slug=drafter, run__drafter__method=method, task=task,
                  batch_size=batch_size, temperature=temperature, k=k, run_id=run,
                  run__state=run_state)
    return qs.order_by("run_id", "task", "batch_size", "temperature", "k")


# measured_at as datetime.isoformat(timespec="microseconds") writes it, in UTC.
ISO_UTC_SQL = ("to_char(%(expressions)s AT TIME ZONE 'UTC', "
               "'YYYY-MM-DD\"T\"HH24:MI:SS.US\"+00:00\"')")


def _result_values(qs, json_as_text: bool, time_as_text: bool = False):
    """values_list of RESULT_COLUMNS. With json_as_text the list columns come as their
    JSON text straight from the database (the CSV export writes them as they are); with
    time_as_text (PostgreSQL) measured_at comes as ISO 8601 text."""
    provenance = dict(
        protocol=F("run__protocol__slug"), protocol_version=F("run__protocol__version"),
        protocol_sha256=F("run__protocol__sha256"), target=F("run__protocol__target__slug"),
        engine=F("run__protocol__engine"), engine_version=F("run__engine_version"),
        hardware=F("run__hardware"), hardware_description=F("run__hardware_description"),
        run_state=F("run__state"), drafter=F("run__drafter__slug"),
        method=Coalesce(F("run__drafter__method"), Value(BASELINE_METHOD)),
        baseline_run_id=F("baseline_result__run_id"), run_drift=F("run__drift"),
        run_drift_flagged=F("run__drift_flagged"),
        checks_ok=Case(When(checks__ok=True, then=Value(True)),
                       When(checks__ok=False, then=Value(False)),
                       default=Value(None), output_field=BooleanField()),
        checks_failed=KeyTransform("failed", "checks"),
    )
    if json_as_text:
        provenance.update({f"{c}_text": Cast(c, TextField()) for c in RESULT_JSON_COLUMNS})
    if time_as_text:
        provenance["measured_at_text"] = Func(F("measured_at"), template=ISO_UTC_SQL,
                                              output_field=TextField())
    bools = {}
    if time_as_text:
        # PostgreSQL's COPY writes booleans t / f; csv.writer writes True / False.
        bools = {f"{c}_text": Case(When(**{c: True}, then=Value("True")),
                                   When(**{c: False}, then=Value("False")),
                                   default=Value(None), output_field=TextField())
                 for c in RESULT_BOOL_COLUMNS}
    columns = [f"{c}_text" if (json_as_text and c in RESULT_JSON_COLUMNS)
               or (time_as_text and (c == "measured_at" or c in RESULT_BOOL_COLUMNS))
               else c for c in RESULT_COLUMNS]
    return qs.annotate(**provenance).annotate(**bools).values_list(*columns)


def result_rows(qs, *, json_as_text: bool = False, chunk_size: int = 2000):
    """Iterate the rows of a results_queryset as lists in RESULT_COLUMNS order, in chunks
    (constant memory: a server-side cursor on PostgreSQL), measured_at as ISO 8601 text."""
    at = RESULT_COLUMNS.index("measured_at")
    for row in _result_values(qs, json_as_text).iterator(chunk_size=chunk_size):
        row = list(row)
        row[at] = row[at].isoformat(timespec="microseconds")
        yield row


def result_csv_blocks(qs, block_bytes: int = 1 << 18):
    """PostgreSQL only: the CSV lines (no header) of a results_queryset in RESULT_COLUMNS
    order, written by the database itself (COPY (SELECT ...) TO STDOUT), as byte blocks of
    about block_bytes. The same query and values as result_rows(json_as_text=True); only
    the spelling differs where CSV allows it (a float 16.0 is written 16, an empty string
    ""). Constant memory: the rows stream from the server."""
    sql, params = _result_values(qs, json_as_text=True, time_as_text=True).query.sql_with_params()
    statement = f"COPY ({connection.ops.compose_sql(sql, params)}) TO STDOUT WITH (FORMAT csv)"
    with connection.cursor() as cursor:
        with cursor.copy(statement) as copy:
            parts, size = [], 0
            for block in copy:
                parts.append(block)
                size += len(block)
                if size >= block_bytes:
                    yield b"".join(parts)
                    parts, size = [], 0
            if parts:
                yield b"".join(parts)


def results_page(qs, limit: int, offset: int) -> tuple[int, list[dict]]:
    """(count, one page of a results_queryset as dicts keyed by RESULT_COLUMNS). Two
    queries."""
    at = RESULT_COLUMNS.index("measured_at")
    rows = []
    for row in _result_values(qs, json_as_text=False)[offset:offset + limit]:
        row = list(row)
        row[at] = row[at].isoformat(timespec="microseconds")
        rows.append(dict(zip(RESULT_COLUMNS, row)))
    return qs.count(), rows

