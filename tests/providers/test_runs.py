"""Whole turns through the executor against fake provider servers and a real PostgreSQL.

The worker runs in this process (a real hub, pool and TurnRunner); the providers are configured
the way a daemon would be, through AGENTD_* variables, and talk HTTP to the fake servers.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from uuid import UUID

import asyncpg
import pytest

from agentd.executor import TurnRunner
from agentd.failures import CLIENT_MESSAGES
from agentd.heartbeat import LeaseKeeper
from agentd.hub import Hub
from agentd.metrics import Metrics
from agentd.providers import ProviderRegistry, http_stream
from agentd.queue import WorkerReport, claim_runs, reap_expired
from agentd.settings import Settings, load_settings
from agentd.tools import Tool, ToolRegistry, default_tools
from agentd.vocabulary import EventType, RunErrorCode, RunStatus
from tests.process.helpers import wait_streaming
from tests.providers.fake_servers import (
    FakeServer,
    anthropic_message,
    endless,
    hang,
    openai_chunk,
    openai_text,
    openai_tool_calls,
    sse,
    status,
)
from tests.support.factories import enqueue, new_tenant
from tests.support.journal import assert_journal_sound

WORKER = "provider-test-worker"


def settings_for(tmp_path: Path, env: Mapping[str, str]) -> Settings:
    config = tmp_path / "agentd.toml"
    config.write_text("")
    return load_settings(config, env={"AGENTD_HEARTBEAT_S": "1", "AGENTD_FLUSH_MS": "20",
                                      **env})


@asynccontextmanager
async def worker(dsn: str, pool: asyncpg.Pool, settings: Settings,
                 tools: ToolRegistry | None = None) -> AsyncIterator[TurnRunner]:
    hub = Hub(dsn)
    await hub.start()
    providers = ProviderRegistry(settings)
    keeper = LeaseKeeper(dsn, hub, settings, Metrics(),
                         report=lambda: WorkerReport(WORKER, "provider-test", 0))
    keeper.start()
    try:
        yield TurnRunner(pool, hub, keeper, settings, providers, tools or default_tools())
    finally:
        await keeper.close()
        await providers.close()
        await hub.close()


async def run_turn(dsn: str, pool: asyncpg.Pool, settings: Settings, model: str,
                   content: str = "what is 6*7?", params: dict[str, Any] | None = None
                   ) -> tuple[asyncpg.Record, list[asyncpg.Record]]:
    """Enqueue one turn, claim it, run it to its end; (run row, journal)."""
    tenant = await new_tenant(pool)
    run = await enqueue(pool, tenant.account_id, tenant.conversation_id, content,
                        request={"content": content, "model": model, "params": params or {}})
    [claim] = await claim_runs(pool, worker_id=WORKER, lease_ttl_s=settings.lease_ttl_s)
    assert claim.run_id == run.run_id
    async with worker(dsn, pool, settings) as runner:
        assert await runner.run(claim)
    row = await pool.fetchrow("SELECT * FROM agent_run WHERE id = $1", run.run_id)
    return row, await assert_journal_sound(pool, run.run_id)


def of_type(rows: list[asyncpg.Record], kind: EventType) -> list[dict[str, Any]]:
    return [r["payload"] for r in rows if r["type"] == kind]


async def answer(pool: asyncpg.Pool, run_id: UUID) -> list[tuple[str, str, str]]:
    rows = await pool.fetch("SELECT role, content, status FROM message WHERE run_id = $1"
                            " ORDER BY position", run_id)
    return [(r["role"], r["content"], r["status"]) for r in rows]


def openai_env(fake: FakeServer, **extra: str) -> dict[str, str]:
    return {"AGENTD_OPENAI_BASE_URL": fake.base_url + "/v1",
            "AGENTD_OPENAI_API_KEY_ENV": "AGENTD_TEST_UNSET_KEY", "AGENTD_OPENAI_TIMEOUT_S": "10",
            **extra}


async def test_openai_turn_with_a_tool_step_sums_usage_and_keeps_the_answer(
        dsn: str, pool: asyncpg.Pool, fake: FakeServer, tmp_path: Path) -> None:
    fake.script(sse(openai_tool_calls([("call_7", "calculator",
                                        ['{"expression"', ': "6 * 7"}'])], usage=(30, 20))),
                sse(openai_text("The answer ", "is 42.", usage=(50, 6))))
    settings = settings_for(tmp_path, openai_env(fake))
    row, journal = await run_turn(dsn, pool, settings, "openai:fake")

    assert row["status"] == RunStatus.COMPLETED, row["error"]
    assert row["usage"] == {"input_tokens": 80, "output_tokens": 26}
    assert of_type(journal, EventType.TOOL_CALL)[0]["arguments"] == {"expression": "6 * 7"}
    assert of_type(journal, EventType.TOOL_RESULT)[0]["result"] == {
        "expression": "6 * 7", "value": 42}
    assert "".join(p["delta"] for p in of_type(journal, EventType.CONTENT_DELTA)) == \
        "The answer is 42."
    assert (await answer(pool, row["id"]))[-1] == ("assistant", "The answer is 42.", "complete")

    second = fake.received[1].body["messages"]
    assert second[-2]["tool_calls"][0]["function"] == {
        "name": "calculator", "arguments": '{"expression": "6 * 7"}'}
    assert second[-1]["role"] == "tool" and second[-1]["tool_call_id"] == "call_7"
    assert json.loads(second[-1]["content"]) == {"result": {"expression": "6 * 7", "value": 42}}


async def test_the_model_reads_what_it_said_before_its_tool_call(
        dsn: str, pool: asyncpg.Pool, fake: FakeServer, tmp_path: Path) -> None:
    """Text a model streams before a tool call goes back to it with the call: its next step
    used to read an assistant message with no text, as if it had said nothing. The stored
    answer keeps the whole turn's text, as every device saw it stream."""
    fake.script(sse(openai_tool_calls([("call_7", "calculator", ['{"expression": "6 * 7"}'])],
                                      said=["Let me ", "work that out."])),
                sse(openai_text(" It is 42.")))
    settings = settings_for(tmp_path, openai_env(fake))
    row, journal = await run_turn(dsn, pool, settings, "openai:fake")

    assert row["status"] == RunStatus.COMPLETED, row["error"]
    second = fake.received[1].body["messages"]
    assert second[-2]["role"] == "assistant"
    assert second[-2]["content"] == "Let me work that out."
    assert second[-2]["tool_calls"][0]["id"] == "call_7"
    streamed = "".join(p["delta"] for p in of_type(journal, EventType.CONTENT_DELTA))
    assert streamed == "Let me work that out. It is 42."
    assert (await answer(pool, row["id"]))[-1] == ("assistant", streamed, "complete")


async def test_bad_tool_arguments_become_a_tool_error_result_and_the_turn_goes_on(
        dsn: str, pool: asyncpg.Pool, fake: FakeServer, tmp_path: Path) -> None:
    fake.script(sse(openai_tool_calls([("call_1", "calculator", ['{"expr": "6*7"}'])])),
                sse(openai_text("Sorry, let me not.")))
    settings = settings_for(tmp_path, openai_env(fake))
    row, journal = await run_turn(dsn, pool, settings, "openai:fake")
    assert row["status"] == RunStatus.COMPLETED, row["error"]
    [result] = of_type(journal, EventType.TOOL_RESULT)
    assert result["error"] == \
        "invalid arguments for calculator: 'expression' is a required property"
    assert json.loads(fake.received[1].body["messages"][-1]["content"])["error"] == \
        result["error"]


async def test_nul_characters_in_model_text_are_dropped_not_fatal(
        dsn: str, pool: asyncpg.Pool, fake: FakeServer, tmp_path: Path) -> None:
    fake.script(sse(openai_text("before\x00", "\x00", " after")))
    settings = settings_for(tmp_path, openai_env(fake))
    row, journal = await run_turn(dsn, pool, settings, "openai:fake")
    assert row["status"] == RunStatus.COMPLETED, row["error"]
    assert "".join(p["delta"] for p in of_type(journal, EventType.CONTENT_DELTA)) == \
        "before after"
    assert (await answer(pool, row["id"]))[-1] == ("assistant", "before after", "complete")


async def test_nul_characters_in_a_tool_calls_id_and_arguments_are_dropped_everywhere_alike(
        dsn: str, pool: asyncpg.Pool, fake: FakeServer, tmp_path: Path) -> None:
    """The call's id is written to the journal, the answer's tool calls and the tool result,
    and sent back to the model: cleaned once, it is the same text in each."""
    fake.script(sse(openai_tool_calls([("call\x00_9", "calculator",
                                        ['{"expression": "6 * 7\\u0000"}'])])),
                sse(openai_text("42.")))
    settings = settings_for(tmp_path, openai_env(fake))
    row, journal = await run_turn(dsn, pool, settings, "openai:fake")
    assert row["status"] == RunStatus.COMPLETED, row["error"]
    [call] = of_type(journal, EventType.TOOL_CALL)
    [result] = of_type(journal, EventType.TOOL_RESULT)
    assert (call["call_id"], call["arguments"]) == ("call_9", {"expression": "6 * 7"})
    assert (result["call_id"], result["result"]["value"]) == ("call_9", 42)
    sent = fake.received[1].body["messages"]
    assert sent[-2]["tool_calls"][0]["id"] == "call_9"
    assert sent[-1]["tool_call_id"] == "call_9"
    tool_calls = await pool.fetchval(
        "SELECT tool_calls FROM message WHERE role = 'assistant' AND tool_calls IS NOT NULL"
        " AND conversation_id = (SELECT conversation_id FROM agent_run WHERE id = $1)",
        row["id"])
    assert [c["id"] for c in tool_calls] == ["call_9"]
    # Each step's events name the message that holds it (what a search hit names).
    held = {r["role"]: str(r["id"]) for r in await pool.fetch(
        "SELECT id, role FROM message WHERE run_id = $1"
        " AND (tool_call_id IS NOT NULL OR tool_calls IS NOT NULL)", row["id"])}
    assert (call["message_id"], result["message_id"]) == (held["assistant"], held["tool"])


async def test_a_tool_call_id_too_long_to_store_is_replaced_the_same_everywhere(
        dsn: str, pool: asyncpg.Pool, fake: FakeServer, tmp_path: Path) -> None:
    """A gateway's call id of 300 characters, for a tool that asks a device first: the
    approval stores ids of at most 200, and its insert failed the whole turn as an internal
    error. The id is now replaced by its digest, the same in every place it goes."""
    long_id = "call_" + "x" * 295
    fake.script(sse(openai_tool_calls([(long_id, "calculator", ['{"expression": "6 * 7"}'])])),
                sse(openai_text("42.")))
    config = tmp_path / "agentd.toml"
    config.write_text('[tools]\ncalculator = "ask"\n')
    settings = load_settings(config, env={"AGENTD_HEARTBEAT_S": "1", "AGENTD_FLUSH_MS": "20",
                                          "AGENTD_APPROVAL_TIMEOUT_S": "1", **openai_env(fake)})
    tenant = await new_tenant(pool)
    run = await enqueue(pool, tenant.account_id, tenant.conversation_id, "what is 6*7?",
                        request={"content": "what is 6*7?", "model": "openai:fake",
                                 "params": {}})
    [claim] = await claim_runs(pool, worker_id=WORKER, lease_ttl_s=settings.lease_ttl_s)
    async with worker(dsn, pool, settings, default_tools(settings.tool_policies)) as runner:
        assert await runner.run(claim)  # nobody decides: denied after 1 s, and the turn goes on
    row = await pool.fetchrow("SELECT * FROM agent_run WHERE id = $1", run.run_id)
    journal = await assert_journal_sound(pool, run.run_id)
    assert row["status"] == RunStatus.COMPLETED, row["error"]
    [asked] = of_type(journal, EventType.APPROVAL_REQUESTED)
    [call] = of_type(journal, EventType.TOOL_CALL)
    [result] = of_type(journal, EventType.TOOL_RESULT)
    replaced = call["call_id"]
    assert replaced.startswith("call_") and len(replaced) <= 200 and replaced != long_id
    assert asked["call_id"] == result["call_id"] == replaced
    sent = fake.received[1].body["messages"]
    assert sent[-2]["tool_calls"][0]["id"] == sent[-1]["tool_call_id"] == replaced


def failure_logged(caplog: pytest.LogCaptureFixture, run_id: Any) -> str:
    """The daemon log's line for a failed run, found by its run id (the detail lives there)."""
    lines = [r.getMessage() for r in caplog.records
             if r.name == "agentd.failures" and getattr(r, "run_id", None) == str(run_id)]
    assert len(lines) == 1, lines
    return lines[0]


def assert_client_error(row: Any, journal: list[Any], code: str) -> None:
    """The run's error is the stable code and its short client message, on the row and in
    the journaled `complete` alike."""
    assert (row["error_code"], row["error"]) == (code, CLIENT_MESSAGES[RunErrorCode(code)])
    complete = of_type(journal, EventType.COMPLETE)[0]
    assert (complete["error"], complete["error_code"]) == (row["error"], code)


async def test_max_tool_steps_per_turn_is_enforced(
        dsn: str, pool: asyncpg.Pool, fake: FakeServer, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    fake.script(sse(openai_tool_calls([("call_x", "clock", ["{}"])], usage=(10, 1))))
    settings = settings_for(tmp_path, openai_env(fake, AGENTD_MAX_TOOL_STEPS="2"))
    row, journal = await run_turn(dsn, pool, settings, "openai:fake")
    assert row["status"] == RunStatus.FAILED
    assert_client_error(row, journal, "tool_steps_exceeded")
    assert "more than 2 tool steps" in failure_logged(caplog, row["id"])
    assert len(fake.received) == 3
    assert len(of_type(journal, EventType.TOOL_RESULT)) == 2
    assert row["usage"] == {"input_tokens": 30, "output_tokens": 3}


async def test_a_provider_that_hangs_fails_the_run_with_a_timeout_error(
        dsn: str, pool: asyncpg.Pool, fake: FakeServer, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    fake.script(hang())
    settings = settings_for(tmp_path, openai_env(fake, AGENTD_OPENAI_TIMEOUT_S="1"))
    row, journal = await run_turn(dsn, pool, settings, "openai:fake")
    assert row["status"] == RunStatus.FAILED
    assert_client_error(row, journal, "provider_timeout")
    assert "openai: timed out" in failure_logged(caplog, row["id"])


async def test_a_model_call_past_its_call_timeout_fails_even_while_it_streams(
        dsn: str, pool: asyncpg.Pool, fake: FakeServer, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    # Never silent for timeout_s, so only the whole call's bound can end it.
    fake.script(endless(lambda i: openai_chunk({"content": f" w{i}"}), interval_s=0.05))
    settings = settings_for(tmp_path, openai_env(fake, AGENTD_OPENAI_CALL_TIMEOUT_S="1.5"))
    row, journal = await run_turn(dsn, pool, settings, "openai:fake")
    assert row["status"] == RunStatus.FAILED
    assert_client_error(row, journal, "provider_timeout")
    assert "call_timeout_s" in failure_logged(caplog, row["id"])
    streamed = "".join(p["delta"] for p in of_type(journal, EventType.CONTENT_DELTA))
    assert streamed.startswith(" w0 w1")
    assert (await answer(pool, row["id"]))[-1] == ("assistant", streamed, "failed")
    await fake.wait_client_gone(within=15)


async def test_a_line_without_end_fails_the_call_before_it_fills_the_memory(
        dsn: str, pool: asyncpg.Pool, fake: FakeServer, tmp_path: Path,
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server (or a proxy in front of it) that streams one line and never ends it, quickly
    enough that no timeout fires: the event stream buffered it whole, as long as it went on.
    Past MAX_EVENT_CHARS without an event (1 MB here, 16 MB by default) the call fails."""
    monkeypatch.setattr(http_stream, "MAX_EVENT_CHARS", 1_000_000, raising=False)
    fake.script(endless(lambda i: (b"data: " if i == 0 else b"") + b"x" * 65536,
                        interval_s=0.01))
    # Only the whole call's bound would end it otherwise (a timeout, not this failure).
    settings = settings_for(tmp_path, openai_env(fake, AGENTD_OPENAI_CALL_TIMEOUT_S="20"))
    row, journal = await run_turn(dsn, pool, settings, "openai:fake")
    assert row["status"] == RunStatus.FAILED
    assert_client_error(row, journal, "provider_error")
    assert "without a whole event" in failure_logged(caplog, row["id"])
    await fake.wait_client_gone(within=15)


async def test_an_unknown_model_fails_the_run_with_a_code_and_the_servers_words_in_the_log(
        dsn: str, pool: asyncpg.Pool, fake: FakeServer, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    fake.script(status(404, {"error": {"message": "model 'nope' not found, try pulling it"}}))
    settings = settings_for(tmp_path, openai_env(fake))
    row, journal = await run_turn(dsn, pool, settings, "openai:nope")
    assert row["status"] == RunStatus.FAILED
    assert_client_error(row, journal, "provider_rejected")
    logged = failure_logged(caplog, row["id"])
    assert "HTTP 404" in logged and "model 'nope' not found" in logged
    # What every client sees carries no internals: no URL, no key variable, no provider words.
    shown = json.dumps([row["error"], of_type(journal, EventType.COMPLETE)])
    for secret in (fake.base_url, "127.0.0.1", "AGENTD_TEST_UNSET_KEY", "not found", "404"):
        assert secret not in shown, secret


async def test_anthropic_turn_with_a_tool_step_completes(
        dsn: str, pool: asyncpg.Pool, fake: FakeServer, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake.script(
        sse(anthropic_message([("text", ["Computing."]),
                               ("tool_use", ("toolu_9", "calculator",
                                             ['{"expression":', ' "2 ** 8"}']))],
                              stop_reason="tool_use", usage=(100, 30))),
        sse(anthropic_message([("text", ["It is ", "256."])], stop_reason="end_turn",
                              usage=(160, 5))))
    settings = settings_for(tmp_path, {
        "AGENTD_ANTHROPIC_BASE_URL": fake.base_url,
        "AGENTD_ANTHROPIC_API_KEY_ENV": "AGENTD_TEST_ANTHROPIC_RUN_KEY"})
    monkeypatch.setenv("AGENTD_TEST_ANTHROPIC_RUN_KEY", "sk-ant-run")
    row, journal = await run_turn(dsn, pool, settings, "anthropic:claude-sonnet-4")
    assert row["status"] == RunStatus.COMPLETED, row["error"]
    assert row["usage"] == {"input_tokens": 260, "output_tokens": 35}
    assert of_type(journal, EventType.TOOL_RESULT)[0]["result"]["value"] == 256
    second = fake.received[1].body["messages"]
    assert second[-1] == {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9",
         "content": json.dumps({"result": {"expression": "2 ** 8", "value": 256}})}]}
    assert (await answer(pool, row["id"]))[-1] == ("assistant", "Computing.It is 256.",
                                                   "complete")


async def test_a_notes_call_in_a_turn_writes_with_the_runs_fence(
        dsn: str, pool: asyncpg.Pool, tmp_path: Path) -> None:
    settings = settings_for(tmp_path, {})
    row, journal = await run_turn(dsn, pool, settings, "demo",
                                  params={"tool": "notes", "tokens": 3, "delay_ms": 0})
    assert row["status"] == RunStatus.COMPLETED, row["error"]
    assert "note_id" in of_type(journal, EventType.TOOL_RESULT)[0]["result"]
    note = await pool.fetchrow("SELECT run_id, fence, text FROM conversation_note"
                               " WHERE conversation_id = $1", row["conversation_id"])
    assert (note["run_id"], note["fence"], note["text"]) == (row["id"], row["fence"],
                                                             "demo note")


async def test_a_lost_lease_closes_the_upstream_stream_and_writes_nothing_more(
        dsn: str, pool: asyncpg.Pool, fake: FakeServer, tmp_path: Path) -> None:
    fake.script(endless(lambda i: openai_chunk({"content": f" w{i}"}), interval_s=0.05))
    settings = settings_for(tmp_path, openai_env(fake))
    tenant = await new_tenant(pool)
    run = await enqueue(pool, tenant.account_id, tenant.conversation_id, "go on",
                        request={"content": "go on", "model": "openai:fake", "params": {}})
    [claim] = await claim_runs(pool, worker_id=WORKER, lease_ttl_s=settings.lease_ttl_s)
    async with worker(dsn, pool, settings) as runner:
        running = asyncio.create_task(runner.run(claim))
        await wait_streaming(pool, run.run_id, timeout=30, min_deltas=2)
        # The worker looks dead to the database (its deadline passed) and the reaper ends it.
        await pool.execute("UPDATE agent_run SET lease_expires_at = clock_timestamp()"
                           " WHERE id = $1", run.run_id)
        assert run.run_id in await reap_expired(pool, grace_s=0, limit=10)
        await fake.wait_client_gone(within=15)
        assert await asyncio.wait_for(running, 30) is False  # stood down, finalized nothing
    row = await pool.fetchrow("SELECT status, error_code FROM agent_run WHERE id = $1",
                              run.run_id)
    assert (row["status"], row["error_code"]) == (RunStatus.FAILED, "lease_expired")
    await assert_journal_sound(pool, run.run_id)


async def never_answers(_args: dict[str, Any], _ctx: Any) -> Any:
    await asyncio.Event().wait()  # a tool stuck on something that never comes


async def test_a_turn_past_its_deadline_fails_keeping_its_text_and_answering_its_open_call(
        dsn: str, pool: asyncpg.Pool, fake: FakeServer, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    fake.script(sse([openai_chunk({"role": "assistant", "content": "Let me check. "}),
                     *openai_tool_calls([("call_s", "stuck", ["{}"])])[1:]]))
    settings = settings_for(tmp_path, openai_env(fake, AGENTD_MAX_RUN_S="2"))
    tools = ToolRegistry([Tool("stuck", "never answers", {"type": "object"}, never_answers)])
    tenant = await new_tenant(pool)
    run = await enqueue(pool, tenant.account_id, tenant.conversation_id, "look it up",
                        request={"content": "look it up", "model": "openai:fake", "params": {}})
    [claim] = await claim_runs(pool, worker_id=WORKER, lease_ttl_s=settings.lease_ttl_s)
    async with worker(dsn, pool, settings, tools) as runner:
        assert await asyncio.wait_for(runner.run(claim), 30)
    row = await pool.fetchrow("SELECT * FROM agent_run WHERE id = $1", run.run_id)
    journal = await assert_journal_sound(pool, run.run_id)
    assert row["status"] == RunStatus.FAILED
    assert_client_error(row, journal, "deadline_exceeded")
    failure_logged(caplog, row["id"])  # the operator's line, keyed by the run id
    # The text every client saw is kept, after the open call's `cancelled` answer: the next
    # turn's request to the model is well-formed.
    assert await answer(pool, run.run_id) == [
        ("user", "look it up", "complete"), ("assistant", "", "complete"),
        ("tool", '{"error": "cancelled"}', "cancelled"),
        ("assistant", "Let me check. ", "failed")]
    [result] = of_type(journal, EventType.TOOL_RESULT)
    assert (result["call_id"], result["error"]) == ("call_s", "cancelled")
