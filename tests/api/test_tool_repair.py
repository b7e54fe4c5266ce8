"""A turn stopped around its tool call leaves a well-formed transcript (DESIGN §5): every assistant
tool call is answered by exactly one tool message (its result, or a `cancelled` one), so the next
turn's model request is never malformed, and that next turn completes.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any
from uuid import UUID

import asyncpg

from agentd.conversations import transcript_for_run
from tests.api.conftest import Api
from tests.api.helpers import FAST, WAIT_S, start_run, wait_run
from tests.support.factories import create_conversation
from tests.support.sse import iter_sse

ITERATIONS = 24
TOOL_TURN = {"tool": "calculator", "delay_ms": 200, "tokens": 50}  # ~10 s of answer after the tool
ANSWERED = ("complete", "cancelled")


def malformations(messages: list[dict[str, Any]]) -> list[str]:
    """What a provider would reject in this chat transcript (empty when well-formed).

    Each assistant message with tool_calls must be followed at once by one tool message per call
    id (in any order, nothing else in between), each complete or cancelled; no tool message may
    answer a call that is not open.
    """
    problems = []
    open_calls: dict[str, int] = {}
    for index, message in enumerate(messages):
        role = message["role"]
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in open_calls:
                problems.append(f"#{index}: tool result for {call_id!r}, which no open call made")
                continue
            del open_calls[call_id]
            if message.get("status", "complete") not in ANSWERED:
                problems.append(f"#{index}: tool result status {message['status']!r}")
            continue
        if open_calls:
            problems.append(f"#{index}: {role} message while calls {sorted(open_calls)} "
                            f"have no result")
            open_calls.clear()
        if role == "assistant" and message.get("tool_calls"):
            open_calls = {call["id"]: index for call in message["tool_calls"]}
    if open_calls:
        problems.append(f"end: calls {sorted(open_calls)} have no result")
    return problems


async def model_request(api: Api, conversation_id: str, run_id: str) -> list[dict[str, Any]]:
    """The transcript the worker gives the model for this run (the function it calls)."""
    user_message_id = await api.pool.fetchval(
        "SELECT user_message_id FROM agent_run WHERE id = $1", UUID(run_id))
    rows = await transcript_for_run(api.pool, UUID(conversation_id), user_message_id)
    return [{"role": r["role"], "tool_calls": r["tool_calls"], "tool_call_id": r["tool_call_id"]}
            for r in rows]


async def stop_around_tool_call(api: Api, conversation_id: str, run_id: str,
                                events_after_call: int) -> list[Any]:
    """Follow the run's stream; stop the conversation `events_after_call` events after the
    tool_call arrives; return every event through `complete`."""
    events: list[Any] = []
    stop_at: int | None = None
    async with api.a.stream("GET", f"/v1/runs/{run_id}/events") as stream:
        assert stream.status_code == 200
        async for event in iter_sse(stream):
            events.append(event)
            if event.event == "tool_call" and stop_at is None:
                stop_at = len(events) + events_after_call
            if stop_at is not None and len(events) == stop_at:
                stopped = await api.a.post(f"/v1/conversations/{conversation_id}/stop")
                assert stopped.status_code == 202, stopped.text
            if event.event == "complete":
                break
    assert stop_at is not None, [e.event for e in events]
    return events


async def test_turns_stopped_around_a_tool_call_leave_well_formed_transcripts(api: Api):
    seed = int.from_bytes(os.urandom(4), "big")
    rng = random.Random(seed)
    conversation_id = await create_conversation(api.a, "tool repair")
    stopped = 0
    for iteration in range(ITERATIONS):
        where = f"iteration {iteration} (seed {seed})"
        # Half the stops land as the call is seen; the rest up to three events later.
        after = 0 if iteration % 2 == 0 else rng.randint(1, 3)
        turn = await start_run(api.a, conversation_id, f"turn {iteration}: what is 6 * 7?",
                               TOOL_TURN)
        events = await stop_around_tool_call(api, conversation_id, turn["run_id"], after)

        complete = events[-1].data
        assert complete["status"] == "cancelled", f"{where}: {complete}"
        calls = [e.data["call_id"] for e in events if e.event == "tool_call"]
        results = [e.data["call_id"] for e in events if e.event == "tool_result"]
        assert calls and sorted(results) == sorted(calls), f"{where}: {calls} vs {results}"

        state = (await api.a.get(f"/v1/conversations/{conversation_id}")).json()
        assert not malformations(state["messages"]), \
            f"{where}: {malformations(state['messages'])}\n{state['messages']}"
        cancelled = [m for m in state["messages"] if m["role"] == "tool"
                     and m["status"] == "cancelled"]
        for message in cancelled:
            assert message["content"] and "cancelled" in message["content"], message

        follow_up = await start_run(api.a, conversation_id, f"and after {iteration}?", FAST)
        done = await wait_run(api.a, follow_up["run_id"], within_s=WAIT_S)
        assert done["status"] == "completed", f"{where}: {done}"
        request = await model_request(api, conversation_id, follow_up["run_id"])
        assert not malformations(request), f"{where}: {malformations(request)}\n{request}"
        assert sum(1 for m in request if m["tool_calls"]) == iteration + 1, where
        stopped += 1

    assert stopped == ITERATIONS
    final = (await api.a.get(f"/v1/conversations/{conversation_id}")).json()
    assert not malformations(final["messages"])
    assert final["runs"] == [] and final["lease"] is None


async def test_turn_cancelled_while_its_tool_runs_gets_a_cancelled_result(api: Api, dsn: str):
    """Deterministic: the `notes` tool's write is held on a table lock, so the stop lands while
    the call is open; the turn must journal and store a `cancelled` result for it."""
    conversation_id = await create_conversation(api.a, "held tool")
    gate = await asyncpg.connect(dsn)
    try:
        for iteration in range(3):
            holding = gate.transaction()
            await holding.start()
            await gate.execute("LOCK TABLE conversation_note_fence IN EXCLUSIVE MODE")
            try:
                turn = await start_run(api.a, conversation_id, f"note {iteration}",
                                       {"tool": "notes", "tokens": 5, "delay_ms": 0})
                events = await stop_around_tool_call(api, conversation_id, turn["run_id"], 0)
            finally:
                await holding.rollback()
            assert events[-1].data["status"] == "cancelled", events[-1]
            [call] = [e.data for e in events if e.event == "tool_call"]
            [result] = [e.data for e in events if e.event == "tool_result"]
            assert result["call_id"] == call["call_id"] and result["error"] == "cancelled"

            messages = (await api.a.get(f"/v1/conversations/{conversation_id}")).json()[
                "messages"]
            assert not malformations(messages), messages
            [tool] = [m for m in messages if m.get("tool_call_id") == call["call_id"]]
            assert tool["status"] == "cancelled" and tool["run_id"] == turn["run_id"]
            assert json.loads(tool["content"]) == {"error": "cancelled"}

            follow_up = await start_run(api.a, conversation_id, f"after note {iteration}", FAST)
            assert (await wait_run(api.a, follow_up["run_id"]))["status"] == "completed"
            request = await model_request(api, conversation_id, follow_up["run_id"])
            assert not malformations(request), request
        # The held writes were cancelled, not merely delayed: the notebook stayed empty.
        assert await api.pool.fetchval("SELECT count(*) FROM conversation_note") == 0
    finally:
        await gate.close()


def test_the_transcript_check_itself_catches_what_a_provider_rejects():
    call = {"role": "assistant", "tool_calls": [{"id": "a"}, {"id": "b"}]}
    answered = [{"role": "tool", "tool_call_id": "b", "status": "cancelled"},
                {"role": "tool", "tool_call_id": "a", "status": "complete"}]
    assert malformations([{"role": "user"}, call, *answered, {"role": "assistant"}]) == []
    assert malformations([call, answered[0], {"role": "user"}])  # "a" never answered
    assert malformations([call])  # nothing answered at the end
    assert malformations([call, *answered, answered[0]])  # "b" answered twice
    assert malformations([{"role": "tool", "tool_call_id": "x"}])  # an orphan result
    assert malformations([call, {"role": "tool", "tool_call_id": "a", "status": "partial"},
                          answered[0]])
