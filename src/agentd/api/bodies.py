"""Request bodies, checked before any handler logic: strict JSON, storable text, and the run
and title bodies. Bad input is a 4xx ServiceError with a stable code, never a 500.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from aiohttp import web

from agentd.api import RUNTIME
from agentd.providers import parse_model, validate_params
from agentd.providers.base import UnknownModel
from agentd.service import RunRequest, ServiceError
from agentd.settings import Settings
from agentd.vocabulary import ApprovalDecision

ON_BUSY = ("enqueue", "reject", "interrupt")
RUN_FIELDS = {"content", "model", "params", "on_busy"}
MAX_TITLE = 500
MAX_NOTE = 2000
MAX_CALL_ID = 200


async def json_body(request: web.Request, *, optional: bool = False) -> Any:
    """The request's JSON, strictly: no NaN/Infinity, finite numbers, storable strings."""
    try:
        # A body trickled in byte by byte must not hold a connection for ever.
        async with asyncio.timeout(request.app[RUNTIME].settings.body_timeout_s):
            raw = await request.read()
    except TimeoutError:
        raise ServiceError(408, "body_timeout", "the request body did not arrive in time") \
            from None
    if not raw.strip():
        if optional:
            return {}
        raise ServiceError(400, "invalid_body", "a JSON body is required")
    try:
        body = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ServiceError(400, "invalid_json", "the body is not valid JSON") from None
    if not _storable(body):
        raise ServiceError(400, "invalid_json", "the body's strings must be valid Unicode "
                           "without NUL characters")
    return body


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value


def _storable(value: Any) -> bool:
    """PostgreSQL text and jsonb hold neither NUL nor unpaired surrogates: refuse them here."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not storable_text(item):
                return False
        elif isinstance(item, dict):
            if not all(storable_text(key) for key in item):
                return False
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True


def storable_text(text: str) -> bool:
    """Whether PostgreSQL can store the text as it is (no NUL, no unpaired surrogate)."""
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def validate_run_request(body: Any, settings: Settings) -> RunRequest:
    """POST /v1/conversations/{id}/runs: content, model, params (checked against the provider;
    the service checks that a tool they name exists), on_busy."""
    if not isinstance(body, dict):
        raise ServiceError(400, "invalid_body", "the body must be a JSON object")
    unknown = set(body) - RUN_FIELDS
    if unknown:
        raise ServiceError(400, "unknown_field", f"unknown fields: {', '.join(sorted(unknown))}")
    content = body.get("content")
    if not isinstance(content, str) or not content.strip():
        raise ServiceError(400, "invalid_content", "content must be a non-empty string")
    if len(content) > settings.max_content_chars:
        raise ServiceError(413, "content_too_large",
                           f"content is longer than {settings.max_content_chars} characters")
    if "\x00" in content:
        raise ServiceError(400, "invalid_content", "content must not contain NUL characters")
    model_name = body.get("model")
    if model_name is not None and (not isinstance(model_name, str) or len(model_name) > 200):
        raise ServiceError(400, "invalid_model", "model must be a string like provider:model")
    try:
        model = parse_model(model_name, settings)
    except UnknownModel as exc:
        raise ServiceError(400, "unknown_model", str(exc)) from None
    params = body.get("params", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ServiceError(400, "invalid_params", "params must be a JSON object")
    try:
        validate_params(settings.providers[model.provider], params,
                        max_run_s=settings.max_run_s)
    except ValueError as exc:
        raise ServiceError(422, "invalid_params", str(exc)) from None
    on_busy = body.get("on_busy", "enqueue")
    if on_busy not in ON_BUSY:
        raise ServiceError(400, "invalid_on_busy", f"on_busy must be one of {', '.join(ON_BUSY)}")
    return RunRequest(content, model, params, on_busy)


def validate_title(body: Any) -> str:
    """{"title": "..."} for creating and renaming a conversation."""
    if not isinstance(body, dict) or set(body) - {"title"}:
        raise ServiceError(400, "invalid_body", 'the body must be {"title": "..."}')
    title = body.get("title", "")
    if not isinstance(title, str) or len(title) > MAX_TITLE or "\x00" in title:
        raise ServiceError(400, "invalid_title", f"title must be a string of at most "
                           f"{MAX_TITLE} characters")
    return title.strip()


def validate_approval(body: Any) -> tuple[ApprovalDecision, str | None]:
    """{"decision": "approve" | "deny", "note"?: "..."} for deciding a tool approval."""
    if not isinstance(body, dict):
        raise ServiceError(400, "invalid_body", "the body must be a JSON object")
    unknown = set(body) - {"decision", "note"}
    if unknown:
        raise ServiceError(400, "unknown_field", f"unknown fields: {', '.join(sorted(unknown))}")
    try:
        decision = ApprovalDecision(body.get("decision"))
    except ValueError:
        raise ServiceError(422, "invalid_decision",
                           'decision must be "approve" or "deny"') from None
    note = body.get("note")
    if note is not None and (not isinstance(note, str) or len(note) > MAX_NOTE):
        raise ServiceError(422, "invalid_note",
                           f"note must be a string of at most {MAX_NOTE} characters")
    note = note.strip() if note else None
    return decision, note or None
