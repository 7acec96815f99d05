"""Refusals that must come before a request body is read.

The submit page's upload can be gigabytes. Django reads a POST body as soon as anything
touches ``request.POST`` — the CSRF check does, before the view runs — so the size limit
and the submission rate limit are checked here, in ``process_request`` (which runs before
every middleware's ``process_view``), from the Content-Length header and the session's
user. The API does the same in its token check (leaderboard/api/auth.py).
"""
from django.conf import settings
from django.shortcuts import render
from django.urls import reverse

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


class UploadGuardMiddleware:
    """POST /submit/: 413 over the size limit, 429 over the rate limit, body unread."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if request.method == "POST" and request.path == reverse("submit"):
            refusal = self.refusal(request)
            if refusal is not None:
                return refusal
        return self.get_response(request)

    def refusal(self, request):
        message = upload_too_large_message(content_length(request))
        status = 413
        if message is None and request.user.is_authenticated:
            try:
                submissions.check_rate_limit(request.user)
            except submissions.SubmissionRefused as e:
                message, status = e.problems[0].message, 429
        if message is None:
            return None
        # The unread body is dropped with the connection, not read to the end.
        response = render(request, "leaderboard/submit_refused.html",
                          {"message": message}, status=status)
        response["Connection"] = "close"
        return response
