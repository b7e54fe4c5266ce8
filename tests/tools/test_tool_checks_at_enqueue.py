"""A run that names an MCP tool has the tool checked at enqueue: what a client reads when its
server is unavailable, and what the conversation's other requests meet while a retry waits for
a server to start.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path
from typing import Any

from tests.api.helpers import FAST, assert_error, start_run, wait_run
from tests.support.daemon import ADMIT_ANY_LOAD, free_port, poll_until
from tests.support.factories import create_conversation
from tests.tools.conftest import mcp_test_server, read_mcp_journal

SECRET_VARIABLE = "AGENTD_REVIEW_MCP_KEY_NEVER_SET"  # the daemon's environment drops AGENTD_*
SERVER_WORDS = "the vault at /srv/review-secret is sealed"
# Answers every request with an error of its own words: the handshake fails saying them.
HANDSHAKE_REFUSER = f"""
import json, sys
for line in sys.stdin:
    message = json.loads(line)
    if "id" in message:
        print(json.dumps({{"jsonrpc": "2.0", "id": message["id"],
                          "error": {{"code": -32000, "message": {SERVER_WORDS!r}}}}}),
              flush=True)
"""


def tool_params(tool: str) -> dict[str, Any]:
    return {"tool": tool, "tool_args": {}, **FAST}


def unavailable_message(tool: str) -> str:
    server = tool.partition(".")[0]
    return (f"tool {tool!r} is unavailable: its MCP server {server!r} could not be started or "
            f"reached; try again later (the daemon's log and `agentd doctor` say why)")


async def test_an_unavailable_tool_is_named_without_why_its_server_is_unavailable(
        start_tools_api, tmp_path: Path) -> None:
    not_executable = tmp_path / "not-executable"
    not_executable.write_text("#!/bin/sh\n")
    servers = {
        "keyed": {"url": f"http://127.0.0.1:{free_port()}/mcp",
                  "headers": {"X-Review-Key": SECRET_VARIABLE}, "start_timeout_s": 10},
        "refuser": {"command": sys.executable, "args": ["-c", HANDSHAKE_REFUSER],
                    "start_timeout_s": 10},
        "noexec": {"command": str(not_executable)},
    }
    hidden = (SECRET_VARIABLE, "X-Review-Key", "environment", SERVER_WORDS, "vault",
              "/srv/", str(not_executable), "not executable", "handshake")
    async with start_tools_api(servers) as api:
        conversation = await create_conversation(api.a)
        for tool in ("keyed.lookup", "refuser.anything", "noexec.anything"):
            response = await api.a.post(f"/v1/conversations/{conversation}/runs", json={
                "content": "x", "params": tool_params(tool)})
            error = assert_error(response, 422, "tool_unavailable")
            assert error == {"code": "tool_unavailable", "message": unavailable_message(tool),
                             "tool": tool}
            for words in hidden:
                assert words not in response.text, (words, response.text)
        # The reason is not lost: the daemon's log has it, for its operator.
        await api.daemon.wait_for_log(SECRET_VARIABLE, 10)
        assert await api.pool.fetchval("SELECT count(*) FROM agent_run") == 0


async def test_a_retry_waiting_for_its_tools_server_leaves_the_conversation_unlocked(
        start_tools_api, tmp_path: Path) -> None:
    """The race: a retry naming an MCP tool whose server is still starting (up to its
    start_timeout_s), against a post to the same conversation. Checked under the
    conversation's row lock, the retry held it for the whole start and the post met
    lock_timeout (5 s): a 503. Checked first, the post goes through at once. Nor does the
    retry hold the process's claim slot meanwhile: the post starts its turn in its own commit
    (it was only queued while a retry held the slot for the server's whole start)."""
    first, starting = tmp_path / "first-start", tmp_path / "second-start"
    # Fails its first start at once (the first turn lists tools); from then on it starts and
    # never answers the handshake, so a start lasts start_timeout_s.
    script = (f"if [ -e '{first}' ]; then touch '{starting}'; exec sleep 600; "
              f"else touch '{first}'; exit 1; fi")
    servers = {"slow": {"command": "/bin/sh", "args": ["-c", script], "start_timeout_s": 12}}
    async with start_tools_api(servers, **ADMIT_ANY_LOAD) as api:
        conversation = await create_conversation(api.a)
        turn = await start_run(api.a, conversation, "to be retried")
        assert (await wait_run(api.a, turn["run_id"]))["status"] == "completed"
        assert first.exists()
        retry_body = {"retry_of": "last", "params": tool_params("slow.anything")}
        retry: asyncio.Task[Any] | None = None

        async def retry_waits_for_the_start() -> asyncio.Task[Any] | None:
            nonlocal retry
            if retry is not None and retry.done():
                # Refused within the server's restart backoff, before it started again:
                # nothing was written; send it again.
                assert_error(retry.result(), 422, "tool_unavailable")
                retry = None
            if retry is None:
                retry = asyncio.create_task(api.a.post(
                    f"/v1/conversations/{conversation}/runs", json=retry_body))
            return retry if starting.exists() else None

        retrying = await poll_until(retry_waits_for_the_start, 30, interval=0.1,
                                    what="a retry waiting for the server's start")
        try:
            meanwhile = await api.a.post(f"/v1/conversations/{conversation}/runs",
                                         json={"content": "meanwhile", "params": FAST})
            assert meanwhile.status_code == 202, meanwhile.text
            assert not retrying.done()  # the post did not wait for the retry to end
            assert meanwhile.json()["status"] == "running", meanwhile.json()
        finally:
            answer = await asyncio.wait_for(retrying, 30)
        # Under the lock the retry meets the post's turn: still active (its own tool listing
        # may wait for the same start), a 409 comes before any tool check; ended, the retry
        # re-runs it and its tool is checked: unavailable.
        if answer.status_code == 409:
            assert_error(answer, 409, "turn_active")
        else:
            assert_error(answer, 422, "tool_unavailable")
        # Whole or nothing: the refused retry wrote nothing and superseded nothing.
        assert await api.pool.fetchval("SELECT count(*) FROM agent_run") == 2
        assert await api.pool.fetchval(
            "SELECT count(*) FROM message WHERE superseded_by IS NOT NULL") == 0


async def test_a_post_to_a_conversation_not_the_callers_starts_no_server(
        start_tools_api, journal: Path) -> None:
    """The tool was checked (its MCP server started, for up to start_timeout_s) before the
    conversation was: a post to another account's conversation, or to none, started servers
    and was answered about the tool instead of 404."""
    async with start_tools_api({"t": mcp_test_server(journal, start_timeout_s=10)}) as api:
        theirs = await create_conversation(api.b)
        for conversation in (theirs, str(uuid.uuid4())):
            response = await api.a.post(f"/v1/conversations/{conversation}/runs", json={
                "content": "x", "params": tool_params("t.echo_meta")})
            assert_error(response, 404, "not_found")
        long = await api.a.post(f"/v1/conversations/{theirs}/runs", json={
            "content": "x", "params": tool_params("t." + "x" * 100_000)})
        assert long.status_code in (404, 422), long.text
        assert len(long.text) < 2_000  # the name is not echoed back
    assert not [e for e in read_mcp_journal(journal) if e["event"] == "started"]
