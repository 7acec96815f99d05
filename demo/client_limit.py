"""At most SPECBOARD_DEMO_PER_CLIENT generations waiting or running per client address, so
that one person cannot hold the demo's queue (one generation runs at a time; the queue
holds SPECBOARD_DEMO_QUEUE_SIZE). Gradio has no such limit, so its queue's ``push`` (what
``/gradio_api/queue/join`` calls) is wrapped: it counts the client's events already
waiting or running, by the address rule every throttle of the site uses
(leaderboard/clientip.py), and turns the new one away as "queue full" with a sentence.
This reads Gradio's queue (``Queue.event_queue_per_concurrency_id``, ``active_jobs``,
``Event.request``) as of the gradio version pyproject.toml pins;
tests/test_demo.py checks it on a live demo."""
from __future__ import annotations

from django.conf import settings

from leaderboard.clientip import client_address


def client_of(request) -> str:
    """The client of a Starlette/FastAPI request (its peer, or behind trusted proxies the
    address they forwarded)."""
    if request is None:
        return ""
    peer = request.client.host if getattr(request, "client", None) else ""
    return client_address(peer, request.headers.get(settings.SPECBOARD_FORWARDED_HEADER, ""))


def pending_events(queue) -> list:
    """The events of Gradio's ``queue`` waiting or running."""
    waiting = [e for q in queue.event_queue_per_concurrency_id.values() for e in q.queue]
    running = [e for job in queue.active_jobs if job for e in job]
    return waiting + running


def limit_per_client(blocks, limit: int) -> None:
    """Wrap ``blocks``' queue (after ``blocks.queue(...)``) so that a client with ``limit``
    events waiting or running has its next one refused."""
    queue = blocks._queue
    push = queue.push

    async def limited_push(body, request, username):
        client = client_of(request)
        mine = [e for e in pending_events(queue) if client_of(e.request) == client]
        if limit and len(mine) >= limit:
            return (False, f"You already have {len(mine)} generation"
                    f"{'s' if len(mine) != 1 else ''} waiting or running; the demo takes "
                    f"{limit} per visitor at a time (SPECBOARD_DEMO_PER_CLIENT): wait for "
                    "it to finish.", "queue_full")
        return await push(body, request, username)

    queue.push = limited_push
