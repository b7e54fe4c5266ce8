"""Real `agentd serve` daemons configured with AGENTD_OPENAI_BASE_URL pointing at a fake server.

Driven over the HTTP API like any client: enqueue validation, a whole `openai:fake` turn with a
tool step and its usage on GET /v1/runs/{id}, and a stop that closes the upstream connection.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import httpx

from tests.process.helpers import wait_streaming
from tests.providers.fake_servers import (
    FakeServer,
    endless,
    openai_chunk,
    openai_text,
    openai_tool_calls,
    sse,
)
from tests.support.daemon import Daemon
from tests.support.factories import create_conversation, new_device

READY_TIMEOUT_S = 60.0
HTTP_TIMEOUT_S = 30.0
SECRET = "sk-never-stored-7f3a9c"


def daemon_env(fake: FakeServer) -> dict[str, str]:
    return {"AGENTD_OPENAI_BASE_URL": fake.base_url + "/v1", "AGENTD_OPENAI_MODELS": "fake",
            "AGENTD_OPENAI_API_KEY_ENV": "FAKE_PROVIDER_KEY", "FAKE_PROVIDER_KEY": SECRET,
            "AGENTD_OPENAI_TIMEOUT_S": "20", "AGENTD_HEARTBEAT_S": "1",
            "AGENTD_LEASE_TTL_S": "10"}


@asynccontextmanager
async def api_client(spawn_daemon: Any, pool: asyncpg.Pool,
                     fake: FakeServer) -> AsyncIterator[tuple[Daemon, httpx.AsyncClient, str]]:
    """A ready daemon, a client of account alice, and a fresh conversation id."""
    daemon = spawn_daemon(env=daemon_env(fake))
    await daemon.wait_ready(timeout=READY_TIMEOUT_S)
    laptop = await new_device(pool, "alice", "laptop")
    async with laptop.client(daemon, timeout=HTTP_TIMEOUT_S) as client:
        yield daemon, client, await create_conversation(client, "providers")


async def test_enqueue_rejects_unknown_providers_and_bad_params_at_once(
        spawn_daemon: Any, pool: asyncpg.Pool, fake: FakeServer) -> None:
    async with api_client(spawn_daemon, pool, fake) as (_, client, conversation):
        runs = f"/v1/conversations/{conversation}/runs"
        unknown = await client.post(runs, json={"content": "hi", "model": "nope:thing"})
        assert unknown.status_code == 422, unknown.text
        assert unknown.json()["error"]["code"] == "unknown_model"
        bare = await client.post(runs, json={"content": "hi", "model": "openai"})
        assert bare.status_code == 422, bare.text
        offered = await client.post(runs, json={"content": "hi", "model": "openai:gpt-4o"})
        assert offered.status_code == 422, offered.text  # not in AGENTD_OPENAI_MODELS here
        bad = await client.post(runs, json={"content": "hi", "model": "openai:fake",
                                            "params": {"tokens": 5}})
        assert bad.status_code == 422, bad.text
        assert "unknown params for a openai model" in bad.json()["error"]["message"]
        hot = await client.post(runs, json={"content": "hi", "model": "openai:fake",
                                            "params": {"temperature": 9}})
        assert hot.status_code == 422, hot.text
        state = (await client.get(f"/v1/conversations/{conversation}")).json()
        assert state["runs"] == [] and state["messages"] == []
    assert fake.received == []


async def test_openai_turn_through_a_daemon_streams_calls_a_tool_and_shows_usage(
        spawn_daemon: Any, pool: asyncpg.Pool, fake: FakeServer) -> None:
    fake.script(sse(openai_tool_calls([("call_d1", "calculator",
                                        ['{"expression": ', '"6 * 7"', "}"])], usage=(40, 12))),
                sse(openai_text("Six times seven ", "is 42.", usage=(70, 7)), delay_s=0.01))
    async with api_client(spawn_daemon, pool, fake) as (_, client, conversation):
        created = await client.post(f"/v1/conversations/{conversation}/runs",
                                    json={"content": "what is 6*7?", "model": "openai:fake",
                                          "params": {"temperature": 0, "system": "Be exact."}})
        assert created.status_code == 202, created.text
        run_id = created.json()["run_id"]
        waited = await client.get(f"/v1/runs/{run_id}/wait", params={"timeout": 25})
        assert waited.json()["status"] == "completed", waited.text
        run = (await client.get(f"/v1/runs/{run_id}")).json()
        assert run["usage"] == {"input_tokens": 110, "output_tokens": 19}
        assert run["error"] is None
        state = (await client.get(f"/v1/conversations/{conversation}")).json()
        assert state["messages"][-1]["content"] == "Six times seven is 42."

    first, second = fake.received
    assert first.body["model"] == "fake" and first.body["temperature"] == 0
    assert first.body["messages"][0] == {"role": "system", "content": "Be exact."}
    assert {t["function"]["name"] for t in first.body["tools"]} == {
        "clock", "calculator", "notes"}
    assert second.body["messages"][-1]["tool_call_id"] == "call_d1"
    # The key came from the environment variable the config names, and is stored nowhere.
    assert first.headers["Authorization"] == f"Bearer {SECRET}"
    everything = await pool.fetchval(
        "SELECT string_agg(t, ' ') FROM (SELECT request::text AS t FROM agent_run"
        " UNION ALL SELECT payload::text FROM run_event UNION ALL SELECT content FROM message"
        " UNION ALL SELECT coalesce(error, '') FROM agent_run) AS rows")
    assert "6 * 7" in everything and SECRET not in everything


async def test_stop_during_a_provider_stream_closes_the_upstream_connection(
        spawn_daemon: Any, pool: asyncpg.Pool, fake: FakeServer) -> None:
    fake.script(endless(lambda i: openai_chunk({"content": f" tok{i}"}), interval_s=0.05))
    async with api_client(spawn_daemon, pool, fake) as (daemon, client, conversation):
        created = await client.post(f"/v1/conversations/{conversation}/runs",
                                    json={"content": "talk forever", "model": "openai:fake"})
        run_id = created.json()["run_id"]
        await wait_streaming(pool, run_id, timeout=30, min_deltas=3)
        assert not fake.client_gone.is_set()

        cancel = await client.post(f"/v1/runs/{run_id}/cancel")
        assert cancel.status_code == 202, cancel.text
        await fake.wait_client_gone(within=15)
        sent_when_closed = fake.events_sent

        waited = await client.get(f"/v1/runs/{run_id}/wait", params={"timeout": 25})
        assert waited.json()["status"] == "cancelled", waited.text
        answer = await pool.fetchrow("SELECT content, status FROM message WHERE run_id = $1"
                                     " AND role = 'assistant'", run_id)
        assert answer["status"] == "partial" and answer["content"].startswith(" tok0 tok1")
    assert fake.events_sent == sent_when_closed, "the server kept streaming after the stop"
    assert len(fake.received) == 1
    assert daemon.running
