"""The client's address, the one rule every throttle keys on: django-ratelimit
(RATELIMIT_IP_META_KEY) and django-axes (AXES_CLIENT_IP_CALLABLE).

Without a proxy (SPECBOARD_TRUSTED_PROXIES = 0) it is REMOTE_ADDR, and a forwarded header
is ignored: a client could write any address in it. Behind N trusted proxies, each appends
the address it received the request from to the forwarded header (nginx's
$proxy_add_x_forwarded_for, most load balancers), so the client is the N-th address from
the right: the one the outermost trusted proxy saw; whatever the client wrote itself lies
further left and is never read. (django-ipware's proxy_count counts proxies listed inside
the header, which these proxies do not add, so its rule would trust nothing here.)"""
from __future__ import annotations

import ipaddress

from django.conf import settings


def client_ip(request, *args) -> str:
    """A Django request's client (see ``client_address``)."""
    key = "HTTP_" + settings.SPECBOARD_FORWARDED_HEADER.upper().replace("-", "_")
    return client_address(request.META.get("REMOTE_ADDR", ""), request.META.get(key, ""))


def client_address(remote: str, forwarded: str) -> str:
    """``remote`` (the peer's address), or behind SPECBOARD_TRUSTED_PROXIES proxies the
    address the outermost one saw, from ``forwarded`` (the SPECBOARD_FORWARDED_HEADER
    value). A header too short or not an address falls back to ``remote`` (the proxy's
    own: all such clients then share one budget). The demo's queue uses it too."""
    proxies = settings.SPECBOARD_TRUSTED_PROXIES
    if proxies <= 0:
        return remote
    hops = [h.strip() for h in (forwarded or "").split(",") if h.strip()]
    if len(hops) < proxies:
        return remote
    try:
        return str(ipaddress.ip_address(hops[-proxies]))
    except ValueError:
        return remote
