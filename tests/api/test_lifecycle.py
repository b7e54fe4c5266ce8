"""The life cycle of a conversation over the API: models, fork, retry and edit, archive, delete and
usage, each with its bad input (4xx with a stable code that changes nothing) and its frames on the
conversation feed, so every attached device follows without reloading.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from typing import Any
from uuid import UUID

import httpx

from agentd import queue
from agentd.providers.demo import expected_answer
from agentd.queries import Q
from tests.api.conftest import Api, started_api
from tests.api.helpers import (
    FAST,
    SLOW,
    WAIT_S,
    assert_error,
    assert_json,
    assert_message,
    assert_time,
    assert_uuid,
    db_state,
    start_run,
    wait_run,
)
from tests.support.daemon import poll_until
from tests.support.factories import create_conversation
from tests.support.sse import iter_sse, read_sse

TWO_DEMO_MODELS = {"AGENTD_DEMO_MODELS": "demo,echo"}
SECRET_KEY = "sk-lifecycle-never-shown-3f9a"


async def state(api: Api, conversation_id: str) -> dict[str, Any]:
    response = await api.a.get(f"/v1/conversations/{conversation_id}")
    assert response.status_code == 200, response.text
    return response.json()


async def finished_turn(api: Api, conversation_id: str, content: str,
                        params: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    run = await start_run(api.a, conversation_id, content, params, **fields)
    return await wait_run(api.a, run["run_id"])


async def model_sees(api: Api, conversation_id: str, run_id: str) -> list[tuple[str, str]]:
    """(role, content) of what the worker gives the model for this run (its own statement; the
    run's own output, written since, cut off), checked against the input tokens the demo model
    counted when it ran: one per word of every message it was given."""
    asked = await api.pool.fetchval("SELECT user_message_id FROM agent_run WHERE id = $1",
                                    UUID(run_id))
    rows = await api.pool.fetch(*Q.transcript_for_run.bind(conversation_id=UUID(conversation_id),
                                                           user_message_id=asked))
    seen = [(r["role"], r["content"]) for r in rows]
    question = max(i for i, (role, _) in enumerate(seen) if role == "user")
    seen = seen[:question + 1]
    usage = (await api.a.get(f"/v1/runs/{run_id}")).json()["usage"]
    assert usage["input_tokens"] == sum(len(content.split()) for _, content in seen), seen
    return seen


class Feed:
    """A device attached to a conversation feed (or, given `path`, any event stream): frames
    land in a queue as they arrive; entering waits for the first one, so the stream is open."""

    def __init__(self, client: httpx.AsyncClient, conversation_id: str = "",
                 path: str | None = None) -> None:
        self.client = client
        self.path = path or f"/v1/conversations/{conversation_id}/events"
        self.frames: asyncio.Queue[Any] = asyncio.Queue()
        self.seen: list[Any] = []
        self.ended = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Feed:
        self._task = asyncio.create_task(self._read())
        async with asyncio.timeout(WAIT_S):
            first = await self.frames.get()
        self.seen.append(first)
        if self.path.startswith("/v1/conversations/"):
            assert first.event == "snapshot"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _read(self) -> None:
        try:
            async with self.client.stream("GET", self.path) as response:
                assert response.status_code == 200
                async for frame in iter_sse(response):
                    await self.frames.put(frame)
        finally:
            self.ended.set()

    async def next(self, event: str, where: Any = None) -> Any:
        """The next frame of this type (and matching `where`), skipping others."""
        async with asyncio.timeout(WAIT_S):
            while True:
                frame = await self.frames.get()
                self.seen.append(frame)
                if frame.event == event and (where is None or where(frame.data)):
                    return frame


# -- models -----------------------------------------------------------------------------------


async def test_models_lists_every_offer_with_kind_and_whether_usable_without_secrets(
        spawn_daemon, pool) -> None:
    env = {"AGENTD_OPENAI_API_KEY_ENV": "LIFECYCLE_KEY", "LIFECYCLE_KEY": SECRET_KEY,
           "AGENTD_OPENAI_MODELS": "gpt-4o-mini,llama3.2:1b",
           "AGENTD_LOCAL_MODEL_PATH": "/nowhere/model-file.gguf"}
    async with started_api(spawn_daemon, pool, env=env) as api:
        response = await api.a.get("/v1/models")
        assert response.status_code == 200
        body = assert_json(response)
    assert body["default_model"] == "demo"
    offers = {m["name"]: m for m in body["models"]}
    assert {"demo", "openai:gpt-4o-mini", "openai:llama3.2:1b", "anthropic:claude-sonnet-4-0",
            "local:model-file"} <= set(offers), sorted(offers)
    assert offers["demo"] == {"name": "demo", "provider": "demo", "kind": "demo",
                              "usable": True, "reason": None}
    assert offers["openai:llama3.2:1b"]["usable"] is True
    assert offers["openai:gpt-4o-mini"]["kind"] == "openai"
    anthropic = offers["anthropic:claude-sonnet-4-0"]
    assert anthropic["usable"] is False and "API key" in anthropic["reason"]
    assert offers["local:model-file"]["usable"] is False and offers["local:model-file"]["reason"]
    for offer in body["models"]:
        reason = offer["reason"] or ""
        for secret in ("API_KEY", "LIFECYCLE_KEY", SECRET_KEY, "://", "/nowhere", ".gguf"):
            assert secret not in reason, offer


async def test_a_conversations_model_is_set_at_creation_or_by_patch_and_its_runs_use_it(
        spawn_daemon, pool) -> None:
    async with started_api(spawn_daemon, pool, env=TWO_DEMO_MODELS) as api:
        created = await api.a.post("/v1/conversations", json={"title": "m", "model": "demo:echo"})
        assert created.status_code == 201
        conversation = created.json()
        assert conversation["model"] == "demo:echo"
        cid = conversation["id"]
        async with Feed(api.a, cid) as mine, Feed(api.a, cid) as other_device:
            run = await finished_turn(api, cid, "which model?", {"tokens": 4, "delay_ms": 0})
            assert run["model"] == "demo:echo"
            answer = (await state(api, cid))["messages"][-1]
            assert answer["content"] == expected_answer("echo", "which model?", 4)

            cleared = await api.a.patch(f"/v1/conversations/{cid}", json={"model": None})
            assert cleared.status_code == 200 and cleared.json()["model"] is None
            for feed in (mine, other_device):  # every attached device hears it, live
                frame = await feed.next("conversation",
                                        lambda d: d["conversation"]["model"] is None)
                assert frame.data["conversation"]["id"] == cid
            back = await finished_turn(api, cid, "and now?", {"tokens": 4, "delay_ms": 0})
            assert back["model"] == "demo"

            await api.a.patch(f"/v1/conversations/{cid}", json={"model": "demo:echo"})
            await other_device.next("conversation",
                                    lambda d: d["conversation"]["model"] == "demo:echo")
            explicit = await finished_turn(api, cid, "this one", {"tokens": 2, "delay_ms": 0},
                                           model="demo")
            assert explicit["model"] == "demo"  # a run's own model beats the conversation's
        assert (await state(api, cid))["model"] == "demo:echo"


async def test_an_unusable_model_is_refused_at_enqueue_naming_it_and_nothing_is_written(
        spawn_daemon, pool) -> None:
    keyed = {"OPENAI_API_KEY": SECRET_KEY, "AGENTD_OPENAI_MODELS": "gpt-4o-mini"}
    async with started_api(spawn_daemon, pool, env=keyed) as api:
        cid = await create_conversation(api.a)
        chosen = await api.a.patch(f"/v1/conversations/{cid}",
                                   json={"model": "openai:gpt-4o-mini"})
        assert chosen.status_code == 200, chosen.text
    # The key is gone on the next daemon (rotated, unset): that model cannot run any more.
    # (A default_model not on offer no longer gets this far: serve refuses it at start,
    # tests/process/test_cli.py.)
    async with started_api(spawn_daemon, pool,
                           env={"AGENTD_OPENAI_MODELS": "gpt-4o-mini"}) as api:
        before = await db_state(pool)
        refused = await api.a.post(f"/v1/conversations/{cid}/runs", json={"content": "hi"})
        error = assert_error(refused, 422, "model_unavailable")
        assert "openai:gpt-4o-mini" in error["message"] and error["model"] == "openai:gpt-4o-mini"
        assert SECRET_KEY not in refused.text and "OPENAI_API_KEY" not in refused.text
        assert await db_state(pool) == before


# -- fork ---------------------------------------------------------------------------------------


async def test_fork_copies_the_transcript_up_to_a_message_and_leaves_the_original_alone(
        api: Api) -> None:
    cid = await create_conversation(api.a, "origin")
    await finished_turn(api, cid, "first question")
    await finished_turn(api, cid, "second question")
    original = await state(api, cid)
    first_answer = original["messages"][1]

    response = await api.a.post(f"/v1/conversations/{cid}/fork",
                                json={"message_id": first_answer["id"]})
    assert response.status_code == 201, response.text
    fork = assert_json(response)
    fork_id = str(assert_uuid(fork["id"]))
    assert response.headers["Location"] == f"/v1/conversations/{fork_id}"
    assert fork["title"] == "origin (fork)" and fork["copied_messages"] == 2
    assert fork["forked_from"] == {"conversation_id": cid, "message_id": first_answer["id"]}
    assert_time(fork["created_at"])

    copy = await state(api, fork_id)
    assert [(m["role"], m["content"], m["status"]) for m in copy["messages"]] == [
        (m["role"], m["content"], m["status"]) for m in original["messages"][:2]]
    assert {m["id"] for m in copy["messages"]}.isdisjoint(m["id"] for m in original["messages"])
    for message in copy["messages"]:
        assert_message(message)
    assert await state(api, cid) == original  # untouched

    # The copy is a conversation of its own: its next turn sees only what was copied.
    follow = await finished_turn(api, fork_id, "a different second question")
    assert follow["status"] == "completed"
    assert await model_sees(api, fork_id, follow["id"]) == [
        ("user", "first question"), ("assistant", first_answer["content"]),
        ("user", "a different second question")]
    listed = [c["id"] for c in (await api.a.get("/v1/conversations")).json()["conversations"]]
    assert fork_id in listed and cid in listed


async def test_fork_never_splits_a_tool_call_from_its_result(api: Api) -> None:
    cid = await create_conversation(api.a, "tools")
    await finished_turn(api, cid, "what is 6 * 7?",
                        {"tokens": 3, "delay_ms": 0, "tool": "calculator"})
    messages = (await state(api, cid))["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    call = messages[1]
    assert call["tool_calls"]

    response = await api.a.post(f"/v1/conversations/{cid}/fork", json={"message_id": call["id"]})
    assert response.status_code == 201, response.text
    copy = (await state(api, response.json()["id"]))["messages"]
    assert [m["role"] for m in copy] == ["user", "assistant", "tool"]
    assert copy[2]["tool_call_id"] == call["tool_calls"][0]["id"] == messages[2]["tool_call_id"]
    assert copy[1]["tool_calls"] == call["tool_calls"]


async def test_a_forked_conversation_pages_by_whole_turns_and_forks_again_whole(
        api: Api) -> None:
    """A fork's copies belong to no run. Each used to count as a turn of its own: a page of
    one could begin with an answer whose question was on the next page, and forking a fork at
    a tool call left its result behind. Both now group copies by the question they follow."""
    cid = await create_conversation(api.a, "paged")
    await finished_turn(api, cid, "first question")
    await finished_turn(api, cid, "what is 6 * 7?",
                        {"tokens": 3, "delay_ms": 0, "tool": "calculator"})
    await finished_turn(api, cid, "third question")
    original = (await state(api, cid))["messages"]
    assert [m["role"] for m in original] == ["user", "assistant", "user", "assistant", "tool",
                                             "assistant", "user", "assistant"]
    forked = await api.a.post(f"/v1/conversations/{cid}/fork",
                              json={"message_id": original[-1]["id"]})
    assert forked.status_code == 201, forked.text
    fork_id = forked.json()["id"]
    whole = (await state(api, fork_id))["messages"]
    assert [m["content"] for m in whole] == [m["content"] for m in original]

    # Pages of one message each, widened to whole turns, read back to the start.
    pages: list[list[str]] = []
    page = (await api.a.get(f"/v1/conversations/{fork_id}", params={"limit": 1})).json()
    pages.append([m["role"] for m in page["messages"]])
    while page["has_more"]:
        page = (await api.a.get(f"/v1/conversations/{fork_id}/messages",
                                params={"before": page["before"], "limit": 1})).json()
        pages.append([m["role"] for m in page["messages"]])
    assert pages == [["user", "assistant"], ["user", "assistant", "tool", "assistant"],
                     ["user", "assistant"]]
    # A jump to the copied tool result loads its whole turn.
    jump = await api.a.get(f"/v1/conversations/{fork_id}/messages",
                           params={"limit": 1, "until": whole[4]["id"]})
    assert [m["role"] for m in jump.json()["messages"]][:4] == ["user", "assistant", "tool",
                                                               "assistant"]

    # A fork of the fork at its copied tool call takes the call's result along.
    again = await api.a.post(f"/v1/conversations/{fork_id}/fork",
                             json={"message_id": whole[3]["id"]})
    assert again.status_code == 201, again.text
    copy = (await state(api, again.json()["id"]))["messages"]
    assert [m["role"] for m in copy] == ["user", "assistant", "user", "assistant", "tool"]
    assert copy[4]["tool_call_id"] == whole[3]["tool_calls"][0]["id"]


async def test_fork_works_while_a_turn_runs_and_copies_only_what_has_ended(api: Api) -> None:
    cid = await create_conversation(api.a)
    done = await finished_turn(api, cid, "finished turn")
    running = await start_run(api.a, cid, "running turn", SLOW)
    await wait_run(api.a, running["run_id"], ("running",))
    queued = await start_run(api.a, cid, "queued turn")
    messages = (await state(api, cid))["messages"]
    by_content = {m["content"]: m for m in messages if m["role"] == "user"}

    forked = await api.a.post(f"/v1/conversations/{cid}/fork",
                              json={"message_id": messages[1]["id"]})
    assert forked.status_code == 201, forked.text
    copy = (await state(api, forked.json()["id"]))["messages"]
    assert [m["content"] for m in copy] == ["finished turn", messages[1]["content"]]
    assert all(m["run_id"] is None for m in copy)

    before = await db_state(api.pool)
    for content in ("running turn", "queued turn"):
        refused = await api.a.post(f"/v1/conversations/{cid}/fork",
                                   json={"message_id": by_content[content]["id"]})
        error = assert_error(refused, 409, "message_not_forkable")
        assert error["message_id"] == by_content[content]["id"]
    assert await db_state(api.pool) == before
    run = (await api.a.get(f"/v1/runs/{running['run_id']}")).json()
    assert run["status"] == "running" and not run["cancel_requested"]
    assert done["status"] == "completed"
    await api.a.post(f"/v1/conversations/{cid}/stop")
    await wait_run(api.a, queued["run_id"])


async def test_fork_keeps_a_superseded_mark_only_with_what_replaced_it(api: Api) -> None:
    cid = await create_conversation(api.a, "branches")
    await finished_turn(api, cid, "the first try")
    retried = await api.a.post(f"/v1/conversations/{cid}/runs",
                               json={"retry_of": "last", "content": "the second try"})
    await wait_run(api.a, retried.json()["run_id"])
    messages = (await state(api, cid))["messages"]
    assert [bool(m["superseded_by"]) for m in messages] == [True, True, False, False]

    whole = await api.a.post(f"/v1/conversations/{cid}/fork",
                             json={"message_id": messages[3]["id"]})
    copy = (await state(api, whole.json()["id"]))["messages"]
    assert [m["content"] for m in copy] == [m["content"] for m in messages]
    # The marks point at the copy's own new question, not at the original's.
    assert [m["superseded_by"] for m in copy] == [copy[2]["id"], copy[2]["id"], None, None]

    # Forking from the old branch continues it: nothing in the copy replaced it.
    branch = await api.a.post(f"/v1/conversations/{cid}/fork",
                              json={"message_id": messages[1]["id"]})
    old = (await state(api, branch.json()["id"]))["messages"]
    assert [(m["content"], m["superseded_by"]) for m in old] == [
        (messages[0]["content"], None), (messages[1]["content"], None)]
    follow = await finished_turn(api, branch.json()["id"], "go on from there")
    assert await model_sees(api, branch.json()["id"], follow["id"]) == [
        ("user", "the first try"), ("assistant", messages[1]["content"]),
        ("user", "go on from there")]


async def test_fork_of_another_conversations_message_or_account_is_404_and_writes_nothing(
        api: Api) -> None:
    mine = await create_conversation(api.a, "mine")
    other = await create_conversation(api.a, "other")
    await finished_turn(api, other, "elsewhere")
    elsewhere = (await state(api, other))["messages"][0]["id"]
    bobs = await create_conversation(api.b, "bob's")
    before = await db_state(api.pool)

    assert_error(await api.a.post(f"/v1/conversations/{mine}/fork",
                                  json={"message_id": elsewhere}), 404, "not_found")
    assert_error(await api.b.post(f"/v1/conversations/{other}/fork",
                                  json={"message_id": elsewhere}), 404, "not_found")
    assert_error(await api.b.post(f"/v1/conversations/{bobs}/fork",
                                  json={"message_id": elsewhere}), 404, "not_found")
    assert await db_state(api.pool) == before


# -- retry and edit ------------------------------------------------------------------------------


async def test_retry_reruns_the_last_question_and_keeps_the_old_exchange_superseded(
        api: Api) -> None:
    cid = await create_conversation(api.a)
    first = await finished_turn(api, cid, "keep me", {"tokens": 3, "delay_ms": 0})
    failed = await finished_turn(api, cid, "try me again", {"tokens": 5, "delay_ms": 0,
                                                            "fail": 2})
    assert failed["status"] == "failed"
    old = (await state(api, cid))["messages"]
    old_question = next(m for m in old if m["run_id"] == failed["id"] and m["role"] == "user")

    async with Feed(api.a, cid) as feed:
        response = await api.a.post(f"/v1/conversations/{cid}/runs",
                                    json={"retry_of": old_question["id"],
                                          "params": {"tokens": 4, "delay_ms": 0}})
        assert response.status_code == 202, response.text
        retried = await wait_run(api.a, response.json()["run_id"])
        frame = await feed.next("conversation", lambda d: d["superseded"])
    assert retried["status"] == "completed"
    now = (await state(api, cid))["messages"]
    new_question = next(m for m in now if m["run_id"] == retried["id"] and m["role"] == "user")
    assert new_question["content"] == "try me again" and new_question["id"] != old_question["id"]
    superseded = {m["id"]: m["superseded_by"] for m in now if m["superseded_by"]}
    old_exchange = [m["id"] for m in old if m["run_id"] == failed["id"]]
    assert superseded == dict.fromkeys(old_exchange, new_question["id"])
    assert frame.data["superseded"] == superseded  # the other devices were told, live
    # Kept in the transcript, in place; the first turn untouched.
    assert [m["id"] for m in now[:len(old)]] == [m["id"] for m in old]
    assert all(m["superseded_by"] is None for m in now if m["run_id"] == first["id"])
    # The new run's model saw the first exchange and the new question, not the failed one.
    assert await model_sees(api, cid, retried["id"]) == [
        ("user", "keep me"), ("assistant", expected_answer("demo", "keep me", 3)),
        ("user", "try me again")]


async def test_edit_resends_new_text_and_retry_last_inherits_the_runs_params(api: Api) -> None:
    cid = await create_conversation(api.a)
    await finished_turn(api, cid, "a question with a typo", {"tokens": 3, "delay_ms": 0})
    edited = await api.a.post(f"/v1/conversations/{cid}/runs",
                              json={"retry_of": "last", "content": "a question, fixed"})
    assert edited.status_code == 202, edited.text
    run = await wait_run(api.a, edited.json()["run_id"])
    messages = (await state(api, cid))["messages"]
    assert [(m["content"], m["superseded_by"] is not None) for m in messages] == [
        ("a question with a typo", True), (expected_answer("demo", "a question with a typo", 3),
                                           True),
        ("a question, fixed", False), (expected_answer("demo", "a question, fixed", 3), False)]
    assert run["usage"]["output_tokens"] == 3  # the retried run's params came along
    assert await model_sees(api, cid, run["id"]) == [("user", "a question, fixed")]

    again = await api.a.post(f"/v1/conversations/{cid}/runs", json={"retry_of": "last"})
    assert again.status_code == 202, again.text
    await wait_run(api.a, again.json()["run_id"])
    live = [m for m in (await state(api, cid))["messages"] if not m["superseded_by"]]
    assert [m["content"] for m in live] == [
        "a question, fixed", expected_answer("demo", "a question, fixed", 3)]


async def test_a_retry_past_the_journals_retention_still_inherits_the_runs_params(
        api: Api) -> None:
    """Retention trims a finished run's events and the copy of its question in its request;
    its params and model stay, so a retry the next day runs as the retried turn did (the
    whole request was nulled, and a retry then ran on no params at all)."""
    cid = await create_conversation(api.a)
    first = await finished_turn(api, cid, "yesterday's question", {"tokens": 3, "delay_ms": 0})
    assert await queue.trim_journal(api.pool, older_than_s=0) >= 1
    request = json.loads(await api.pool.fetchval(
        "SELECT request::text FROM agent_run WHERE id = $1", UUID(first["id"])))
    assert "content" not in request
    assert request["params"] == {"tokens": 3, "delay_ms": 0} and request["model"]
    assert await api.pool.fetchval(
        "SELECT count(*) FROM run_event WHERE run_id = $1", UUID(first["id"])) == 0
    again = await api.a.post(f"/v1/conversations/{cid}/runs", json={"retry_of": "last"})
    assert again.status_code == 202, again.text
    run = await wait_run(api.a, again.json()["run_id"])
    assert run["usage"]["output_tokens"] == 3  # the retried run's params came along
    [old_answer] = [m for m in (await state(api, cid))["messages"]
                    if m["run_id"] == first["id"] and m["role"] == "assistant"]
    assert old_answer["model"] == request["model"]  # still shown beside the old answer


async def test_retry_after_a_cancel_and_replayed_under_its_idempotency_key(api: Api) -> None:
    cid = await create_conversation(api.a)
    slow = await start_run(api.a, cid, "stop me", SLOW)
    await wait_run(api.a, slow["run_id"], ("running",))
    await api.a.post(f"/v1/conversations/{cid}/stop")
    assert (await wait_run(api.a, slow["run_id"]))["status"] == "cancelled"

    body = {"retry_of": "last", "params": FAST}
    key = {"Idempotency-Key": f"retry-{uuid.uuid4()}"}
    first = await api.a.post(f"/v1/conversations/{cid}/runs", json=body, headers=key)
    assert first.status_code == 202, first.text
    again = await api.a.post(f"/v1/conversations/{cid}/runs", json=body, headers=key)
    assert again.status_code == 202 and again.headers["Idempotent-Replayed"] == "true"
    assert again.json()["run_id"] == first.json()["run_id"]
    changed = await api.a.post(f"/v1/conversations/{cid}/runs",
                               json={**body, "content": "other words"}, headers=key)
    assert_error(changed, 409, "idempotency_conflict")
    await wait_run(api.a, first.json()["run_id"])
    assert await api.pool.fetchval("SELECT count(*) FROM agent_run") == 2


async def test_retry_with_nothing_to_retry_is_409_with_a_code_and_changes_nothing(
        api: Api) -> None:
    empty = await create_conversation(api.a, "empty")
    cid = await create_conversation(api.a, "two turns")
    await finished_turn(api, cid, "older")
    await finished_turn(api, cid, "latest")
    messages = (await state(api, cid))["messages"]
    other = await create_conversation(api.a, "elsewhere")
    await finished_turn(api, other, "not here")
    elsewhere = (await state(api, other))["messages"][0]["id"]
    runs = f"/v1/conversations/{cid}/runs"
    before = await db_state(api.pool)

    assert_error(await api.a.post(f"/v1/conversations/{empty}/runs",
                                  json={"retry_of": "last"}), 409, "nothing_to_retry")
    older = assert_error(await api.a.post(runs, json={"retry_of": messages[0]["id"]}), 409,
                         "nothing_to_retry")
    assert older["latest_message_id"] == messages[2]["id"]
    assert_error(await api.a.post(runs, json={"retry_of": messages[3]["id"]}), 409,
                 "nothing_to_retry")  # an answer is not a question
    assert_error(await api.a.post(runs, json={"retry_of": elsewhere}), 404, "not_found")
    assert_error(await api.b.post(runs, json={"retry_of": "last"}), 404, "not_found")
    assert await db_state(api.pool) == before

    running = await start_run(api.a, cid, "still going", SLOW)
    await wait_run(api.a, running["run_id"], ("running",))
    before = await db_state(api.pool)
    busy = assert_error(await api.a.post(runs, json={"retry_of": "last"}), 409, "turn_active")
    assert busy["message_id"] != messages[2]["id"]
    assert_error(await api.a.post(runs, json={"retry_of": messages[2]["id"]}), 409,
                 "turn_active")
    assert await db_state(api.pool) == before
    await api.a.post(f"/v1/conversations/{cid}/stop")


async def test_two_devices_retrying_the_same_turn_make_one_run(api: Api) -> None:
    cid = await create_conversation(api.a)
    await finished_turn(api, cid, "race me")
    async with api.client(api.token_a) as second_device:
        for _ in range(5):
            latest = [m for m in (await state(api, cid))["messages"]
                      if m["role"] == "user" and not m["superseded_by"]][-1]
            body = {"retry_of": latest["id"], "params": FAST}
            answers = await asyncio.gather(
                api.a.post(f"/v1/conversations/{cid}/runs", json=body),
                second_device.post(f"/v1/conversations/{cid}/runs", json=body))
            statuses = sorted(r.status_code for r in answers)
            assert statuses == [202, 409], [r.text for r in answers]
            loser = next(r for r in answers if r.status_code == 409)
            assert loser.json()["error"]["code"] in ("nothing_to_retry", "turn_active")
            winner = next(r for r in answers if r.status_code == 202)
            await wait_run(api.a, winner.json()["run_id"])
    live = [m for m in (await state(api, cid))["messages"] if not m["superseded_by"]]
    assert [m["role"] for m in live] == ["user", "assistant"]


# -- archive ------------------------------------------------------------------------------------


async def test_archive_hides_a_conversation_reversibly_and_every_device_sees_it(
        api: Api) -> None:
    kept = await create_conversation(api.a, "kept")
    cid = await create_conversation(api.a, "to archive")
    await finished_turn(api, cid, "before archiving")
    updated_at = (await state(api, cid))["updated_at"]

    async with Feed(api.a, cid) as feed:
        archived = await api.a.patch(f"/v1/conversations/{cid}", json={"archived": True})
        assert archived.status_code == 200
        body = archived.json()
        assert_time(body["archived_at"])
        assert body["updated_at"] == updated_at  # archiving is not activity
        frame = await feed.next("conversation")  # the first: nothing else changed since
        assert frame.data["conversation"]["archived_at"] == body["archived_at"]

        listed = (await api.a.get("/v1/conversations")).json()["conversations"]
        assert [c["id"] for c in listed] == [kept]
        shelf = (await api.a.get("/v1/conversations", params={"archived": "true"})).json()
        assert [c["id"] for c in shelf["conversations"]] == [cid]
        assert (await state(api, cid))["archived_at"] == body["archived_at"]
        # Still a conversation: it can be read and can run turns.
        turn = await finished_turn(api, cid, "while archived")
        assert turn["status"] == "completed"

        restored = await api.a.patch(f"/v1/conversations/{cid}", json={"archived": False})
        assert restored.status_code == 200 and restored.json()["archived_at"] is None
        await feed.next("conversation", lambda d: d["conversation"]["archived_at"] is None)
    listed = (await api.a.get("/v1/conversations")).json()["conversations"]
    assert {c["id"] for c in listed} == {kept, cid}
    assert (await api.a.get("/v1/conversations", params={"archived": "true"})).json() == {
        "conversations": [], "next": None}
    before = await db_state(api.pool)
    assert_error(await api.b.patch(f"/v1/conversations/{cid}", json={"archived": True}), 404,
                 "not_found")
    assert await db_state(api.pool) == before


# -- delete -------------------------------------------------------------------------------------


async def rows_of(api: Api, conversation_id: str) -> dict[str, int]:
    """Rows anywhere that still belong to the conversation."""
    cid = UUID(conversation_id)
    return dict(await api.pool.fetchrow(
        """
        SELECT (SELECT count(*) FROM conversation WHERE id = $1) AS conversation,
               (SELECT count(*) FROM message WHERE conversation_id = $1) AS messages,
               (SELECT count(*) FROM agent_run WHERE conversation_id = $1) AS runs,
               (SELECT count(*) FROM run_event e JOIN agent_run r ON r.id = e.run_id
                WHERE r.conversation_id = $1) AS journal,
               (SELECT count(*) FROM run_event e WHERE NOT EXISTS (
                    SELECT 1 FROM agent_run r WHERE r.id = e.run_id)) AS orphan_events,
               (SELECT count(*) FROM conversation_lease WHERE conversation_id = $1) AS leases,
               (SELECT count(*) FROM presence WHERE conversation_id = $1) AS presence,
               (SELECT count(*) FROM conversation_note WHERE conversation_id = $1) AS notes,
               (SELECT count(*) FROM conversation_note_fence WHERE conversation_id = $1)
                   AS note_marks
        """, cid))


async def test_delete_stops_the_turn_removes_everything_and_every_device_sees_it_go(
        api: Api) -> None:
    kept = await create_conversation(api.a, "kept")
    await finished_turn(api, kept, "stays")
    kept_rows = await rows_of(api, kept)
    cid = await create_conversation(api.a, "to delete")
    await finished_turn(api, cid, "write a note", {"tokens": 2, "delay_ms": 0, "tool": "notes"})
    running = await start_run(api.a, cid, "streaming when deleted", SLOW)
    await wait_run(api.a, running["run_id"], ("running",))
    queued = await start_run(api.a, cid, "queued when deleted")
    assert (await rows_of(api, cid))["notes"] == 1

    run_stream = f"/v1/runs/{running['run_id']}/events"
    async with Feed(api.a, cid) as desk, Feed(api.a, cid) as laptop, \
            Feed(api.a, path=run_stream) as tail:
        async with asyncio.timeout(WAIT_S):
            response = await api.a.delete(f"/v1/conversations/{cid}")
            assert response.status_code == 204 and response.content == b""
            for feed in (desk, laptop):
                gone = await feed.next("deleted")
                assert gone.data == {"type": "deleted", "conversation_id": cid}
                await feed.ended.wait()  # the feed ends after it
            ending = await tail.next("complete")  # the run's own stream ends too, saying why
            await tail.ended.wait()
        assert ending.data["deleted"] is True and ending.data["status"] == "cancelled"

    assert await rows_of(api, cid) == dict.fromkeys(kept_rows, 0)
    assert await rows_of(api, kept) == kept_rows
    for path in (f"/v1/conversations/{cid}", f"/v1/runs/{running['run_id']}",
                 f"/v1/runs/{queued['run_id']}", f"/v1/conversations/{cid}/events"):
        assert_error(await api.a.get(path), 404, "not_found")
    assert_error(await api.a.delete(f"/v1/conversations/{cid}"), 404, "not_found")

    async def idle() -> bool:
        metrics = (await api.a.get("/metrics")).text
        return "agentd_in_flight 0" in metrics

    await poll_until(idle, WAIT_S, what="the deleted turn's worker to stand down")
    log = api.daemon.log_text()
    assert "unhandled error" not in log and "Traceback" not in log and "turn crashed" not in log
    assert "ForeignKeyViolation" not in log


async def test_delete_of_another_accounts_conversation_is_404_and_twice_is_404(
        api: Api) -> None:
    cid = await create_conversation(api.a, "alice's")
    await finished_turn(api, cid, "hers")
    before = await db_state(api.pool)
    assert_error(await api.b.delete(f"/v1/conversations/{cid}"), 404, "not_found")
    assert_error(await api.b.delete(f"/v1/conversations/{uuid.uuid4()}"), 404, "not_found")
    assert_error(await api.b.delete("/v1/conversations/not-an-id"), 404, "not_found")
    assert await db_state(api.pool) == before

    answers = await asyncio.gather(*(api.a.delete(f"/v1/conversations/{cid}")
                                     for _ in range(3)))
    assert sorted(r.status_code for r in answers) == [204, 404, 404], [r.text for r in answers]
    for response in answers:
        if response.status_code == 404:
            assert_error(response, 404, "not_found")
    assert_error(await api.a.delete(f"/v1/conversations/{cid}"), 404, "not_found")


# -- usage --------------------------------------------------------------------------------------


async def test_usage_is_shown_per_answer_per_run_and_as_a_conversation_total(api: Api) -> None:
    cid = await create_conversation(api.a)
    async with Feed(api.a, cid) as feed:
        first = await finished_turn(api, cid, "count these words", {"tokens": 4, "delay_ms": 0})
        second = await finished_turn(api, cid, "and these", {"tokens": 6, "delay_ms": 0})
        total = await feed.next("conversation", lambda d: d["usage"].get("runs") == 2)
    body = await state(api, cid)
    answers = [m for m in body["messages"] if m["role"] == "assistant"]
    assert [a["usage"] for a in answers] == [first["usage"], second["usage"]]
    assert [a["model"] for a in answers] == ["demo", "demo"]
    assert all("usage" not in m for m in body["messages"] if m["role"] == "user")
    assert [r["output_tokens"] for r in (first["usage"], second["usage"])] == [4, 6]
    expected = {"input_tokens": first["usage"]["input_tokens"] + second["usage"]["input_tokens"],
                "output_tokens": 10, "runs": 2}
    assert body["usage"] == expected and total.data["usage"] == expected
    events = await read_sse(api.a, f"/v1/runs/{second['id']}/events")
    assert events[-1].data["usage"] == second["usage"]


DELETE_ITERATIONS = 12


async def test_deleting_while_the_worker_streams_or_calls_a_tool_never_errs(api: Api) -> None:
    """Deletes land at random points of a live turn (before its tool call, during it, mid-
    stream): each ends the run and its streams, leaves no row behind, and no request or log line
    of the daemon shows an error."""
    rng = random.Random(11)
    params = {"tokens": 400, "delay_ms": 5, "tool": "notes"}
    for iteration in range(DELETE_ITERATIONS):
        cid = await create_conversation(api.a, f"doomed {iteration}")
        run = await start_run(api.a, cid, "stream until deleted", params)
        frames = rng.randint(1, 12)
        async with api.a.stream("GET", f"/v1/runs/{run['run_id']}/events") as stream:
            seen = []
            async with asyncio.timeout(WAIT_S):
                async for event in iter_sse(stream):
                    seen.append(event)
                    if len(seen) == frames:
                        response = await api.a.delete(f"/v1/conversations/{cid}")
                        assert response.status_code == 204, response.text
                    if event.event == "complete":
                        break
        assert seen[-1].event == "complete", f"iteration {iteration}: {seen[-1]}"
        assert len(seen) >= frames
        assert (await rows_of(api, cid))["conversation"] == 0
        assert set((await rows_of(api, cid)).values()) == {0}, iteration

    async def idle() -> bool:
        return "agentd_in_flight 0" in (await api.a.get("/metrics")).text

    await poll_until(idle, WAIT_S, what="every deleted turn's worker to stand down")
    log = api.daemon.log_text()
    for sign in ("unhandled error", "Traceback", "turn crashed", "ForeignKeyViolation",
                 "backstop"):
        assert sign not in log, sign
    assert (await api.a.get("/readyz")).status_code == 200


async def test_an_export_whose_conversation_goes_before_its_plan_is_read_is_cut(api: Api):
    """Deleted between the heading and the plan: the plan was empty, and the answer ended as a
    whole, empty transcript instead of the cut the API promises."""
    conversation_id = await create_conversation(api.a)
    async with api.pool.acquire() as conn:
        deleting = conn.transaction()
        await deleting.start()
        # The plan's read waits for this transaction, which deletes the conversation.
        await conn.execute("LOCK TABLE message IN ACCESS EXCLUSIVE MODE")
        export = asyncio.ensure_future(api.a.get(f"/v1/conversations/{conversation_id}/export"))
        await poll_until(lambda: api.pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND query LIKE '%message%' AND pid <> $1", conn.get_server_pid()),
            10, what="the export's plan waiting for the table")
        await conn.execute("DELETE FROM conversation WHERE id = $1", UUID(conversation_id))
        await deleting.commit()
    try:
        answer = await export
    except (httpx.RemoteProtocolError, httpx.ReadError):
        return  # cut: the client sees a transfer that did not complete
    assert answer.status_code == 404, (answer.status_code, answer.text)  # before any byte


async def test_a_repeat_naming_no_model_is_replayed_after_the_model_changed(
        spawn_daemon, pool) -> None:
    """Its first post's answer lost, a client sends the same request again under the same key;
    meanwhile another device changed the conversation's model. The repeat was resolved on the
    new model and answered 409 idempotency_conflict, as if it were another request."""
    async with started_api(spawn_daemon, pool, env=TWO_DEMO_MODELS) as api:
        cid = await create_conversation(api.a)
        body = {"content": "once", "params": {"tokens": 2, "delay_ms": 0}}
        key = {"Idempotency-Key": f"k-{uuid.uuid4()}"}
        first = await api.a.post(f"/v1/conversations/{cid}/runs", json=body, headers=key)
        assert first.status_code == 202, first.text
        changed = await api.a.patch(f"/v1/conversations/{cid}", json={"model": "demo:echo"})
        assert changed.status_code == 200
        again = await api.a.post(f"/v1/conversations/{cid}/runs", json=body, headers=key)
        assert again.status_code in (200, 202), again.text
        assert again.json()["run_id"] == first.json()["run_id"]
        # Another request under that key is still refused.
        other = await api.a.post(f"/v1/conversations/{cid}/runs",
                                 json={**body, "content": "twice"}, headers=key)
        assert_error(other, 409, "idempotency_conflict")
        assert await api.pool.fetchval("SELECT count(*) FROM agent_run"
                                       " WHERE conversation_id = $1", UUID(cid)) == 1
