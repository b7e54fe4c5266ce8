"""A tool step's writes survive a lost answer: the write commits, the link to PostgreSQL breaks
before its answer (a relay withholds it: tests/support/lost_answers.py), and the worker runs it
again, as it does a journal append. Each such write is idempotent, so the retry finds what the
first attempt wrote instead of writing it twice. Before, the turn failed.
"""

from __future__ import annotations

from uuid import UUID

import asyncpg
import pytest

from agentd.approvals import DuplicateCall, request_approval
from agentd.queue import claim_runs
from tests.api.helpers import start_run, wait_run
from tests.support.factories import create_conversation, enqueue, new_tenant
from tests.support.lost_answers import AnswerCutter
from tests.tools.test_approvals import calc

# 987654321 + 1: the result appears in nothing the turn writes before its tool result.
EXPRESSION, RESULT = "987654321 + 1", b"987654322"


async def test_a_tool_result_whose_answer_was_lost_is_written_once(
        start_tools_api, dsn: str, pool: asyncpg.Pool) -> None:
    async with AnswerCutter(dsn) as cutter, start_tools_api({}, dsn=cutter.dsn) as api:
        conversation = await create_conversation(api.a)
        cutter.cut(RESULT)
        run = await start_run(api.a, conversation, "compute", calc(EXPRESSION))
        done = await wait_run(api.a, run["run_id"])
        assert cutter.cut_done.is_set(), "the relay never cut the tool result's answer"
        assert (done["status"], done.get("error")) == ("completed", None), done
        messages = await pool.fetch(
            "SELECT role, content, tool_calls IS NOT NULL AS calls FROM message"
            " WHERE run_id = $1 AND role IN ('assistant', 'tool')", UUID(run["run_id"]))
        tools = [m for m in messages if m["role"] == "tool"]
        assert len(tools) == 1, [dict(m) for m in messages]
        assert RESULT.decode() in tools[0]["content"]
        assert len([m for m in messages if m["calls"]]) == 1, [dict(m) for m in messages]


async def test_an_approval_asked_again_by_its_own_execution_is_the_one_recorded(
        pool: asyncpg.Pool) -> None:
    """The retry's statement after a first attempt that committed: the same call of the same
    execution gets the approval recorded; another call under that id is still refused."""
    tenant = await new_tenant(pool)
    await enqueue(pool, tenant.account_id, tenant.conversation_id, "go")
    [claim] = await claim_runs(pool, worker_id="approvals", lease_ttl_s=30)
    args = {"expression": EXPRESSION}
    first = await request_approval(pool, claim, call_id="call-1", tool="calculator",
                                   arguments=args, timeout_s=60)
    again = await request_approval(pool, claim, call_id="call-1", tool="calculator",
                                   arguments=args, timeout_s=60)
    assert again == first
    assert await pool.fetchval("SELECT count(*) FROM tool_approval WHERE run_id = $1",
                               claim.run_id) == 1
    with pytest.raises(DuplicateCall):
        await request_approval(pool, claim, call_id="call-1", tool="calculator",
                               arguments={"expression": "1 + 1"}, timeout_s=60)
