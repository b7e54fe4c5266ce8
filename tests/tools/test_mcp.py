"""MCP servers through a real daemon: the PyPI `mcp-server-time` over stdio, and the test server
over stdio and streamable HTTP, for `_meta` fences, cancellation on stop, crashes and garbage.

Tools are `auto` here (approvals have their own tests); the demo model calls whatever tool the
run's params name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.api.helpers import assert_error, start_run, wait_run
from tests.support.daemon import poll_until
from tests.support.factories import create_conversation
from tests.tools.conftest import (
    MCP_SERVER_TIME,
    journaled,
    mcp_test_server,
    read_mcp_journal,
    run_events,
)

AUTO = {"approval": "auto"}


def tool_params(tool: str, args: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"tool": tool, "tokens": 3, "delay_ms": 0, **extra}
    if args is not None:
        params["tool_args"] = args
    return params


def tool_result(events: list[dict[str, Any]]) -> dict[str, Any]:
    results = [e for e in events if e["type"] == "tool_result"]
    assert len(results) == 1, events
    return results[0]


async def answer_of(api: Any, conversation_id: str, run_id: str) -> str:
    state = (await api.a.get(f"/v1/conversations/{conversation_id}")).json()
    answers = [m for m in state["messages"] if m["run_id"] == run_id and m["role"] == "assistant"
               and not m.get("tool_calls")]
    assert len(answers) == 1, state["messages"]
    return answers[0]["content"]


async def error_the_model_read(api: Any, tool: str, args: dict[str, Any]) -> str:
    """A turn calling `tool` with `args` completes, and the tool's error is what its model
    read (in the demo model's answer)."""
    conversation = await create_conversation(api.a)
    run = await start_run(api.a, conversation, f"call {tool}", tool_params(tool, args))
    done = await wait_run(api.a, run["run_id"])
    assert done["status"] == "completed", done
    error: str = tool_result(await run_events(api.a, run["run_id"]))["error"]
    assert error in await answer_of(api, conversation, run["run_id"])
    return error


async def test_mcp_server_time_answers_a_turn_over_stdio(start_tools_api) -> None:
    assert MCP_SERVER_TIME.exists(), "the test extra installs mcp-server-time"
    servers = {"time": {"command": str(MCP_SERVER_TIME), "args": ["--local-timezone", "UTC"],
                        "tools": {"get_current_time": "auto"}}}
    async with start_tools_api(servers) as api:
        conversation = await create_conversation(api.a)
        before = datetime.now(UTC)
        run = await start_run(api.a, conversation, "what time is it in Tokyo?", tool_params(
            "time.get_current_time", {"timezone": "Asia/Tokyo"}))
        done = await wait_run(api.a, run["run_id"])
        assert done["status"] == "completed", done
        result = tool_result(await run_events(api.a, run["run_id"]))["result"]
        assert result["timezone"] == "Asia/Tokyo"
        stamp = datetime.fromisoformat(result["datetime"])
        assert abs((stamp - before).total_seconds()) < 120, result
        answer = await answer_of(api, conversation, run["run_id"])
        assert answer.startswith("tool said:") and "Asia/Tokyo" in answer
        assert result["datetime"] in answer


async def test_meta_carries_run_conversation_and_a_fence_that_grows(start_tools_api,
                                                                    journal: Path) -> None:
    async with start_tools_api({"t": mcp_test_server(journal, **AUTO)}) as api:
        conversation = await create_conversation(api.a)
        seen = []
        for text in ("first", "second"):
            run = await start_run(api.a, conversation, text, tool_params(
                "t.echo_meta", {"text": text}))
            done = await wait_run(api.a, run["run_id"])
            assert done["status"] == "completed", done
            entry = await journaled(journal, lambda e, t=text: e.get("text") == t)
            assert entry["meta"] == {"agentd/run_id": run["run_id"],
                                     "agentd/conversation_id": conversation,
                                     "agentd/fence": done["fence"]}
            seen.append(entry["meta"]["agentd/fence"])
        assert seen[0] < seen[1]
        # One server process served both runs: it is shared, not started per turn.
        assert len({e["pid"] for e in read_mcp_journal(journal)}) == 1


async def test_stop_sends_mcp_cancellation_for_a_call_in_flight(start_tools_api,
                                                                journal: Path) -> None:
    async with start_tools_api({"t": mcp_test_server(journal, **AUTO)}) as api:
        conversation = await create_conversation(api.a)
        run = await start_run(api.a, conversation, "sleep", tool_params(
            "t.slow", {"seconds": 600}))
        await journaled(journal, lambda e: e["event"] == "slow_started")
        stopped = await api.a.post(f"/v1/runs/{run['run_id']}/cancel")
        assert stopped.status_code == 202, stopped.text
        done = await wait_run(api.a, run["run_id"])
        assert done["status"] == "cancelled", done
        # The server itself saw the cancellation, for this run's call.
        cancelled = await journaled(journal, lambda e: e["event"] == "slow_cancelled")
        assert cancelled["meta"]["agentd/run_id"] == run["run_id"]
        assert not [e for e in read_mcp_journal(journal) if e["event"] == "slow_finished"]
        state = (await api.a.get(f"/v1/conversations/{conversation}")).json()
        repaired = [m for m in state["messages"] if m["role"] == "tool"]
        assert [(m["status"], json.loads(m["content"])) for m in repaired] == \
            [("cancelled", {"error": "cancelled"})]


async def test_a_server_crash_mid_call_fails_the_call_and_the_next_turn_works(
        start_tools_api, journal: Path) -> None:
    async with start_tools_api({"t": mcp_test_server(journal, **AUTO)}) as api:
        conversation = await create_conversation(api.a)
        run = await start_run(api.a, conversation, "crash", tool_params("t.crash", {}))
        done = await wait_run(api.a, run["run_id"])
        # The call failed; the turn did not: the model read the error and answered.
        assert done["status"] == "completed", done
        error = tool_result(await run_events(api.a, run["run_id"]))["error"]
        assert "failed during the call" in error and "restarted" in error
        assert "Traceback" not in error
        crashed_pid = (await journaled(journal, lambda e: e["event"] == "crash"))["pid"]
        run = await start_run(api.a, conversation, "again", tool_params(
            "t.echo_meta", {"text": "after the crash"}))
        done = await wait_run(api.a, run["run_id"])
        assert done["status"] == "completed", done
        entry = await journaled(journal, lambda e: e.get("text") == "after the crash")
        assert entry["pid"] != crashed_pid  # a new server process answered


async def test_results_the_model_cannot_use_are_tool_errors_and_the_turn_goes_on(
        start_tools_api, journal: Path) -> None:
    """A result that breaks the tool's own output schema (the SDK raises RuntimeError) and a
    structured result too large to pass on: each is an error the model reads, saying the call
    ran. Before, the first failed the whole turn (internal_error) and the second was stored,
    journaled and streamed whole. A policy naming a tool the server does not list (a typo) is
    said in the log."""
    async with start_tools_api({"t": mcp_test_server(
            journal, **AUTO, tools={"wrong_shap": "deny"})}) as api:
        conversation = await create_conversation(api.a)
        for tool, args, words in (
                ("t.wrong_shape", {}, ("could not be used", "the call may have run")),
                ("t.big", {"size": 200_000}, ("ran, but its result is too large",))):
            run = await start_run(api.a, conversation, tool, tool_params(tool, args))
            done = await wait_run(api.a, run["run_id"])
            assert done["status"] == "completed", done
            error = tool_result(await run_events(api.a, run["run_id"]))["error"]
            assert all(w in error for w in words), error
            await journaled(journal, lambda e, name=tool.split(".")[1]: e["event"] == name)
        assert "x" * 1000 not in (await api.a.get(f"/v1/conversations/{conversation}")).text
        assert "mcp tool policies name tools the server does not list" in \
            api.daemon.log_text() and "wrong_shap" in api.daemon.log_text()


async def test_a_failing_server_s_next_start_goes_on_behind_the_turns(
        start_tools_api, tmp_path: Path) -> None:
    """A server that never finishes its handshake: the first turn waits for its first start
    (start_timeout_s), as a server's first start is waited for. Once it has failed, a turn that
    sets off its next attempt waits a moment, not start_timeout_s: that attempt goes on behind
    it. Before, every turn starting during each retry waited it out."""
    starts = tmp_path / "starts"
    hanging = {"command": sys.executable, "args": [
        # It reads what it is sent and never answers: its handshake waits until it is killed.
        "-c", "import sys; open(sys.argv[1], 'a').write('start\\n'); sys.stdin.buffer.read()",
        str(starts)], "start_timeout_s": 8, **AUTO}
    async with start_tools_api({"hang": hanging}) as api:
        conversation = await create_conversation(api.a)

        def failures() -> int:
            return api.daemon.log_text().count("mcp server failed to start")

        run = await start_run(api.a, conversation, "first", tool_params("calculator",
                                                                        {"expression": "1+1"}))
        assert (await wait_run(api.a, run["run_id"], within_s=30))["status"] == "completed"
        await poll_until(lambda: failures() == 1, 15, what="the first start to fail")

        async def a_turn_that_restarts_it() -> dict[str, Any] | None:
            before = starts.read_text().count("start")
            run = await start_run(api.a, conversation, "again", tool_params(
                "calculator", {"expression": "1+1"}))
            done = await wait_run(api.a, run["run_id"], within_s=30)
            assert done["status"] == "completed", done
            return done if starts.read_text().count("start") > before else None

        done = await poll_until(a_turn_that_restarts_it, 30, interval=0.2,
                                what="a turn setting off the next start")
        await poll_until(lambda: failures() == 2, 30, what="the second start to fail")
        # That attempt took start_timeout_s (8 s); the turn that set it off did not wait for
        # it, so the daemon's log (one process, written in order) has the turn's end first.
        lines = api.daemon.log_text().splitlines()
        ended = next(n for n, line in enumerate(lines)
                     if "run finished" in line and done["id"] in line)
        failed = [n for n, line in enumerate(lines) if "mcp server failed to start" in line]
        assert ended < failed[1], lines[ended - 2:failed[1] + 1]


async def test_streamable_http_transport_with_a_header_from_the_environment(
        start_tools_api, http_test_server: str, journal: Path) -> None:
    servers = {"web": {"url": http_test_server, "headers": {"X-Test-Token": "TEST_MCP_TOKEN"},
                       **AUTO}}
    async with start_tools_api(servers, env={"TEST_MCP_TOKEN": "s3cret"}) as api:
        conversation = await create_conversation(api.a)
        run = await start_run(api.a, conversation, "over http", tool_params(
            "web.echo_meta", {"text": "over http"}))
        done = await wait_run(api.a, run["run_id"])
        assert done["status"] == "completed", done
        entry = await journaled(journal, lambda e: e.get("text") == "over http")
        assert entry["header"] == "s3cret"
        assert entry["meta"]["agentd/fence"] == done["fence"]
        assert tool_result(await run_events(api.a, run["run_id"]))["result"]["text"] == \
            "over http"


async def test_arguments_failing_the_schema_reach_the_model_and_the_run_continues(
        start_tools_api, journal: Path) -> None:
    async with start_tools_api({"t": mcp_test_server(journal, **AUTO)}) as api:
        error = await error_the_model_read(api, "t.echo_meta", {"text": 5})
        assert error == "invalid arguments for t.echo_meta at text: 5 is not of type 'string'"
        assert not [e for e in read_mcp_journal(journal) if e["event"] == "echo_meta"]


async def test_a_schema_that_cannot_check_its_arguments_is_the_tools_error_not_the_turns(
        start_tools_api, journal: Path) -> None:
    """A `$ref` to nowhere passes the schema check and fails only when arguments are checked:
    the model reads that as the tool's result and the turn goes on (it failed the whole turn,
    internal_error, before)."""
    async with start_tools_api({"t": mcp_test_server(journal, **AUTO)}) as api:
        error = await error_the_model_read(api, "t.dangling", {"value": 1})
        assert error == ("the arguments of t.dangling cannot be checked: its input schema "
                         "holds a $ref it cannot resolve within itself (other schemas are never "
                         "fetched)"), error


@pytest.mark.parametrize("where", ["http", "file"])
async def test_a_schema_ref_to_elsewhere_is_never_fetched(
        start_tools_api, journal: Path, tmp_path: Path, where: str) -> None:
    """jsonschema's default opens an unknown `$ref`'s URI itself (urlopen, with no timeout, on
    the event loop): a tool's schema made the daemon fetch http:// and file:// URIs of the
    server's choosing, from its own host, and a URI that never answered froze the process."""
    fetched: list[str] = []

    async def schema(request: web.Request) -> web.Response:
        fetched.append(request.path)
        return web.json_response({"type": "integer"})

    app = web.Application()
    app.router.add_get("/schema", schema)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    local = tmp_path / "schema.json"
    local.write_text('{"type": "integer"}')
    ref = f"http://127.0.0.1:{port}/schema" if where == "http" else local.as_uri()
    server = mcp_test_server(journal, **AUTO)
    server["env"]["TEST_MCP_DANGLING_REF"] = ref
    try:
        async with start_tools_api({"t": server}) as api:
            error = await error_the_model_read(api, "t.dangling", {"value": 1})
    finally:
        await runner.cleanup()
    assert "holds a $ref it cannot resolve within itself" in error, error
    assert fetched == []


async def test_bad_servers_and_schemas_are_clear_errors_and_runs_still_work(
        start_tools_api, journal: Path, tmp_path: Path) -> None:
    not_executable = tmp_path / "not-executable"
    not_executable.write_text("#!/bin/sh\n")
    servers = {
        "t": mcp_test_server(journal, **AUTO),
        "noexec": {"command": str(not_executable)},
        "junk": {"command": "/bin/sh", "args": ["-c", "echo hello there; exec cat >/dev/null"],
                 "start_timeout_s": 10},
    }
    async with start_tools_api(servers) as api:
        conversation = await create_conversation(api.a)
        # Why a server is unavailable stays in the log and `agentd doctor`
        # (test_tool_checks_at_enqueue.py); the client is told which tool it cannot use.
        for tool, code, words in (
                ("noexec.anything", "tool_unavailable", "tool 'noexec.anything' is unavailable"),
                ("junk.anything", "tool_unavailable", "tool 'junk.anything' is unavailable"),
                ("t.broken", "invalid_params", "no tool named 't.broken'"),
                ("t.nonexistent", "invalid_params", "no tool named")):
            response = await api.a.post(f"/v1/conversations/{conversation}/runs", json={
                "content": "x", "params": tool_params(tool, {})})
            error = assert_error(response, 422, code)
            assert words in error["message"], error
        # A turn that needs none of them runs; the broken servers are simply not offered.
        run = await start_run(api.a, conversation, "plain turn")
        assert (await wait_run(api.a, run["run_id"]))["status"] == "completed"
        # A server that starts fine and then writes garbage mid-call: the call fails at once.
        run = await start_run(api.a, conversation, "garble", tool_params("t.garble", {}))
        done = await wait_run(api.a, run["run_id"], within_s=30)
        assert done["status"] == "completed", done
        error = tool_result(await run_events(api.a, run["run_id"]))["error"]
        assert "not JSON-RPC" in error, error


def test_doctor_lists_each_server_its_state_and_its_tools(dsn: str, journal: Path,
                                                         tmp_path: Path) -> None:
    from tests.tools.conftest import write_config

    config = write_config(tmp_path / "agentd.toml", {
        "t": mcp_test_server(journal), "missing": {"command": str(tmp_path / "no-such-program")}})
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config")
    done = subprocess.run([sys.executable, "-m", "agentd", "doctor", "--dsn", dsn,
                           "--config", str(config)], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    lines = {line.split(":", 1)[0]: line for line in done.stdout.splitlines()}
    assert lines["[FAIL] mcp t"].startswith("[FAIL] mcp t: ready (stdio): 8 tools: "
                                            "t.add_tool, t.big, t.crash, t.dangling, "
                                            "t.echo_meta, t.garble, t.slow, t.wrong_shape; "
                                            "tool 'broken' disabled: invalid input "
                                            "schema at properties/value/minimum"), done.stdout
    assert lines["[FAIL] mcp missing"] == \
        "[FAIL] mcp missing: failed (stdio): the command was not found", done.stdout
    assert done.returncode == 1


@pytest.mark.parametrize("bad", [
    {"command": "x", "url": "http://127.0.0.1:1/mcp"},
    {"url": "ftp://example.invalid/mcp"},
    {"url": "http://user:pw@127.0.0.1:1/mcp"},
    {"url": "http://127.0.0.1:1/mcp", "headers": {"Authorization": "Bearer abc"}},
    {"command": "x", "approval": "sometimes"},
    {"command": "x", "tools": {"a": "maybe"}},
    {"command": "x", "colour": "blue"},
])
def test_bad_server_tables_fail_at_start_naming_the_key(tmp_path: Path,
                                                        bad: dict[str, Any]) -> None:
    from agentd.settings import SettingsError, load_settings
    from tests.tools.conftest import write_config

    config = write_config(tmp_path / "agentd.toml", {"s": bad})
    with pytest.raises(SettingsError, match=r"mcp\.s"):
        load_settings(config, env={})


async def test_a_server_unavailable_says_whether_it_failed_or_is_still_starting() -> None:
    """What a caller that gives up on a server reads follows its state: while a new attempt
    after a failure is under way it is still starting, not 'failed to start'."""
    from agentd.tool_settings import McpServerConfig
    from agentd.tools.mcp import McpServer, McpUnavailable

    # It reads what it is sent and never answers: every handshake runs out its time.
    server = McpServer(McpServerConfig(name="hang", command=sys.executable, args=(
        "-c", "import sys; sys.stdin.buffer.read()"), start_timeout_s=1.0))
    try:
        with pytest.raises(McpUnavailable, match=r"is unavailable: it is still starting$"):
            await server.ensure_ready(within_s=0.2)
        with pytest.raises(McpUnavailable, match="it failed to start"):
            await server.ensure_ready()  # waits out the first attempt
        assert server.state == "failed"

        async def starting_again() -> str | None:
            try:
                await server.ensure_ready(within_s=0.2)
            except McpUnavailable as exc:
                return str(exc) if server.state == "starting" else None
            raise AssertionError("the hanging server got ready")

        said = await poll_until(starting_again, 10, what="the next attempt")
        assert said.endswith("is unavailable: it is still starting"), said
    finally:
        await server.close()


async def test_a_server_listing_too_much_is_bounded(journal: Path) -> None:
    """Every turn offers the model every tool: a server listing thousands (or megabytes of
    schema) made every turn too large for its provider, and was compiled whole on the event
    loop at each listing."""
    from agentd.tool_settings import parse_server
    from agentd.tools.mcp import MAX_DESCRIPTION_CHARS, MAX_TOOLS_PER_SERVER, McpTools

    spec = mcp_test_server(journal)
    spec["env"]["TEST_MCP_MANY_TOOLS"] = "400"
    servers = McpTools({"t": parse_server("t", spec)})
    try:
        offered = await servers.tools()
        [status] = servers.status()
    finally:
        await servers.close()
    assert len(offered) == MAX_TOOLS_PER_SERVER, len(offered)
    assert status.disabled["many_0000"].startswith("its input schema is larger than")
    past = [name for name, why in status.disabled.items()
            if why == f"the server lists more than {MAX_TOOLS_PER_SERVER} usable tools"]
    # 9 of its own and 400 more, two of them refused for their schemas ("broken" as well).
    assert len(past) == 9 + 400 - 2 - MAX_TOOLS_PER_SERVER, len(past)
    long = next(tool for tool in offered if tool.name == "t.many_0001")
    assert len(long.description) == MAX_DESCRIPTION_CHARS and long.description.endswith("…")
