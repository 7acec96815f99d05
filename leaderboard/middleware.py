"""Refusals that must come before a request body is read.

Django reads a POST body as soon as anything touches ``request.POST`` — the CSRF check does,
before the view runs — and a multipart body's files are spooled to a temporary file however
large they are (DATA_UPLOAD_MAX_MEMORY_SIZE counts only the other fields). So every
request's body is capped here, in ``__call__`` (which runs before every middleware's
``process_view``, the CSRF check's included), from the Content-Length header alone:

- uploads (POST /submit/ and POST /api/drafters): SPECBOARD_MAX_UPLOAD_BYTES;
- everything else: SPECBOARD_MAX_REQUEST_BYTES;
- a body without a Content-Length (``Transfer-Encoding: chunked``): 411. Django reads such a
  body as empty anyway (WSGI gives it no length), so nothing that works is refused.

The submit page's rate limit is checked here too, from the session's user; the API checks
it in its token check (leaderboard/api/auth.py).

A refusal sets no ``Connection`` header: it is hop-by-hop, which a WSGI application may not
set (wsgiref, hence runserver, turns the response into a 500; gunicorn drops it). What
becomes of the unread body is the server's business: gunicorn's sync worker closes the
connection after every response; runserver reads the rest of the body before it serves the
connection's next request (a client that got its answer and closes ends that at once).
"""
from django.conf import settings
from django.http import HttpResponse, JsonResponse
from django.shortcuts import render
from django.urls import reverse

from worker.checkpoint import Problem

from .services import submissions

# A multipart body carries boundaries and the form fields besides the files.
FORM_OVERHEAD_BYTES = 1024 * 1024


def content_length(request) -> int:
    try:
        return max(int(request.META.get("CONTENT_LENGTH") or 0), 0)
    except ValueError:
        return 0


def upload_too_large_message(length: int) -> str | None:
    limit = settings.SPECBOARD_MAX_UPLOAD_BYTES
    if length <= limit + FORM_OVERHEAD_BYTES:
        return None
    return (f"the request body is {length} bytes; uploads are limited to {limit} bytes "
            "(SPECBOARD_MAX_UPLOAD_BYTES): upload a smaller checkpoint (bf16 weights, only "
            "the drafter's own tensors)")


def request_too_large_message(length: int) -> str | None:
    limit = settings.SPECBOARD_MAX_REQUEST_BYTES
    if length <= limit:
        return None
    return (f"the request body is {length} bytes; request bodies are limited to {limit} "
            "bytes (SPECBOARD_MAX_REQUEST_BYTES; uploads have SPECBOARD_MAX_UPLOAD_BYTES)")


NUL_MESSAGE = "the address holds a NUL byte (%00), which no parameter of this site accepts"

NO_LENGTH_MESSAGE = ("the request body has no Content-Length header: send it with one "
                     "(chunked request bodies are not accepted)")


class UploadGuardMiddleware:
    """Every request: 413 over its body limit, 411 without a Content-Length; a page: 400
    with a NUL byte in its address; POST /submit/: 429 over the submission rate limit. The body is
    never read."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.refusal(request) or self.get_response(request)

    def refusal(self, request):
        upload = request.method == "POST" and request.path in (
            reverse("submit"), reverse("api:list_drafters"))  # GET lists, POST submits
        api = request.path.startswith(reverse("api:api-root"))
        if "HTTP_TRANSFER_ENCODING" in request.META:
            return self.refused(request, 411, NO_LENGTH_MESSAGE, api, "(request)")
        if not api and ("\x00" in request.path or any(
                "\x00" in key or "\x00" in value
                for key, values in request.GET.lists() for value in values)):
            # No page parameter holds a NUL, and PostgreSQL refuses it in any query. (The
            # API's own schema refuses it with a 422 naming the parameter.)
            return self.refused(request, 400, NUL_MESSAGE, api, "(request)")
        length = content_length(request)
        if upload:
            message = upload_too_large_message(length)
            if message is not None:
                return self.refused(request, 413, message, api, "(upload)")
            if not api and request.user.is_authenticated:
                try:
                    submissions.check_rate_limit(request.user)
                except submissions.SubmissionRefused as e:
                    return self.refused(request, 429, e.problems[0].message, api, "(upload)")
            return None
        message = request_too_large_message(length)
        if message is not None:
            return self.refused(request, 413, message, api, "(request)")
        return None

    @staticmethod
    def refused(request, status, message, api, about):
        """The refusal as each kind of client reads it: the API's error shape, the submit
        page's own page, plain text elsewhere."""
        if api:
            # The API's error shape (leaderboard/api/errors.py), a checkpoint Problem's.
            return JsonResponse({"detail": [Problem(
                about, "size" if status == 413 else "Content-Length", message).as_dict()]},
                status=status)
        if request.path == reverse("submit"):
            return render(request, "leaderboard/submit_refused.html", {"message": message},
                          status=status)
        return HttpResponse(message + "\n", status=status,
                            content_type="text/plain; charset=utf-8")
