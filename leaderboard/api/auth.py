"""API tokens: `Authorization: Bearer TOKEN` for the writes, the checks a submission
passes before its upload is read, and /me, which says whose token it is."""
from __future__ import annotations

from ninja import Router
from ninja.errors import AuthenticationError
from ninja.security import HttpBearer
from pydantic import Field

from .. import tokens
from ..middleware import content_length, upload_too_large_message
from ..services import submissions
from .common import Out
from .errors import ApiError, PayloadTooLarge, error_responses, problem

class TokenAuth(HttpBearer):
    """`Authorization: Bearer TOKEN`; only the token's sha256 is stored (ApiToken). With
    `upload=True` (submissions) it then refuses what can be refused before the upload is
    read: a body over the size limit (413) and the submission rate limit (429)."""

    def __init__(self, upload: bool = False):
        super().__init__()
        self.upload = upload

    def __call__(self, request):
        value = request.headers.get(self.header, "")
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthenticationError()
        return self.authenticate(request, token)

    def authenticate(self, request, token):
        user = tokens.user_for_token(token)
        if user is None:
            raise ApiError(401, problem("(request)", "Authorization",
                                        "this API token is unknown or revoked: create a new "
                                        "one on the account settings page"))
        if self.upload:
            check_upload_size(request)
            submissions.check_rate_limit(user)
        return user


def check_upload_size(request):
    message = upload_too_large_message(content_length(request))
    if message is not None:
        raise PayloadTooLarge(message)


token_auth = TokenAuth()
submit_auth = TokenAuth(upload=True)


class MeOut(Out):
    username: str = Field(description="the token's user")
    is_staff: bool = Field(description="staff may manage every drafter and run")


router = Router()


@router.get("/me", response={200: MeOut, **error_responses(401)}, auth=token_auth,
            tags=["writes"], summary="Whose token this is")
def me(request):
    return {"username": request.auth.username, "is_staff": request.auth.is_staff}
