"""Reads for a signed-in user's settings page: their API tokens and drafters."""
from __future__ import annotations

from ..models import ApiToken, Drafter
from .shapes import drafter_summary


def user_tokens(user) -> list[dict]:
    return list(ApiToken.objects.filter(user=user).order_by("-created_at").values(
        "id", "name", "created_at", "last_used_at", "revoked_at"))


def user_drafters(user) -> list[dict]:
    return [drafter_summary(d) for d in
            Drafter.objects.filter(owner=user).select_related("owner").order_by("-created_at")]

