"""Server-Sent Events framing: headers sent at once, no compression, keepalive comments.

A write to a vanished client raises ConnectionResetError, which ends the tail promptly.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from agentd.limits import drop_when_unacknowledged

OPEN_STREAM = web.RequestKey("open_stream", web.StreamResponse)


async def open_stream(request: web.Request, *, dead_after_s: float) -> web.StreamResponse:
    """Start the stream's answer. A client that acknowledges nothing of it for `dead_after_s`
    (a laptop gone without a reset) is dropped then, not after the kernel's ~15 minutes of
    retransmissions, during which its stream held a slot and its device showed as attached.
    Streams only: a download a client pauses reading (a pager) is not cut."""
    transport = request.transport
    if transport is not None:
        drop_when_unacknowledged(transport.get_extra_info("socket"), dead_after_s)
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream; charset=utf-8",
        "Cache-Control": "no-cache, no-transform",
        "X-Accel-Buffering": "no",  # nginx: do not buffer the stream
        "Connection": "keep-alive",
    })
    await response.prepare(request)
    request[OPEN_STREAM] = response  # past this point an error can only end the stream
    return response


def frame(event_id: str | int | None, event: str, data: dict[str, Any]) -> bytes:
    lines = []
    if event_id is not None:
        lines.append(f"id: {event_id}")
    lines.append(f"event: {event}")
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    lines.extend(f"data: {line}" for line in payload.split("\n"))
    return ("\n".join(lines) + "\n\n").encode()


async def send(response: web.StreamResponse, event_id: str | int | None, event: str,
               data: dict[str, Any]) -> None:
    await response.write(frame(event_id, event, data))


async def keepalive(response: web.StreamResponse) -> None:
    # A comment line, without the blank line that would end an event: a blank line after an
    # `id` makes some parsers (httpx-sse 0.4) dispatch an empty event, which clients then
    # take for a broken frame. The bytes alone keep proxies and read timeouts warm.
    await response.write(b": keepalive\n")
