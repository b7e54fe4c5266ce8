"""Input refused before any handler reads it is answered like every other error: JSON with a
stable code, nothing of the parser's own words. Request heads aiohttp's parser refuses (over its
limits, or not HTTP at all) are sent over a raw socket; bodies nested past MAX_JSON_DEPTH are
refused before anything walks them recursively.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import urlsplit

import pytest

from agentd.api.bodies import MAX_JSON_DEPTH
from tests.api.conftest import Api
from tests.api.helpers import assert_error, db_state
from tests.support.factories import create_conversation

READ_S = 15.0
PARSER_WORDS = ("Got more than", "bytes when reading", "Invalid", "Bad status line",
                "Traceback", "aiohttp", "llhttp")


async def raw_exchange(api: Api, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send `request` as it is; the status, headers (lower-cased names) and body of the answer,
    read until the server closes the connection (it must: the framing is lost)."""
    where = urlsplit(api.url)
    assert where.hostname is not None and where.port is not None
    reader, writer = await asyncio.open_connection(where.hostname, where.port)
    try:
        writer.write(request)
        await writer.drain()
        received = b""
        async with asyncio.timeout(READ_S):
            while chunk := await reader.read(65536):
                received += chunk
    finally:
        writer.close()
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, body


def assert_json_error(status: int, headers: dict[str, str], body: bytes, expected: int,
                      code: str) -> dict[str, Any]:
    assert status == expected, (status, headers, body[:500])
    assert headers.get("content-type", "").startswith("application/json"), (headers, body[:500])
    parsed = json.loads(body)
    assert set(parsed) == {"error"} and parsed["error"]["code"] == code, parsed
    message = parsed["error"]["message"]
    assert isinstance(message, str) and message, parsed
    for words in PARSER_WORDS:
        assert words not in body.decode("utf-8", "replace"), parsed
    return parsed["error"]


@pytest.mark.parametrize("where", ["header", "request line"])
async def test_a_request_head_over_the_limit_is_a_json_431(api: Api, where: str) -> None:
    if where == "header":
        request = (b"GET /v1/me HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 9000 +
                   b"\r\n\r\n")
    else:
        request = b"GET /v1/" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    status, headers, body = await raw_exchange(api, request)
    error = assert_json_error(status, headers, body, 431, "request_head_too_large")
    assert "8190" in error["message"]
    assert b"aaaaaaaa" not in body  # the refused bytes are not echoed back
    # Only that connection ended: the daemon serves on.
    response = await api.a.get("/v1/me")
    assert response.status_code == 200 and response.json()["account"] == "alice"


@pytest.mark.parametrize(("request_bytes", "warned"), [
    # What TLS or a scanner sends to an HTTP port: no warning each time (debug, as aiohttp).
    (b"NOT HTTP AT ALL\r\n\r\n", False),
    (b"GET /v1/me HTTP/1.1\r\nHost: x\r\nthis line is no header\r\n\r\n", True),
    (b"GET /v1/me HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n", True),
], ids=["request line", "header", "content length"])
async def test_a_request_head_that_is_not_http_is_a_json_400(api: Api, request_bytes: bytes,
                                                            warned: bool) -> None:
    status, headers, body = await raw_exchange(api, request_bytes)
    error = assert_json_error(status, headers, body, 400, "bad_request")
    assert error["message"] == "the request is not valid HTTP"
    # The daemon's log says so in one line, without a traceback per malformed request.
    if warned:
        await api.daemon.wait_for_log("refused a request that is not valid HTTP", 10)
    response = await api.a.get("/v1/me")  # handled after the refusal: its log is written
    assert response.status_code == 200
    assert "Traceback" not in api.daemon.log_text()


def nested(levels: int, leaf: Any = 1) -> Any:
    """`leaf` inside `levels` arrays."""
    value = leaf
    for _ in range(levels):
        value = [value]
    return value


def nested_body(levels: int, *, inside: str) -> bytes:
    """A JSON body whose value at `inside` nests `levels` arrays, built as text (json.dumps
    itself cannot write the deepest ones)."""
    deep = "[" * levels + "1" + "]" * levels
    return inside.replace("DEEP", deep).encode()


async def test_a_body_nested_one_level_past_the_bound_is_refused_with_its_own_code(
        api: Api) -> None:
    # The object itself is a level: a title nested MAX_JSON_DEPTH - 1 deep is at the bound.
    at_bound = await api.a.post("/v1/conversations",
                                json={"title": nested(MAX_JSON_DEPTH - 1)})
    assert_error(at_bound, 400, "invalid_title")
    before = await db_state(api.pool)
    past = await api.a.post("/v1/conversations", json={"title": nested(MAX_JSON_DEPTH)})
    error = assert_error(past, 400, "json_too_deep")
    assert str(MAX_JSON_DEPTH) in error["message"]
    assert await db_state(api.pool) == before


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH + 1, 900, 990, 5000])
async def test_deep_tool_args_are_a_400_and_write_nothing(api: Api, levels: int) -> None:
    """Deep enough for the decoder but not for the request hash's encoder was a 500; deeper
    than the decoder goes was `invalid_json`, as if the text were not JSON."""
    conversation = await create_conversation(api.a)
    before = await db_state(api.pool)
    body = nested_body(levels, inside='{"content": "deep", "params": {"tool": "calculator", '
                                      '"tool_args": {"expression": DEEP}}}')
    response = await api.a.post(f"/v1/conversations/{conversation}/runs", content=body,
                                headers={"Content-Type": "application/json"})
    assert_error(response, 400, "json_too_deep")
    assert await db_state(api.pool) == before
