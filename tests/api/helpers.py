"""What the API tests share: wire-format assertions and demo turns driven over HTTP.

SSE is read with tests/support/sse.py. Every wait is bounded by a deadline; nothing sleeps for
timing.
"""

from __future__ import annotations

import re
from typing import Any
from uuid import UUID

import asyncpg
import httpx

from tests.support.daemon import poll_until

RFC3339_Z = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,9})?Z$")
TERMINAL = ("completed", "failed", "cancelled")
WAIT_S = 60.0
FAST = {"tokens": 3, "delay_ms": 0}
SLOW = {"tokens": 500, "delay_ms": 1000}  # runs for minutes (within max_run_s) unless stopped


def assert_uuid(value: Any, what: str = "id") -> UUID:
    assert isinstance(value, str), f"{what} is not a string: {value!r}"
    parsed = UUID(value)
    assert str(parsed) == value, f"{what} is not a canonical uuid: {value!r}"
    return parsed


def assert_time(value: Any, what: str = "time") -> None:
    assert isinstance(value, str) and RFC3339_Z.match(value), \
        f"{what} is not an RFC 3339 UTC time ending in Z: {value!r}"


def assert_json(response: httpx.Response) -> Any:
    content_type = response.headers.get("content-type", "")
    assert content_type.startswith("application/json"), \
        f"{response.request.method} {response.request.url} answered {response.status_code} " \
        f"with {content_type!r}: {response.text[:300]}"
    return response.json()


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    """The response is `status` with the JSON error envelope (and `code`, when given)."""
    where = f"{response.request.method} {response.request.url}"
    assert response.status_code == status, \
        f"{where}: expected {status}, got {response.status_code}: {_shown(response)}"
    body = assert_json(response)
    assert isinstance(body, dict) and set(body) == {"error"}, f"{where}: {body!r}"
    error = body["error"]
    assert isinstance(error.get("code"), str) and error["code"], f"{where}: {body!r}"
    assert isinstance(error.get("message"), str) and error["message"], f"{where}: {body!r}"
    if code is not None:
        assert error["code"] == code, f"{where}: expected code {code!r}, got {body!r}"
    return error


def _shown(response: httpx.Response) -> str:
    try:
        return response.text[:500]
    except httpx.ResponseNotRead:
        return f"<unread {response.headers.get('content-type')} stream>"


def assert_run(run: dict[str, Any]) -> None:
    """The documented run row: ids, `<thing>_id` references, RFC 3339 Z times."""
    for key in ("id", "conversation_id", "status", "cancel_requested", "worker_id", "error",
                "usage", "created_at", "started_at", "finished_at"):
        assert key in run, f"run lacks {key!r}: {run!r}"
    assert_uuid(run["id"], "run.id")
    assert_uuid(run["conversation_id"], "run.conversation_id")
    assert_uuid(run["user_message_id"], "run.user_message_id")
    assert run["status"] in ("queued", "running", *TERMINAL), run
    assert isinstance(run["cancel_requested"], bool), run
    assert_time(run["created_at"], "run.created_at")
    for key in ("started_at", "finished_at", "lease_expires_at"):
        if run.get(key) is not None:
            assert_time(run[key], f"run.{key}")


def assert_message(message: dict[str, Any]) -> None:
    assert {"id", "role", "content", "status", "run_id", "created_at"} <= set(message), message
    assert_uuid(message["id"], "message.id")
    if message["run_id"] is not None:
        assert_uuid(message["run_id"], "message.run_id")
    assert message["role"] in ("user", "assistant", "tool", "system"), message
    assert isinstance(message["content"], str), message
    assert_time(message["created_at"], "message.created_at")


async def start_run(client: httpx.AsyncClient, conversation_id: str, content: str,
                    params: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    body = {"content": content, "params": FAST if params is None else params, **fields}
    response = await client.post(f"/v1/conversations/{conversation_id}/runs", json=body)
    assert response.status_code == 202, response.text
    return response.json()


async def wait_run(client: httpx.AsyncClient, run_id: str,
                   statuses: tuple[str, ...] = TERMINAL,
                   within_s: float = WAIT_S) -> dict[str, Any]:
    """Poll GET /v1/runs/{id} until its status is one of `statuses`."""

    async def reached() -> dict[str, Any] | None:
        response = await client.get(f"/v1/runs/{run_id}")
        assert response.status_code == 200, response.text
        run = response.json()
        return run if run["status"] in statuses else None

    return await poll_until(reached, within_s, interval=0.05,
                            what=f"run {run_id} to reach {'/'.join(statuses)}")


async def db_state(pool: asyncpg.Pool) -> dict[str, Any]:
    """Everything a request could change, minus what a running turn changes on its own."""
    return {
        "conversations": sorted(map(tuple, await pool.fetch(
            "SELECT id, account_id, title, model, archived_at, updated_at FROM conversation"))),
        "runs": sorted(map(tuple, await pool.fetch(
            "SELECT id, conversation_id, status, cancel_requested, idempotency_key"
            " FROM agent_run"))),
        "messages": sorted(map(tuple, await pool.fetch(
            "SELECT id, run_id, role, status, content, superseded_by FROM message"))),
        "presence": await pool.fetchval("SELECT count(*) FROM presence"),
        "devices": sorted(map(tuple, await pool.fetch("SELECT id, revoked_at FROM device"))),
        "pairings": sorted(map(tuple, await pool.fetch("SELECT code_hash, used_at FROM pairing"))),
        "notes": await pool.fetchval("SELECT count(*) FROM conversation_note"),
    }


async def fetch(client: httpx.AsyncClient, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """One request; an event stream's body is left unread (it may never end), others are read."""
    async with client.stream(method, path, **kwargs) as response:
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            await response.aread()
    return response
