"""API v1 handlers: parse and check the request, call the service layer, shape the answer."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from datetime import UTC
from typing import Any, TypeVar
from uuid import UUID

from aiohttp import web

from agentd.api import RUNTIME, sse, wire
from agentd.api.auth import auth_middleware, device_revoked, principal
from agentd.api.bodies import (
    MAX_CALL_ID,
    json_body,
    list_after,
    list_cursor,
    max_body_bytes,
    page_limit,
    storable_text,
    validate_approval,
    validate_conversation,
    validate_fork,
    validate_paging,
    validate_run_request,
)
from agentd.api.errors import error_middleware
from agentd.api.stream_guard import open_device_stream
from agentd.export import markdown_blocks, markdown_head
from agentd.providers.catalog import offers
from agentd.queue import Event
from agentd.revocation import Revoked
from agentd.service import (
    NOT_ALLOWED,
    Service,
    ServiceError,
    TranscriptChanged,
    model_allowed,
    not_found,
    parse_uuid,
)
from agentd.tail import (
    EPOCH,
    NIL_UUID,
    BadCursor,
    FeedCursor,
    Recheck,
    conversation_feed,
    run_tail,
)
from agentd.vocabulary import EventType

PRESENCE_TTL_S = 20.0
MAX_WAIT_S = 300.0
MAX_SEQ = 2**62  # journal seqs are bigint; larger cursors name nothing
SERVICE = web.AppKey("service", Service)

log = logging.getLogger("agentd.api")
T = TypeVar("T")


def add_routes(app: web.Application) -> None:
    runtime = app[RUNTIME]
    app[SERVICE] = Service(runtime.pool, runtime.hub, runtime.settings, runtime.tools,
                           starter=runtime.dispatcher)
    app.middlewares.extend([error_middleware, auth_middleware])
    r = app.router
    r.add_get("/v1/me", me)
    r.add_post("/v1/conversations", create_conversation)
    r.add_get("/v1/conversations", list_conversations)
    r.add_get("/v1/conversations/{id}", get_conversation)
    r.add_get("/v1/conversations/{id}/messages", list_messages)
    r.add_patch("/v1/conversations/{id}", update_conversation)
    r.add_delete("/v1/conversations/{id}", delete_conversation)
    r.add_post("/v1/conversations/{id}/fork", fork_conversation)
    r.add_get("/v1/conversations/{id}/export", export_conversation)
    r.add_get("/v1/models", list_models)
    r.add_get("/v1/search", search)
    r.add_post("/v1/conversations/{id}/runs", create_run)
    r.add_post("/v1/conversations/{id}/stop", stop_conversation)
    r.add_get("/v1/conversations/{id}/events", conversation_events)
    r.add_get("/v1/runs/{id}", get_run)
    r.add_get("/v1/runs/{id}/wait", wait_run)
    r.add_post("/v1/runs/{id}/cancel", cancel_run)
    r.add_get("/v1/runs/{id}/events", run_events)
    r.add_get("/v1/runs/{id}/approvals", list_approvals)
    r.add_post("/v1/runs/{id}/approvals/{call_id}", decide_approval)


def _service(request: web.Request) -> Service:
    return request.app[SERVICE]


def _path_id(request: web.Request, what: str) -> UUID:
    return parse_uuid(request.match_info["id"], what)


def _int_query(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    text = request.query.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ServiceError(400, f"invalid_{name}", f"{name} must be an integer") from None
    if not low <= value <= high:
        raise ServiceError(400, f"invalid_{name}", f"{name} must be in [{low}, {high}]")
    return value


async def me(request: web.Request) -> web.Response:
    who = principal(request)
    return web.json_response({"account": who.account_name, "account_id": str(who.account_id),
                              "device": who.device_name, "device_id": str(who.device_id)})


async def create_conversation(request: web.Request) -> web.Response:
    service = _service(request)
    change = validate_conversation(await json_body(request, optional=True), service.settings,
                                   create=True)
    created = await service.create_conversation(principal(request), change)
    return web.json_response(wire.conversation(created), status=201,
                             headers={"Location": f"/v1/conversations/{created.id}"})


async def list_conversations(request: web.Request) -> web.Response:
    limit = _int_query(request, "limit", 100, 1, 1000)
    archived = request.query.get("archived", "false")
    if archived not in ("true", "false"):
        raise ServiceError(400, "invalid_archived", "archived must be true or false")
    items, more = await _service(request).list_conversations(
        principal(request), limit, archived=archived == "true", after=list_after(request.query))
    return web.json_response({"conversations": [wire.conversation(c) for c in items],
                              "next": list_cursor(more) if more else None})


async def get_conversation(request: web.Request) -> web.Response:
    service = _service(request)
    conversation_id = _path_id(request, "conversation")
    state = await service.conversation_state(
        principal(request), conversation_id,
        limit=await _query_of(request, conversation_id, page_limit))
    return web.json_response(wire.conversation_state(state))


async def list_messages(request: web.Request) -> web.Response:
    service, who = _service(request), principal(request)
    conversation_id = _path_id(request, "conversation")
    paging = await _query_of(request, conversation_id, validate_paging)
    page = await service.message_page(who, conversation_id, paging)
    return web.json_response(wire.message_page(page))


async def _query_of(request: web.Request, conversation_id: UUID,
                    parse: Callable[[Mapping[str, str]], T]) -> T:
    """A conversation request's query, parsed: another account's conversation (or none) is a
    404 whatever its query says, as it is with a good one."""
    try:
        return parse(request.query)
    except ServiceError:
        await _service(request).get_conversation(principal(request), conversation_id)
        raise


async def update_conversation(request: web.Request) -> web.Response:
    service = _service(request)
    conversation_id = _path_id(request, "conversation")
    change = validate_conversation(await json_body(request), service.settings, create=False)
    updated = await service.update_conversation(principal(request), conversation_id, change)
    return web.json_response(wire.conversation(updated))


async def delete_conversation(request: web.Request) -> web.Response:
    conversation_id = _path_id(request, "conversation")
    # Shielded: a client that hangs up must not cut the stop-and-delete transaction in half.
    await asyncio.shield(_service(request).delete_conversation(principal(request),
                                                               conversation_id))
    return web.Response(status=204)


async def fork_conversation(request: web.Request) -> web.Response:
    conversation_id = _path_id(request, "conversation")
    message_id = validate_fork(await json_body(request))
    created, copied = await _service(request).fork_conversation(
        principal(request), conversation_id, message_id)
    out = {**wire.conversation(created), "copied_messages": copied,
           "forked_from": {"conversation_id": str(conversation_id),
                           "message_id": str(message_id)}}
    return web.json_response(out, status=201,
                             headers={"Location": f"/v1/conversations/{created.id}"})


async def list_models(request: web.Request) -> web.Response:
    settings = _service(request).settings
    allowed = principal(request).models
    # This account's model patterns (agentd account set --models) narrow what it is offered.
    shown = [o if o.usable is False or model_allowed(o.name, allowed) else
             dataclasses.replace(o, usable=False, reason=NOT_ALLOWED) for o in offers(settings)]
    return web.json_response({"models": [wire.model_offer(o) for o in shown],
                              "default_model": settings.default_model})


async def export_conversation(request: web.Request) -> web.StreamResponse:
    """The transcript as Markdown, written out page by page as it is read (a long one is never
    whole in memory); a missing conversation is a 404 before any of it is sent."""
    service, who = _service(request), principal(request)
    conversation_id = _path_id(request, "conversation")
    conversation = await service.get_conversation(who, conversation_id)
    response = web.StreamResponse(headers={"Content-Type": "text/markdown; charset=utf-8"})
    await response.prepare(request)
    try:
        await response.write(markdown_head(conversation).encode())
        async for messages in service.transcript_pages(who, conversation_id):
            text = "".join(f"\n\n{block}" for block in markdown_blocks(messages))
            await response.write(text.encode())
    except Exception as exc:
        # The status line is sent: no error answer can follow it, and ending the body as if
        # whole would pass a cut transcript off as the conversation. The connection is cut
        # instead, which every client sees as a transfer that did not complete.
        if not isinstance(exc, ConnectionResetError):  # else the reader left: nothing to say
            log.warning("export cut short", exc_info=not isinstance(exc, TranscriptChanged),
                        extra={"conversation_id": str(conversation_id),
                               "reason": type(exc).__name__})
        if request.transport is not None:
            request.transport.abort()
        return response
    await response.write(b"\n")
    await response.write_eof()
    return response


async def search(request: web.Request) -> web.Response:
    limit = _int_query(request, "limit", 50, 1, 200)
    query = request.query.get("q", "")
    if not storable_text(query):
        raise ServiceError(400, "invalid_query", "q must be valid Unicode without NUL characters")
    rows = await _service(request).search(principal(request), query, limit)
    return web.json_response({"results": [
        {"conversation_id": str(r["conversation_id"]), "title": r["title"],
         "message_id": str(r["message_id"]) if r["message_id"] else None, "role": r["role"],
         "content": r["content"], "truncated": r["truncated"],
         "created_at": wire.ts(r["created_at"])} for r in rows]})


async def create_run(request: web.Request) -> web.Response:
    service = _service(request)
    conversation_id = _path_id(request, "conversation")
    body = await json_body(request, max_bytes=max_body_bytes(service.settings))
    req = validate_run_request(body, service.settings)
    key = request.headers.get("Idempotency-Key")
    # Shielded: a client that hangs up mid-request must not cut the transaction in half.
    created = await asyncio.shield(service.create_run(principal(request), conversation_id, req,
                                                      key))
    out: dict[str, Any] = {"run_id": str(created.run_id), "status": str(created.status),
                           "conversation_id": str(created.conversation_id)}
    if created.drafts:
        out["drafts"] = wire.drafts(created.drafts)
    headers = {"Location": f"/v1/runs/{created.run_id}"}
    if created.replayed:
        headers["Idempotent-Replayed"] = "true"
    return web.json_response(out, status=202, headers=headers)


async def get_run(request: web.Request) -> web.Response:
    run = await _service(request).get_run(principal(request), _path_id(request, "run"))
    return web.json_response(wire.run(run))


async def wait_run(request: web.Request) -> web.Response:
    run_id = _path_id(request, "run")
    text = request.query.get("timeout", "30")
    try:
        timeout = float(text)
    except ValueError:
        raise ServiceError(400, "invalid_timeout", "timeout must be a number of seconds") \
            from None
    if not 0 <= timeout <= MAX_WAIT_S:
        raise ServiceError(400, "invalid_timeout", f"timeout must be in [0, {MAX_WAIT_S:g}]")
    who = principal(request)
    # A poll (timeout 0) answers at once: no slot, nothing for a revocation to cut short.
    if timeout == 0:
        return web.json_response(wire.run(await _service(request).wait_run(who, run_id, 0)))
    # A wait lasts minutes, as a stream does: it takes one of the device's stream slots (429
    # over the limit), and a revocation ends it as it ends streams.
    with open_device_stream(request, who):
        waiting = _service(request).wait_run(who, run_id, timeout)
        watch = request.app[RUNTIME].revocations
        try:
            run = await (waiting if watch is None else watch.run_unless_revoked(who.device_id,
                                                                                waiting))
        except Revoked:
            return device_revoked("this device's token was revoked while it waited")
    return web.json_response(wire.run(run))


def _stop_answer(request: web.Request, result: Any) -> web.Response:
    request.app[RUNTIME].metrics.cancels.inc(len(result.cancelled) + len(result.flagged))
    return web.json_response({"cancelled": [str(i) for i in result.cancelled],
                              "flagged": [str(i) for i in result.flagged],
                              "drafts": wire.drafts(result.drafts)}, status=202)


async def cancel_run(request: web.Request) -> web.Response:
    run_id = _path_id(request, "run")
    only = request.query.get("only")
    if only not in (None, "queued"):
        raise ServiceError(400, "invalid_query", "only must be 'queued' (or left out)")
    result = await asyncio.shield(_service(request).cancel_run(
        principal(request), run_id, queued_only=only == "queued"))
    return _stop_answer(request, result)


async def stop_conversation(request: web.Request) -> web.Response:
    conversation_id = _path_id(request, "conversation")
    result = await asyncio.shield(
        _service(request).stop_conversation(principal(request), conversation_id))
    return _stop_answer(request, result)


async def list_approvals(request: web.Request) -> web.Response:
    rows = await _service(request).list_approvals(principal(request), _path_id(request, "run"))
    return web.json_response({"approvals": [wire.approval(row) for row in rows]})


async def decide_approval(request: web.Request) -> web.Response:
    run_id = _path_id(request, "run")
    call_id = request.match_info["call_id"]
    if not 0 < len(call_id) <= MAX_CALL_ID or not storable_text(call_id):
        raise ServiceError(404, "approval_not_found",
                           "this run has no tool approval with that call id")
    decision, note = validate_approval(await json_body(request))
    # Shielded: the decision commits whole even if the client hangs up mid-request.
    decided = await asyncio.shield(_service(request).decide_approval(
        principal(request), run_id, call_id, decision, note))
    return web.json_response({
        "run_id": str(run_id), "call_id": call_id, "decision": str(decided.decision),
        "device": decided.device,
        "device_id": str(decided.device_id) if decided.device_id else None,
        "note": decided.note, "decided_at": wire.ts(decided.decided_at)})


async def run_events(request: web.Request) -> web.StreamResponse:
    service = _service(request)
    run_id = _path_id(request, "run")
    after = _int_query(request, "from", 0, 0, MAX_SEQ)
    last_id = request.headers.get("Last-Event-ID")
    # The header wins: an EventSource reconnects to the URL it opened (?from= and all) with
    # the id it read last, which is the later position.
    if last_id:
        try:
            after = max(0, int(last_id))
        except ValueError:
            raise ServiceError(400, "invalid_last_event_id",
                               "Last-Event-ID must be a seq") from None
        if after > MAX_SEQ:
            raise ServiceError(400, "invalid_last_event_id",
                               f"Last-Event-ID must be in [0, {MAX_SEQ}]")
    await service.get_run(principal(request), run_id)  # 404 before the stream opens
    with open_device_stream(request, principal(request)) as stream:  # 429 over the limit
        response = await sse.open_stream(request, dead_after_s=_dead_after_s(request))

        lag = _DeltaLag(request)

        async def pump() -> None:
            async for event in run_tail(service.pool, service.hub, run_id, after,
                                        keepalive_s=service.settings.keepalive_s,
                                        reads=request.app[RUNTIME].reads):
                if event is None:
                    await sse.keepalive(response)
                else:
                    await sse.send(response, event.seq, str(event.type), wire.event(event))
                    lag.sent(event)

        await stream.serve(response, pump())
    return response


async def conversation_events(request: web.Request) -> web.StreamResponse:
    service = _service(request)
    who = principal(request)
    conversation_id = _path_id(request, "conversation")
    # The header wins, as for a run's stream: it is where a reconnecting EventSource got to.
    cursor_text = request.headers.get("Last-Event-ID") or request.query.get("cursor")

    def cursor_of(query: Mapping[str, str]) -> FeedCursor | None:
        try:
            return _checked_cursor(cursor_text) if cursor_text else None
        except BadCursor as exc:
            raise ServiceError(400, "invalid_cursor", str(exc)) from None

    cursor = await _query_of(request, conversation_id, cursor_of)
    limit = await _query_of(request, conversation_id, page_limit)
    # The slot first (429 over the limit): a device at its limit must not cost a snapshot read
    # at every retry.
    stream = open_device_stream(request, who)
    try:
        start = await service.feed_snapshot(who, conversation_id, limit=limit)
        presence_id = await service.attach(who, conversation_id, PRESENCE_TTL_S)
    except BaseException:
        stream.release()
        raise
    state = start.state
    if cursor is None:
        cursor = FeedCursor(start.watermark or (EPOCH, NIL_UUID),
                            {run.id: 0 for run in state.runs})
    if presence_id is None:
        stream.release()
        raise not_found("conversation")  # deleted since the snapshot was read
    loop = asyncio.get_running_loop()
    renewed = loop.time()

    async def recheck() -> Recheck | None:
        meta = await service.conversation_meta(who, conversation_id)
        if meta is None:
            return None
        return Recheck(wire.conversation_meta(meta), wire.lease(meta.lease),
                       wire.attached(meta.attached))

    async def renew() -> None:
        nonlocal presence_id, renewed
        if loop.time() - renewed >= PRESENCE_TTL_S / 4:
            renewed = loop.time()
            if not await service.renew_presence(presence_id, PRESENCE_TTL_S):
                presence_id = await service.attach(who, conversation_id, PRESENCE_TTL_S)

    try:
        response = await sse.open_stream(request, dead_after_s=_dead_after_s(request))
        snapshot = wire.conversation_state(state)
        lag = _DeltaLag(request)

        async def pump() -> None:
            await sse.send(response, cursor.encode(), "snapshot",
                           {"type": "snapshot", "conversation": snapshot})
            async for item in conversation_feed(
                    service.pool, service.hub, conversation_id, cursor,
                    keepalive_s=service.settings.keepalive_s, recheck=recheck,
                    meta_seen=_snapshot_meta(snapshot), on_idle=renew,
                    reads=request.app[RUNTIME].reads):
                if item.kind == "event":
                    event = item.event
                    assert event is not None  # an "event" item carries its event
                    await sse.send(response, item.cursor, str(event.type),
                                   wire.event(event, str(item.run_id)))
                    lag.sent(event)
                elif item.kind == "run_state":
                    await sse.send(response, item.cursor, "run_state",
                                   {"type": "run_state", **item.data})
                elif item.kind == "lease":
                    await sse.send(response, item.cursor, "lease",
                                   {"type": "lease", "lease": item.data})
                elif item.kind == "presence":
                    await sse.send(response, item.cursor, "presence",
                                   {"type": "presence", "attached": item.data})
                elif item.kind == "conversation":
                    await sse.send(response, item.cursor, "conversation",
                                   {"type": "conversation", **item.data})
                elif item.kind == "deleted":
                    # The feed's last frame: the conversation is gone on every device.
                    await sse.send(response, item.cursor, "deleted",
                                   {"type": "deleted", **item.data})
                else:
                    await sse.keepalive(response)
                if loop.time() - renewed >= PRESENCE_TTL_S / 4:
                    await renew()

        await stream.serve(response, pump())
        return response
    finally:
        stream.release()
        with contextlib.suppress(Exception):
            await asyncio.shield(service.detach(presence_id))


def _snapshot_meta(snapshot: dict[str, Any]) -> dict[str, Any]:
    """The conversation frame a client holding this snapshot already knows."""
    conversation = {key: snapshot[key] for key in ("id", "title", "model", "archived_at")}
    superseded = {m["id"]: m["superseded_by"] for m in snapshot["messages"]
                  if m["superseded_by"]}
    return {"conversation": conversation, "superseded": superseded, "usage": snapshot["usage"]}


def _checked_cursor(text: str) -> FeedCursor:
    """A decoded cursor whose numbers the database can hold (checked before the stream opens)."""
    cursor = FeedCursor.decode(text)
    try:
        cursor.watermark[0].astimezone(UTC)
    except OverflowError:
        raise BadCursor("not a cursor this server issued") from None
    if any(seq > MAX_SEQ for seq in cursor.open.values()):
        raise BadCursor("not a cursor this server issued")
    return cursor


class _DeltaLag:
    """Observes agentd_stream_delta_lag_seconds for the live text deltas one stream sends: from
    the delta's journal write (database clock, through the offset measured at start) to now.
    Deltas written before the stream opened are catch-up, not lag, and are left out."""

    def __init__(self, request: web.Request) -> None:
        runtime = request.app[RUNTIME]
        self._histogram = runtime.metrics.delta_lag
        self._offset_s = runtime.clock_offset_s
        self._opened = time.time() + self._offset_s

    def sent(self, event: Event) -> None:
        if event.type != EventType.CONTENT_DELTA:
            return
        written = event.created_at.timestamp()
        if written >= self._opened:
            self._histogram.observe(max(0.0, time.time() + self._offset_s - written))


def _dead_after_s(request: web.Request) -> float:
    """Two keepalives unanswered, and a margin: a stream's keepalive is what a gone client
    leaves unacknowledged."""
    return 2 * request.app[RUNTIME].settings.keepalive_s + 10
