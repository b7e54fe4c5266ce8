"""Local aiohttp servers that speak the real provider wire formats from scripted responses.

A FakeServer answers each request with the next scripted responder (SSE event lists, error
statuses, a server that hangs, an endless stream) and records what it received and whether the
client went away mid-stream, so tests observe the upstream connection from the server's side.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

Responder = Callable[[web.Request, "FakeServer"], Awaitable[web.StreamResponse]]


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class FakeServer:
    """Scripted responders, used in order; the last one keeps answering once the rest ran out."""

    responders: list[Responder] = field(default_factory=list)
    received: list[Received] = field(default_factory=list)
    client_gone: asyncio.Event = field(default_factory=asyncio.Event)
    events_sent: int = 0
    _runner: web.AppRunner | None = None
    base_url: str = ""

    def script(self, *responders: Responder) -> FakeServer:
        self.responders.extend(responders)
        return self

    async def start(self) -> FakeServer:
        app = web.Application()
        app.router.add_route("POST", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.base_url = f"http://{host}:{port}"
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            body = {}
        self.received.append(Received(request.path, dict(request.headers), body))
        if not self.responders:
            return web.json_response({"error": {"message": "no script"}}, status=500)
        responder = self.responders.pop(0) if len(self.responders) > 1 else self.responders[0]
        return await responder(request, self)

    async def wait_client_gone(self, within: float) -> float:
        """Seconds until the server saw the client close the streaming connection."""
        started = time.monotonic()
        await asyncio.wait_for(self.client_gone.wait(), within)
        return time.monotonic() - started


def frame(data: str, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data}\n\n".encode()


async def _start_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


def sse(frames: Iterable[bytes], *, delay_s: float = 0.0, then: str = "end") -> Responder:
    """Send `frames`; then end the response ("end"), cut the connection ("cut"), or go silent
    with the connection open ("hang")."""
    frames = list(frames)

    async def respond(request: web.Request, server: FakeServer) -> web.StreamResponse:
        response = await _start_sse(request)
        for data in frames:
            if delay_s:
                await asyncio.sleep(delay_s)
            await response.write(data)
            server.events_sent += 1
        if then == "cut":
            assert request.transport is not None
            request.transport.close()
            return response
        if then == "hang":
            await asyncio.Event().wait()
        await response.write_eof()
        return response

    return respond


def status(code: int, body: Any, headers: dict[str, str] | None = None) -> Responder:
    async def respond(_request: web.Request, _server: FakeServer) -> web.StreamResponse:
        if isinstance(body, str):
            return web.Response(status=code, text=body, headers=headers)
        return web.json_response(body, status=code, headers=headers)

    return respond


def hang() -> Responder:
    """Accept the request and never answer (not even headers)."""

    async def respond(_request: web.Request, _server: FakeServer) -> web.StreamResponse:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    return respond


def endless(make_frame: Callable[[int], bytes], *, interval_s: float = 0.02) -> Responder:
    """Stream frames forever; record the moment the client goes away (a write fails or the
    transport closes) in `server.client_gone`."""

    async def respond(request: web.Request, server: FakeServer) -> web.StreamResponse:
        response = await _start_sse(request)
        index = 0
        try:
            while True:
                transport = request.transport
                if transport is None or transport.is_closing():
                    break
                await response.write(make_frame(index))
                server.events_sent += 1
                index += 1
                await asyncio.sleep(interval_s)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            server.client_gone.set()
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response

    return respond


# -- OpenAI chat-completions chunks, shaped like recorded ones --------------------------------

_CHUNK_HEAD = {"id": "chatcmpl-A1b2C3", "object": "chat.completion.chunk",
               "created": 1730000000, "model": "fake", "system_fingerprint": "fp_0a1b2c"}


def openai_chunk(delta: dict[str, Any] | None = None, finish: str | None = None) -> bytes:
    return frame(json.dumps({**_CHUNK_HEAD, "choices": [
        {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}],
        "usage": None}))


def openai_usage(prompt: int, completion: int) -> bytes:
    return frame(json.dumps({**_CHUNK_HEAD, "choices": [], "usage": {
        "prompt_tokens": prompt, "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0}}}))


OPENAI_DONE = frame("[DONE]")


def openai_text(*pieces: str, usage: tuple[int, int] = (12, 5)) -> list[bytes]:
    """A plain answer: role chunk, one chunk per piece, stop, usage, [DONE]."""
    return [openai_chunk({"role": "assistant", "content": "", "refusal": None}),
            *(openai_chunk({"content": piece}) for piece in pieces),
            openai_chunk({}, "stop"), openai_usage(*usage), OPENAI_DONE]


def openai_tool_calls(calls: list[tuple[str, str, list[str]]],
                      usage: tuple[int, int] = (30, 20), *, said: Sequence[str] = ()
                      ) -> list[bytes]:
    """Tool calls (id, name, argument fragments), fragments interleaved across calls the way
    parallel calls stream: the first fragment carries id and name, the rest only text. `said`:
    text the model streams before its calls."""
    frames = [openai_chunk({"role": "assistant", "content": None})]
    frames += [openai_chunk({"content": piece}) for piece in said]
    for index, (call_id, name, _) in enumerate(calls):
        frames.append(openai_chunk({"tool_calls": [{"index": index, "id": call_id,
                                                    "type": "function",
                                                    "function": {"name": name,
                                                                 "arguments": ""}}]}))
    longest = max(len(fragments) for _, _, fragments in calls)
    for step in range(longest):
        for index, (_, _, fragments) in enumerate(calls):
            if step < len(fragments):
                frames.append(openai_chunk({"tool_calls": [
                    {"index": index, "function": {"arguments": fragments[step]}}]}))
    return [*frames, openai_chunk({}, "tool_calls"), openai_usage(*usage), OPENAI_DONE]


def openai_error(message: str, kind: str = "server_error") -> bytes:
    return frame(json.dumps({"error": {"message": message, "type": kind, "param": None,
                                       "code": None}}))


# -- Anthropic Messages API events, shaped like recorded ones ---------------------------------


def anthropic_event(kind: str, **data: Any) -> bytes:
    return frame(json.dumps({"type": kind, **data}), event=kind)


def anthropic_message(blocks: list[tuple[str, Any]], *, stop_reason: str,
                      usage: tuple[int, int] = (25, 40)) -> list[bytes]:
    """A whole streamed message. blocks: ("text", [pieces]) or ("tool_use", (id, name,
    [partial_json pieces]))."""
    frames = [anthropic_event("message_start", message={
        "id": "msg_01XFDUDYJgAACzvnptvVoYEL", "type": "message", "role": "assistant",
        "model": "claude-sonnet-4", "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": usage[0], "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 0, "output_tokens": 1}}),
        anthropic_event("ping")]
    for index, (kind, spec) in enumerate(blocks):
        if kind == "text":
            frames.append(anthropic_event("content_block_start", index=index,
                                          content_block={"type": "text", "text": ""}))
            frames += [anthropic_event("content_block_delta", index=index,
                                       delta={"type": "text_delta", "text": piece})
                       for piece in spec]
        else:
            call_id, name, pieces = spec
            frames.append(anthropic_event("content_block_start", index=index, content_block={
                "type": "tool_use", "id": call_id, "name": name, "input": {}}))
            frames += [anthropic_event("content_block_delta", index=index,
                                       delta={"type": "input_json_delta", "partial_json": p})
                       for p in ["", *pieces]]
        frames.append(anthropic_event("content_block_stop", index=index))
    frames.append(anthropic_event("message_delta",
                                  delta={"stop_reason": stop_reason, "stop_sequence": None},
                                  usage={"output_tokens": usage[1]}))
    frames.append(anthropic_event("message_stop"))
    return frames


def anthropic_error(kind: str, message: str) -> bytes:
    return anthropic_event("error", error={"type": kind, "message": message})


async def cancel_after(stream: AsyncIterator[Any], items: int, *, within: float = 30,
                       counts: Callable[[Any], bool] = lambda _item: True) -> None:
    """Consume `stream` in a task until `items` counted items arrived, then cancel that task
    (as a stop or a lost lease does) and check the cancellation went through."""
    enough = asyncio.Event()

    async def consume() -> None:
        seen = 0
        async for item in stream:
            seen += counts(item)
            if seen >= items:
                enough.set()

    task = asyncio.create_task(consume())
    try:
        await asyncio.wait_for(enough.wait(), within)
    finally:
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert task.cancelled(), "the consumer ended before it was cancelled"
