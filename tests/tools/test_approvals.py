"""Tool approvals through a real daemon: any device of the account decides, the first decision
wins (raced for real from independent clients), every attached device sees who decided, a
timeout denies, a stop cancels and repairs, other accounts get 404s.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx

from agentd.accounts import create_device_token
from tests.api.helpers import assert_error, start_run, wait_run
from tests.support.daemon import poll_until
from tests.support.factories import create_conversation
from tests.support.sse import read_sse
from tests.tools.conftest import mcp_test_server, run_events

ASK_CALCULATOR = {"calculator": "ask"}
RACE_ITERATIONS = 20


def calc(expression: str = "6 * 7", **extra: Any) -> dict[str, Any]:
    return {"tool": "calculator", "tool_args": {"expression": expression}, "tokens": 3,
            "delay_ms": 0, **extra}


async def pending_call(client: httpx.AsyncClient, run_id: str) -> dict[str, Any]:
    """The run's approval once the worker has asked (polled for)."""

    async def asked() -> dict[str, Any] | None:
        response = await client.get(f"/v1/runs/{run_id}/approvals")
        assert response.status_code == 200, response.text
        approvals = response.json()["approvals"]
        return approvals[0] if approvals else None

    return await poll_until(asked, 30, interval=0.02, what="the approval request")


def decide(client: httpx.AsyncClient, run_id: str, call_id: str, decision: str,
           **extra: Any) -> Any:
    return client.post(f"/v1/runs/{run_id}/approvals/{call_id}",
                       json={"decision": decision, **extra})


async def answer_at(gate: asyncio.Event, client: httpx.AsyncClient, run_id: str,
                    call_id: str, decision: str) -> httpx.Response:
    """One device's answer, sent the moment the gate opens (both racers wait at it)."""
    await gate.wait()
    return await decide(client, run_id, call_id, decision)


async def second_device(api: Any, name: str = "desktop") -> httpx.AsyncClient:
    token, _ = await create_device_token(api.pool, account="alice", device=name)
    return api.client(token)


def feed(client: httpx.AsyncClient, conversation: str, run_id: str) -> asyncio.Task[Any]:
    """A device attached to the conversation, reading its feed until the run completes."""
    return asyncio.create_task(read_sse(
        client, f"/v1/conversations/{conversation}/events",
        stop_after=lambda e: e.event == "complete" and e.data.get("run_id") == run_id))


async def test_two_devices_attached_one_approves_and_both_see_who(start_tools_api) -> None:
    async with start_tools_api({}, tools=ASK_CALCULATOR) as api, \
            await second_device(api) as desktop:
        conversation = await create_conversation(api.a)
        run = await start_run(api.a, conversation, "compute", calc())
        run_id = run["run_id"]
        laptop_feed, desktop_feed = feed(api.a, conversation, run_id), \
            feed(desktop, conversation, run_id)

        async def both_attached() -> bool:
            # Attached after its snapshot, which holds the run while it waits for approval:
            # from here each feed is owed the run's `complete`. A feed that attached only after
            # the run ended would see it ended in its snapshot instead, and no `complete`.
            state = (await api.a.get(f"/v1/conversations/{conversation}")).json()
            return len(state["attached"]) == 2 or laptop_feed.done() or desktop_feed.done()

        await poll_until(both_attached, 30, interval=0.05, what="both devices attached")
        call = await pending_call(desktop, run_id)
        assert call["tool"] == "calculator" and call["decision"] is None
        assert call["arguments"] == {"expression": "6 * 7"}
        answer = await decide(desktop, run_id, call["call_id"], "approve", note="fine")
        assert answer.status_code == 200, answer.text
        assert answer.json()["device"] == "desktop" and answer.json()["decision"] == "approve"
        done = await wait_run(api.a, run_id)
        assert done["status"] == "completed", done
        for events in await asyncio.gather(laptop_feed, desktop_feed):
            by_type = {e.event: e.data for e in events if e.data.get("run_id") == run_id}
            requested = by_type["approval_requested"]
            assert requested["tool"] == "calculator" and requested["device"] == "laptop"
            assert requested["arguments"] == {"expression": "6 * 7"}
            decided = by_type["approval_decided"]
            assert (decided["decision"], decided["device"], decided["note"]) == \
                ("approve", "desktop", "fine")
            assert by_type["tool_result"]["result"] == {"expression": "6 * 7", "value": 42}
        # A late answer from the other device is refused, naming who decided.
        late = await decide(api.a, run_id, call["call_id"], "deny")
        error = assert_error(late, 409, "approval_already_decided")
        assert error["device"] == "desktop" and "desktop" in error["message"]


async def test_both_devices_answer_at_once_exactly_one_decision_lands(start_tools_api) -> None:
    async with start_tools_api({}, tools=ASK_CALCULATOR) as api, \
            await second_device(api) as desktop:
        conversation = await create_conversation(api.a)
        for i in range(RACE_ITERATIONS):
            run = await start_run(api.a, conversation, f"race {i}", calc(f"{i} + 1"))
            run_id = run["run_id"]
            call_id = (await pending_call(api.a, run_id))["call_id"]
            gate = asyncio.Event()

            racing = [asyncio.create_task(answer_at(gate, api.a, run_id, call_id, "approve")),
                      asyncio.create_task(answer_at(gate, desktop, run_id, call_id, "deny"))]
            await asyncio.sleep(0)  # both are parked at the gate
            gate.set()
            laptop, other = await asyncio.gather(*racing)
            assert sorted([laptop.status_code, other.status_code]) == [200, 409], \
                (laptop.text, other.text)
            winner = laptop if laptop.status_code == 200 else other
            loser = other if winner is laptop else laptop
            decision = winner.json()["decision"]
            error = assert_error(loser, 409, "approval_already_decided")
            assert error["device"] == winner.json()["device"]
            assert error["decision"] == decision
            done = await wait_run(api.a, run_id)
            assert done["status"] == "completed", done
            rows = await api.pool.fetch("SELECT decision FROM tool_approval WHERE run_id = $1",
                                        UUID(run_id))
            assert [r["decision"] for r in rows] == [decision]
            journaled = [e for e in await run_events(api.a, run_id)
                         if e["type"] == "approval_decided"]
            assert [(e["decision"], e["device"]) for e in journaled] == \
                [(decision, winner.json()["device"])]


async def test_a_device_revoked_after_its_token_was_checked_decides_nothing(
        start_tools_api) -> None:
    """The decision waits on the device's row while a revocation commits: it must not land in
    the revoked device's name (the statement did not look at the device at all)."""
    async with start_tools_api({}, tools=ASK_CALCULATOR) as api:
        token, device_id = await create_device_token(api.pool, account="alice", device="phone")
        async with api.client(token) as phone:
            conversation = await create_conversation(api.a)
            run = await start_run(api.a, conversation, "ask", calc())
            run_id = run["run_id"]
            call_id = (await pending_call(phone, run_id))["call_id"]  # marks the phone seen
            async with api.pool.acquire() as conn:
                revoking = conn.transaction()
                await revoking.start()
                await conn.execute("SELECT 1 FROM device WHERE id = $1 FOR UPDATE", device_id)
                answer = asyncio.create_task(decide(phone, run_id, call_id, "approve"))
                await poll_until(lambda: api.pool.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND query LIKE '%decider%'"), 10, what="the decision waiting on the device")
                await conn.execute("UPDATE device SET revoked_at = clock_timestamp()"
                                   " WHERE id = $1", device_id)
                await revoking.commit()
            assert_error(await answer, 401, "device_revoked")
        assert await api.pool.fetchval("SELECT decision FROM tool_approval WHERE run_id = $1",
                                       UUID(run_id)) is None
        # Another device of the account still decides it.
        decided = await decide(api.a, run_id, call_id, "approve")
        assert decided.status_code == 200, decided.text
        assert (await wait_run(api.a, run_id))["status"] == "completed"


async def test_undecided_past_the_timeout_is_denied(start_tools_api) -> None:
    async with start_tools_api({}, tools=ASK_CALCULATOR, approval_timeout_s=1) as api:
        conversation = await create_conversation(api.a)
        run = await start_run(api.a, conversation, "nobody answers", calc())
        done = await wait_run(api.a, run["run_id"])
        assert done["status"] == "completed", done
        events = await run_events(api.a, run["run_id"])
        decided = next(e for e in events if e["type"] == "approval_decided")
        assert (decided["decision"], decided["timed_out"], decided["device"]) == \
            ("deny", True, None)
        result = next(e for e in events if e["type"] == "tool_result")
        assert result["error"] == "not run: no device decided within 1 s, so it was denied"
        late = await decide(api.a, run["run_id"], decided["call_id"], "approve")
        error = assert_error(late, 409, "approval_already_decided")
        assert error["timed_out"] is True


async def test_an_approval_wait_does_not_count_against_the_turn_deadline(
        start_tools_api) -> None:
    """A person's time is not the turn's: with the approval timeout longer than max_run_s,
    nobody answering still ends in the documented denial the model reads, and the turn goes
    on. Before, the turn's deadline (counted from its start) always came first: the turn
    failed `deadline_exceeded` and the approval stayed pending."""
    async with start_tools_api({}, tools=ASK_CALCULATOR, max_run_s=2,
                               approval_timeout_s=4) as api:
        conversation = await create_conversation(api.a)
        run = await start_run(api.a, conversation, "nobody answers", calc())
        done = await wait_run(api.a, run["run_id"], within_s=30)
        assert done["status"] == "completed", done
        events = await run_events(api.a, run["run_id"])
        decided = next(e for e in events if e["type"] == "approval_decided")
        assert (decided["decision"], decided["timed_out"]) == ("deny", True)
        result = next(e for e in events if e["type"] == "tool_result")
        assert result["error"] == "not run: no device decided within 4 s, so it was denied"


async def test_stop_while_waiting_cancels_and_repairs_the_call(start_tools_api) -> None:
    async with start_tools_api({}, tools=ASK_CALCULATOR) as api:
        conversation = await create_conversation(api.a)
        run = await start_run(api.a, conversation, "stop me", calc())
        call = await pending_call(api.a, run["run_id"])
        assert call["pending"] is True
        stopped = await api.a.post(f"/v1/conversations/{conversation}/stop")
        assert stopped.status_code == 202, stopped.text
        done = await wait_run(api.a, run["run_id"])
        assert done["status"] == "cancelled", done
        state = (await api.a.get(f"/v1/conversations/{conversation}")).json()
        tools = [m for m in state["messages"] if m["role"] == "tool"]
        assert [(m["tool_call_id"], m["status"], json.loads(m["content"])) for m in tools] == \
            [(call["call_id"], "cancelled", {"error": "not run: the turn was stopped while the "
                                                      "call waited for approval"})]
        late = await decide(api.a, run["run_id"], call["call_id"], "approve")
        assert_error(late, 409, "approval_not_pending")
        # Left undecided by the stop, it is listed as such, not as a question still open (it
        # looked exactly like one before).
        [left] = (await api.a.get(f"/v1/runs/{run['run_id']}/approvals")).json()["approvals"]
        assert (left["call_id"], left["decision"], left["pending"]) == (
            call["call_id"], None, False)
        # The next turn's model request is well-formed: it runs.
        after = await start_run(api.a, conversation, "next")
        assert (await wait_run(api.a, after["run_id"]))["status"] == "completed"


async def test_denied_call_gives_the_model_a_result_saying_so(start_tools_api) -> None:
    async with start_tools_api({}, tools=ASK_CALCULATOR) as api:
        conversation = await create_conversation(api.a)
        run = await start_run(api.a, conversation, "deny me", calc())
        call = await pending_call(api.a, run["run_id"])
        answer = await decide(api.a, run["run_id"], call["call_id"], "deny", note="not today")
        assert answer.status_code == 200, answer.text
        await wait_run(api.a, run["run_id"])
        result = next(e for e in await run_events(api.a, run["run_id"])
                      if e["type"] == "tool_result")
        assert result["error"] == "not run: denied by laptop: not today"


async def test_other_accounts_and_bad_requests_get_clear_4xx(start_tools_api) -> None:
    async with start_tools_api({}, tools=ASK_CALCULATOR) as api:
        conversation = await create_conversation(api.a)
        run = await start_run(api.a, conversation, "mine", calc())
        run_id = run["run_id"]
        call_id = (await pending_call(api.a, run_id))["call_id"]
        path = f"/v1/runs/{run_id}/approvals/{call_id}"
        assert_error(await api.b.post(path, json={"decision": "approve"}), 404, "not_found")
        assert_error(await api.b.get(f"/v1/runs/{run_id}/approvals"), 404, "not_found")
        assert_error(await api.a.post(f"/v1/runs/{run_id}/approvals/nope",
                                      json={"decision": "approve"}), 404, "approval_not_found")
        assert_error(await api.a.post(f"/v1/runs/not-a-uuid/approvals/{call_id}",
                                      json={"decision": "approve"}), 404, "not_found")
        for body, status, code in (
                ({"decision": "maybe"}, 422, "invalid_decision"),
                ({}, 422, "invalid_decision"),
                ({"decision": "approve", "note": 5}, 422, "invalid_note"),
                ({"decision": "approve", "note": "x" * 2001}, 422, "invalid_note"),
                ({"decision": "approve", "extra": 1}, 400, "unknown_field"),
                ([], 400, "invalid_body")):
            assert_error(await api.a.post(path, json=body), status, code)
        assert_error(await api.a.post(path, content=b"{nope"), 400, "invalid_json")
        # Nothing above decided it: the owner still can.
        assert (await decide(api.a, run_id, call_id, "approve")).status_code == 200
        assert (await wait_run(api.a, run_id))["status"] == "completed"


async def test_mcp_tools_ask_by_default_and_deny_is_never_run(start_tools_api,
                                                              journal: Path) -> None:
    servers = {"t": mcp_test_server(journal, tools={"crash": "deny"})}
    async with start_tools_api(servers) as api:
        conversation = await create_conversation(api.a)
        run = await start_run(api.a, conversation, "echo", {
            "tool": "t.echo_meta", "tool_args": {"text": "asked"}, "tokens": 3, "delay_ms": 0})
        call = await pending_call(api.a, run["run_id"])
        assert call["tool"] == "t.echo_meta"
        assert (await decide(api.a, run["run_id"], call["call_id"], "approve")).status_code == 200
        assert (await wait_run(api.a, run["run_id"]))["status"] == "completed"
        run = await start_run(api.a, conversation, "crash", {
            "tool": "t.crash", "tool_args": {}, "tokens": 3, "delay_ms": 0})
        assert (await wait_run(api.a, run["run_id"]))["status"] == "completed"
        result = next(e for e in await run_events(api.a, run["run_id"])
                      if e["type"] == "tool_result")
        assert result["error"] == "not run: the approval policy of t.crash is deny"
        listed = await api.a.get(f"/v1/runs/{run['run_id']}/approvals")
        assert listed.json() == {"approvals": []}
