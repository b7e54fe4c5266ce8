"""What stream tests share: turns posted and awaited through the API.

Devices come from tests/support/factories.py and the SSE readers (`Follower`, `read_until_cut`)
from tests/support/sse.py. Everything is observed over HTTP or through the test's own database
connections.
"""

from __future__ import annotations

from typing import Any

import httpx

from agentd.vocabulary import RunStatus
from tests.support.daemon import poll_until

TERMINAL = {str(s) for s in RunStatus if s.terminal}


def run_body(content: str, *, tokens: int, delay_ms: int = 0,
             on_busy: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"content": content, "model": "demo",
                            "params": {"tokens": tokens, "delay_ms": delay_ms}}
    if on_busy is not None:
        body["on_busy"] = on_busy
    return body


async def post_run(client: httpx.AsyncClient, conversation_id: str, content: str, *,
                   tokens: int, delay_ms: int = 0, on_busy: str | None = None) -> dict[str, Any]:
    """POST a demo turn; asserts the 202 and returns its body."""
    response = await client.post(f"/v1/conversations/{conversation_id}/runs",
                                 json=run_body(content, tokens=tokens, delay_ms=delay_ms,
                                               on_busy=on_busy))
    assert response.status_code == 202, response.text
    body = response.json()
    assert response.headers["Location"] == f"/v1/runs/{body['run_id']}"
    return body


async def get_run(client: httpx.AsyncClient, run_id: str) -> dict[str, Any]:
    response = await client.get(f"/v1/runs/{run_id}")
    assert response.status_code == 200, response.text
    return response.json()


async def wait_terminal(client: httpx.AsyncClient, run_id: str, within: float) -> dict[str, Any]:
    """The run row once terminal, through the API's own NOTIFY-driven `wait`."""

    async def finished() -> dict[str, Any] | None:
        response = await client.get(f"/v1/runs/{run_id}/wait", params={"timeout": 5})
        assert response.status_code == 200, response.text
        run = response.json()
        return run if run["status"] in TERMINAL else None

    return await poll_until(finished, within, interval=0, what=f"run {run_id} to end")


async def wait_status(client: httpx.AsyncClient, run_id: str, status: str,
                      within: float) -> dict[str, Any]:
    async def reached() -> dict[str, Any] | None:
        run = await get_run(client, run_id)
        return run if run["status"] == status else None

    return await poll_until(reached, within, what=f"run {run_id} to be {status}")


async def get_conversation(client: httpx.AsyncClient, conversation_id: str) -> dict[str, Any]:
    response = await client.get(f"/v1/conversations/{conversation_id}")
    assert response.status_code == 200, response.text
    return response.json()
