"""The REST API (django-ninja): public reads of targets, protocols, drafters, runs and
results (paginated, or exported whole as CSV or JSON, streamed in constant memory), and
writes by API token: submit a drafter, cancel one's run, withdraw one's drafter.

Schema: /api/openapi.json; interactive docs: /api/docs. One router per area (catalog,
analysis, board, drafters, history, runs, results, auth, engine_versions); reads go through
leaderboard.selectors (the same functions as the pages), writes through
leaderboard.submissions. Every error answers
{"detail": [{"file", "member", "field", "message"}]} (errors.py).
"""
from __future__ import annotations

from ninja import NinjaAPI

from . import (analysis, auth, board, catalog, drafters, engine_versions, history, results,
               runs, submissions)
from .errors import add_exception_handlers

API_VERSION = "1.0.0"

DESCRIPTION = """\
Everything the SpecBoard site shows, as JSON or CSV.

* **Reads** are public. Lists are paginated with `limit` and `offset` and answer
  `{"count", "limit", "offset", "items"}`.
* **Results** (`/api/results`) are the cells of each run's grid, each row with its
  provenance (protocol slug, version and sha256, engine version, hardware class, run id).
  `format=csv` and `format=json` export every matching row at once, streamed
  (no pagination), with a file name naming the protocol and the date.
* **Writes** need an API token: `Authorization: Bearer TOKEN`. Create one on the account
  settings page or with `python manage.py api_token USERNAME`.
* **Submitting** (`POST /api/drafters`, files or a model-hub reference) answers 202 with
  the submission in the state `checking`: the intake worker checks it out of the web
  process. Poll `GET /api/submissions/{id}` until it is `accepted` (its drafter and run) or
  `refused` (every problem by file and field; nothing stored).
* **Errors** always answer `{"detail": [{"file", "member", "field", "message"}]}`: 400 a
  refused request (an engine version a protocol's family already pins); 401 no,
  unknown or revoked token; 403 not the owner (nor staff); 404 no such object; 409 a
  conflict (a finished run); 413 upload over the size limit; 422 invalid parameters; 429
  too many submissions in 24 hours. A checkpoint's own problems (and a duplicate) are
  the refused submission's `problems`.
"""


class SpecBoardAPI(NinjaAPI):
    def get_openapi_schema(self, **kwargs):
        """The schema, where /api/results answers JSON either as one page (ResultPage) or,
        with format=json, as the array of every matching row."""
        schema = super().get_openapi_schema(**kwargs)
        for path, ops in schema["paths"].items():
            if path.endswith("/results"):
                content = ops["get"]["responses"][200]["content"]
                content["application/json"]["schema"] = {"oneOf": [
                    {"$ref": "#/components/schemas/ResultPage"},
                    {"type": "array", "items": {"$ref": "#/components/schemas/ResultOut"},
                     "description": "format=json: every matching row"}]}
        return schema

    def get_openapi_operation_id(self, operation):
        """leaderboard_api_<function>, the ids of the API when it was one module: clients
        generated from the schema keep working."""
        return f"leaderboard_api_{operation.view_func.__name__}"


api = SpecBoardAPI(title="SpecBoard API", version=API_VERSION, description=DESCRIPTION,
                   urls_namespace="api")
add_exception_handlers(api)
for area in (catalog, analysis, board, drafters, history, submissions, runs, results, auth,
             engine_versions):
    api.add_router("", area.router)
