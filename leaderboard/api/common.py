"""What every area of the API shares: the base of the answer schemas, paging, and the
patterns and limits that keep each parameter within what the database can hold."""
from __future__ import annotations

from ninja import Schema
from pydantic import ConfigDict, Field

from worker.methods import DRAFTER_METHODS

# Numbers the database columns can hold (PositiveIntegerField; BigAutoField ids), so that
# an out-of-range filter is a 422, never a database error.
INT_MAX = 2 ** 31 - 1
ID_MAX = 2 ** 63 - 1
SLUG = r"^[-a-zA-Z0-9_]+$"
PROTOCOL_REF = r"^[-a-zA-Z0-9_]+(@[0-9]{1,9})?$"
TASK = r"^[-a-zA-Z0-9_.]+$"
METHODS = DRAFTER_METHODS
MAX_LIMIT = 1000


class Out(Schema):
    model_config = ConfigDict(extra="ignore")


class PageOut(Out):
    """What every paginated answer has besides its items."""
    count: int = Field(description="rows matching the filters")
    limit: int = Field(description="page size")
    offset: int = Field(description="rows skipped")


class PageQuery(Schema):
    limit: int = Field(100, ge=1, le=MAX_LIMIT, description=f"page size (at most {MAX_LIMIT})")
    offset: int = Field(0, ge=0, le=INT_MAX, description="rows to skip")
