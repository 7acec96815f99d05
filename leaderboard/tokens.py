"""API tokens: created here (settings page, `manage.py api_token`), shown once, stored as
their sha256 only. The REST API authenticates a bearer token with `user_for_token`."""
from __future__ import annotations

import secrets

from django.utils import timezone

from .models import ApiToken

PREFIX = "sb_"


def create_token(user, name: str = "") -> tuple[ApiToken, str]:
    """A new token for `user`: returns the row and the token itself (never stored)."""
    raw = PREFIX + secrets.token_urlsafe(32)
    token = ApiToken.objects.create(user=user, name=name[:100], token_sha256=ApiToken.hash(raw))
    return token, raw


def revoke_token(user, token_id: int) -> bool:
    """Revoke one of `user`'s tokens; False if it is not theirs or already revoked."""
    return bool(ApiToken.objects.filter(pk=token_id, user=user, revoked_at__isnull=True)
                .update(revoked_at=timezone.now()))


def user_for_token(raw: str):
    """The active user a token belongs to, or None (unknown, revoked, inactive user)."""
    if not raw:
        return None
    token = (ApiToken.objects.select_related("user")
             .filter(token_sha256=ApiToken.hash(raw.strip()), revoked_at__isnull=True).first())
    if token is None or not token.user.is_active:
        return None
    ApiToken.objects.filter(pk=token.pk).update(last_used_at=timezone.now())
    return token.user
