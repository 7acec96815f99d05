"""The one error shape: every error answers {"detail": [{"file", "member", "field",
"message"}]} (ErrorOut) with its status, whatever raised it: a view (ApiError), ninja
(validation, authentication), Django (request size) or the submission service."""
from __future__ import annotations

from typing import Optional

from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent
from django.db import InterfaceError, OperationalError
from django.http import Http404
from ninja import NinjaAPI, Schema
from ninja.errors import AuthenticationError, HttpError, ValidationError
from pydantic import Field

from ..services import submissions


class ProblemOut(Schema):
    file: str = Field(description="what the problem is about: an uploaded file's name, or "
                                  "(request), (query), (path), (form), (upload), (submission)")
    member: Optional[str] = Field(None, description="the archive member, for a problem "
                                                    "inside an uploaded archive")
    field: str = Field(description="the parameter, config key, tensor or aspect at fault "
                                   "(e.g. batch_size, vocab_size, extension, size)")
    message: str = Field(description="what is wrong and how to fix it")


class ErrorOut(Schema):
    detail: list[ProblemOut] = Field(description="every problem found")


def problem(file, field, message, member=None) -> dict:
    return {"file": file, "member": member, "field": field, "message": message}


class ApiError(Exception):
    def __init__(self, status: int, *problems: dict):
        self.status, self.problems = status, problems
        super().__init__(problems)


class PayloadTooLarge(ApiError):
    def __init__(self, message):
        super().__init__(413, problem("(upload)", "size", message))


def not_found(field, message):
    return ApiError(404, problem("(path)", field, message))


def not_manager():
    return ApiError(403, problem("(request)", "owner", "only the owner of the drafter or "
                                                      "staff may do this"))


ERRORS = {401: ErrorOut, 403: ErrorOut, 404: ErrorOut, 409: ErrorOut, 413: ErrorOut,
          422: ErrorOut, 429: ErrorOut, 503: ErrorOut, 507: ErrorOut}


def error_responses(*codes):
    """The `response=` entries of an operation's error statuses."""
    return {c: ERRORS[c] for c in codes}


DATABASE_UNAVAILABLE = ("the database is unavailable right now; nothing was changed: try "
                        "again in a minute")
RETRY_AFTER_S = 30


def add_exception_handlers(api: NinjaAPI) -> None:
    """Register on `api` the handlers that give every error the ErrorOut shape."""

    def error(request, status: int, *problems: dict, headers: dict | None = None):
        response = api.create_response(request, {"detail": list(problems)}, status=status)
        for k, v in (headers or {}).items():
            response[k] = v
        return response

    @api.exception_handler(ApiError)
    def _api_error(request, exc: ApiError):
        return error(request, exc.status, *exc.problems)

    @api.exception_handler(ValidationError)
    def _validation_error(request, exc: ValidationError):
        out = []
        for e in exc.errors:
            loc = [str(x) for x in e.get("loc", ())]
            source = loc[0] if loc else "request"
            out.append(problem(f"({source})", ".".join(loc[1:]) or source,
                               e.get("msg", "invalid")))
        return error(request, 422, *out)

    @api.exception_handler(AuthenticationError)
    def _authentication_error(request, exc: AuthenticationError):
        return error(request, 401, problem(
            "(request)", "Authorization",
            "send an API token as `Authorization: Bearer TOKEN` (create one on the account "
            "settings page or with `python manage.py api_token USERNAME`)"),
            headers={"WWW-Authenticate": 'Bearer realm="specboard"'})

    @api.exception_handler(HttpError)
    def _http_error(request, exc: HttpError):
        return error(request, exc.status_code, problem("(request)", "(request)", str(exc)))

    @api.exception_handler(Http404)
    def _not_found(request, exc):
        return error(request, 404, problem("(path)", "(path)", str(exc) or "not found"))

    @api.exception_handler(RequestDataTooBig)
    def _too_big(request, exc):
        return error(request, 413, problem("(request)", "size", str(exc)))

    @api.exception_handler(TooManyFilesSent)
    def _too_many_files(request, exc):
        return error(request, 413, problem("(upload)", "files", str(exc)))

    @api.exception_handler(TooManyFieldsSent)
    def _too_many_fields(request, exc):
        return error(request, 413, problem("(request)", "fields", str(exc)))

    def _database_unavailable(request, exc):
        """The database is away (stopped, restarting, unreachable): a 503 the client can
        retry, in the error shape, never a traceback."""
        return error(request, 503, problem("(request)", "database", DATABASE_UNAVAILABLE),
                     headers={"Retry-After": str(RETRY_AFTER_S)})

    api.exception_handler(OperationalError)(_database_unavailable)
    api.exception_handler(InterfaceError)(_database_unavailable)

    @api.exception_handler(submissions.SubmissionRefused)
    def _refused(request, exc: submissions.SubmissionRefused):
        """A refused submission: 429 over the rate limit, 413 over the size limit, 409 for a
        duplicate, 422 for everything else (each problem names its file and field)."""
        problems = exc.as_dicts()
        if any(p["field"] == "rate limit" for p in problems):
            status = 429
        elif any(p["field"] == "storage" for p in problems):
            status = 507
        elif any(p["field"] == "size" and "upload limit" in p["message"] for p in problems):
            status = 413
        elif exc.existing is not None:
            status = 409
        else:
            status = 422
        return error(request, status, *problems)
