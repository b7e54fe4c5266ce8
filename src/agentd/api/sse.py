"""Server-Sent Events framing: headers sent at once, no compression, keepalive comments.

A write to a vanished client raises ConnectionResetError, which ends the tail promptly.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

OPEN_STREAM = web.RequestKey("open_stream", web.StreamResponse)


async def open_stream(request: web.Request) -> web.StreamResponse:
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
