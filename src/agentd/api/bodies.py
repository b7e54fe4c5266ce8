"""Request bodies, checked before any handler logic: strict JSON, storable text, the run,
conversation and approval bodies. Bad input is a 4xx ServiceError with a stable code, never a 500.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal
from uuid import UUID

from aiohttp import web

from agentd.api import RUNTIME
from agentd.providers.params import MAX_SYSTEM_CHARS
from agentd.service import (
    LAST,
    ConversationChange,
    MessagePaging,
    RunAsk,
    ServiceError,
    validate_model,
)
from agentd.settings import Settings
from agentd.vocabulary import ApprovalDecision

ON_BUSY = ("enqueue", "reject", "interrupt")
RUN_FIELDS = {"content", "model", "params", "on_busy", "retry_of"}
CONVERSATION_FIELDS = {"title", "model"}
UPDATE_FIELDS = {"title", "model", "archived"}
MAX_TITLE = 500
MAX_NOTE = 2000
MAX_CALL_ID = 200
PAGE_LIMIT = 100  # messages per transcript page unless asked otherwise
MAX_PAGE_LIMIT = 1000
PAGING_FIELDS = {"before", "limit", "until"}
# Deeper JSON serves no request, and Python's recursive encoders (the request hash, jsonb)
# fail on what its decoder still accepts: refused at the door, with a code of its own.
MAX_JSON_DEPTH = 64


# Every request body but a turn's post (max_body_bytes): a title, a decision, a code.
MAX_BODY_BYTES = 1 << 20


def max_body_bytes(settings: Settings) -> int:
    """The largest body of a turn's post, and so the app's cap: 1 MiB, or room for its
    content and system prompt at their limits however its JSON spells them (`\\uXXXX\\uXXXX`,
    twelve bytes, for a character outside the BMP) and its other fields, whichever is more. A
    fixed 1 MiB refused posts within max_content_chars with a bare 413."""
    return max(MAX_BODY_BYTES,
               12 * (settings.max_content_chars + MAX_SYSTEM_CHARS) + (64 << 10))


async def json_body(request: web.Request, *, optional: bool = False,
                    max_bytes: int = MAX_BODY_BYTES) -> Any:
    """The request's JSON, strictly: no NaN/Infinity, finite numbers, storable strings; at
    most `max_bytes` of it (the app's own cap is a turn's, the largest)."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise _too_large()  # refused before a byte of it is read
    try:
        # A body trickled in byte by byte must not hold a connection for ever.
        async with asyncio.timeout(request.app[RUNTIME].settings.body_timeout_s):
            raw = await _read_at_most(request, max_bytes)
    except TimeoutError:
        raise ServiceError(408, "body_timeout", "the request body did not arrive in time") \
            from None
    if not raw.strip():
        if optional:
            return {}
        raise ServiceError(400, "invalid_body", "a JSON body is required")
    try:
        body = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise _too_deep() from None
    except (ValueError, UnicodeDecodeError):
        raise ServiceError(400, "invalid_json", "the body is not valid JSON") from None
    too_deep, storable = _walk(body)
    if too_deep:
        raise _too_deep()
    if not storable:
        raise ServiceError(400, "invalid_json", "the body's strings must be valid Unicode "
                           "without NUL characters")
    return body


async def _read_at_most(request: web.Request, max_bytes: int) -> bytes:
    """The body, refused (413) once it passes `max_bytes`: a chunked one, whose length is not
    said first, is read no further than that, not up to the app's cap (a turn's)."""
    raw = bytearray()
    async for chunk in request.content.iter_chunked(1 << 16):
        raw += chunk
        if len(raw) > max_bytes:
            raise _too_large()
    return bytes(raw)


def _too_large() -> ServiceError:
    return ServiceError(413, "payload_too_large", "request body is too large")


def _too_deep() -> ServiceError:
    return ServiceError(400, "json_too_deep", f"the body nests arrays and objects more than "
                        f"{MAX_JSON_DEPTH} levels deep")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value


def _walk(body: Any) -> tuple[bool, bool]:
    """One walk of a parsed body, without recursion: (it nests arrays and objects more than
    MAX_JSON_DEPTH levels, every string and key is storable). PostgreSQL text and jsonb hold
    neither NUL nor unpaired surrogates."""
    storable = True
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            storable = storable and storable_text(item)
            continue
        if isinstance(item, dict):
            storable = storable and all(storable_text(key) for key in item)
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            return True, storable  # one level past the bound is enough to refuse it
        stack.extend((child, depth + 1) for child in children)
    return False, storable


def storable_text(text: str) -> bool:
    """Whether PostgreSQL can store the text as it is (no NUL, no unpaired surrogate)."""
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def validate_run_request(body: Any, settings: Settings) -> RunAsk:
    if not isinstance(body, dict):
        raise ServiceError(400, "invalid_body", "the body must be a JSON object")
    unknown = set(body) - RUN_FIELDS
    if unknown:
        raise ServiceError(400, "unknown_field", f"unknown fields: {', '.join(sorted(unknown))}")
    retry_of = _retry_of(body.get("retry_of"))
    content = body.get("content")
    if content is not None or retry_of is None:
        if not isinstance(content, str) or not content.strip():
            raise ServiceError(400, "invalid_content", "content must be a non-empty string")
        if len(content) > settings.max_content_chars:
            raise ServiceError(413, "content_too_large",
                               f"content is longer than {settings.max_content_chars} characters")
        if "\x00" in content:
            raise ServiceError(400, "invalid_content", "content must not contain NUL characters")
    model = validate_model(body["model"], settings) if body.get("model") is not None else None
    params = body.get("params")
    if params is not None and not isinstance(params, dict):
        raise ServiceError(400, "invalid_params", "params must be a JSON object")
    on_busy = body.get("on_busy", "enqueue")
    if on_busy not in ON_BUSY:
        raise ServiceError(400, "invalid_on_busy", f"on_busy must be one of {', '.join(ON_BUSY)}")
    return RunAsk(content, model, params, on_busy, retry_of)


def _retry_of(value: Any) -> UUID | Literal["last"] | None:
    if value is None:
        return None
    if value == LAST:
        return "last"
    try:
        return UUID(value)
    except (ValueError, AttributeError, TypeError):
        raise ServiceError(400, "invalid_retry_of", 'retry_of must be a message id or "last"') \
            from None


def validate_conversation(body: Any, settings: Settings, *,
                          create: bool) -> ConversationChange:
    """POST /v1/conversations `{title?, model?}` or PATCH `{title?, model?, archived?}`."""
    allowed = CONVERSATION_FIELDS if create else UPDATE_FIELDS
    if not isinstance(body, dict) or set(body) - allowed or (not create and not body):
        fields = ", ".join(f"{name}?" for name in sorted(allowed))
        raise ServiceError(400, "invalid_body", f"the body must be an object {{{fields}}}")
    title = body.get("title", "" if create else None)
    if title is not None or "title" in body:
        if not isinstance(title, str) or len(title) > MAX_TITLE or "\x00" in title:
            raise ServiceError(400, "invalid_title", f"title must be a string of at most "
                               f"{MAX_TITLE} characters")
        title = title.strip()
    archived = body.get("archived")
    if archived is not None and not isinstance(archived, bool):
        raise ServiceError(400, "invalid_archived", "archived must be true or false")
    model = validate_model(body["model"], settings) if body.get("model") is not None else None
    return ConversationChange(title, "model" in body, model, archived)


def validate_fork(body: Any) -> UUID:
    """{"message_id": "..."}: the message a fork copies the transcript up to."""
    if not isinstance(body, dict) or set(body) != {"message_id"}:
        raise ServiceError(400, "invalid_body", 'the body must be {"message_id": "..."}')
    try:
        return UUID(body["message_id"])
    except (ValueError, AttributeError, TypeError):
        raise ServiceError(400, "invalid_message_id", "message_id must be a message id") \
            from None


def validate_approval(body: Any) -> tuple[ApprovalDecision, str | None]:
    """{"decision": "approve" | "deny", "note"?: "..."} for deciding a tool approval."""
    if not isinstance(body, dict):
        raise ServiceError(400, "invalid_body", "the body must be a JSON object")
    unknown = set(body) - {"decision", "note"}
    if unknown:
        raise ServiceError(400, "unknown_field", f"unknown fields: {', '.join(sorted(unknown))}")
    try:
        decision = ApprovalDecision(str(body.get("decision")))
    except ValueError:
        raise ServiceError(422, "invalid_decision",
                           'decision must be "approve" or "deny"') from None
    note = body.get("note")
    if note is not None and (not isinstance(note, str) or len(note) > MAX_NOTE):
        raise ServiceError(422, "invalid_note",
                           f"note must be a string of at most {MAX_NOTE} characters")
    note = note.strip() if note else None
    return decision, note or None


def validate_paging(query: Mapping[str, str]) -> MessagePaging:
    """`GET …/messages?before=<message id>&limit=N&until=<message id>`: all optional."""
    unknown = set(query) - PAGING_FIELDS
    if unknown:
        raise ServiceError(400, "unknown_parameter",
                           f"unknown query parameters: {', '.join(sorted(unknown))}")
    limit = page_limit(query)
    return MessagePaging(_message_cursor(query, "before"),
                         PAGE_LIMIT if limit is None else limit,
                         _message_cursor(query, "until"))


def list_cursor(mark: tuple[datetime, UUID]) -> str:
    """The conversation list's `next`: opaque to clients, its values to us."""
    text = f"{mark[0].isoformat()}|{mark[1]}"
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def list_after(query: Mapping[str, str]) -> tuple[datetime, UUID] | None:
    """`GET /v1/conversations?after=<a page's next>`: where the page starts (None: the top)."""
    text = query.get("after")
    if text is None:
        return None
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
        stamp, _, ident = raw.partition("|")
        moment = datetime.fromisoformat(stamp)
        if moment.tzinfo is None:
            raise ValueError("no zone")
        # In UTC, as the database compares it (and a moment past year 9999 there is none).
        return moment.astimezone(UTC), UUID(ident)
    except (ValueError, OverflowError):  # binascii.Error and UnicodeDecodeError are too
        raise ServiceError(400, "invalid_after",
                           "after must be the `next` of a page of this list") from None


def page_limit(query: Mapping[str, str]) -> int | None:
    """The `limit` of a transcript page (None: not given), 1..MAX_PAGE_LIMIT."""
    text = query.get("limit")
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_PAGE_LIMIT:
        raise ServiceError(400, "invalid_limit",
                           f"limit must be an integer in [1, {MAX_PAGE_LIMIT}]")
    return value


def _message_cursor(query: Mapping[str, str], name: str) -> UUID | None:
    text = query.get(name)
    if text is None:
        return None
    try:
        return UUID(text)
    except ValueError:
        raise ServiceError(400, f"invalid_{name}",
                           f"{name} must be a message id (a cursor from a page)") from None
