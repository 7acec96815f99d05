"""Raw per-request records in storage: the one owner of their names, their format and the
run artifact. The run service writes them as cells land; pages, "When does it pay?" and the
API read them here, never by path.

Layout (Django's storage API, so a shared volume or an object store serves remote workers):
    runs/<run id>/cells/<task>-b<batch>-t<temperature>-k<k>.jsonl.gz   one file per cell
    runs/<run id>/requests.jsonl.gz                                    the run artifact
Each file is gzipped JSON lines, one request record per line (worker.measure writes them).
"""
from __future__ import annotations

import gzip
import io
import json
import logging

from django.core.files.base import ContentFile
from django.core.files.storage import default_storage

from worker import metrics
from worker.protocol import Cell

log = logging.getLogger(__name__)


def cell_name(run_id: int, cell) -> str:
    c = Cell.of(cell)
    return f"runs/{run_id}/cells/{c.task}-b{c.batch_size}-t{c.temperature:g}-k{c.k}.jsonl.gz"


def artifact_name(run_id: int) -> str:
    return f"runs/{run_id}/requests.jsonl.gz"


def _write(name: str, records) -> str:
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz:
        for r in records:
            gz.write((json.dumps(r, separators=(",", ":")) + "\n").encode())
    if default_storage.exists(name):  # a re-measured cell replaces its records
        default_storage.delete(name)
    return default_storage.save(name, ContentFile(buf.getvalue()))


def _read(name: str) -> list[dict]:
    """The records of one file; [] when it is missing or damaged (logged): a damaged file
    costs its figures, never a failed page or run."""
    try:
        if not default_storage.exists(name):
            return []
        with default_storage.open(name, "rb") as f:
            data = gzip.decompress(f.read())
        return [json.loads(line) for line in data.decode().splitlines() if line.strip()]
    except (OSError, EOFError, ValueError) as e:
        log.warning("cannot read %s: %s", name, e)
        return []


def write_cell(run_id: int, cell, records) -> str:
    return _write(cell_name(run_id, cell), records)


def read_cell(run_id: int, cell) -> list[dict]:
    return _read(cell_name(run_id, cell))


def outputs(records) -> dict:
    """{prompt id: output token ids} of a cell's records, the repetition the lossless check
    compares (worker.metrics.lossless_outputs: the one rule)."""
    return metrics.lossless_outputs(records)


class RunRecords:
    """One run's records, each cell's file read at most once (a finished run's records feed
    its artifact, its analysis and its baseline comparisons from one read)."""

    def __init__(self, run_id: int):
        self.run_id = run_id
        self._by_cell: dict[Cell, list[dict]] = {}

    def cell(self, cell) -> list[dict]:
        key = Cell.of(cell)
        if key not in self._by_cell:
            self._by_cell[key] = read_cell(self.run_id, key)
        return self._by_cell[key]

    def outputs(self, cell) -> dict:
        return outputs(self.cell(cell))

    def with_records(self, cells: list[dict], *, batch_size: int | None = None) -> list[dict]:
        """The cell dicts with their records under "records" (only those of one batch size
        when given; the others as they are)."""
        return [{**c, "records": self.cell(c)}
                if batch_size is None or c["batch_size"] == batch_size else c for c in cells]


def write_artifact(run_id: int, records_by_cell) -> str:
    """The run artifact: every cell's records, in the order given, in one file."""
    return _write(artifact_name(run_id),
                  (r for records in records_by_cell for r in records))


def open_artifact(name: str):
    """The artifact file for a download, or None when the storage no longer has it."""
    if not name or not default_storage.exists(name):
        return None
    return default_storage.open(name, "rb")
