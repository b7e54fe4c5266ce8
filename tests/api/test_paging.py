"""Transcript pages: `GET /v1/conversations/{id}/messages?before=&limit=&until=` and the
`limit` of a conversation's state and feed snapshot. Pages go newest first, each whole turns in
turn order; bad cursors and limits are 400s with stable codes."""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

import httpx
import pytest

from agentd.conversations import conversation_state
from agentd.export import conversation_markdown
from agentd.service import EXPORT_PAGE
from tests.api.conftest import Api
from tests.api.helpers import SLOW, assert_error, assert_json
from tests.support.long_conversation import LongConversation, write_long_conversation


async def _long(api: Api, turns: int) -> LongConversation:
    created = assert_json(await api.a.post("/v1/conversations", json={"title": "long"}))
    me = assert_json(await api.a.get("/v1/me"))
    return await write_long_conversation(
        api.pool, account_id=uuid.UUID(me["account_id"]), device_id=api.device_a,
        conversation_id=uuid.UUID(created["id"]), turns=turns)


def _ids(messages: list[dict[str, Any]]) -> list[str]:
    return [m["id"] for m in messages]


async def test_pages_walk_the_transcript_newest_first_in_whole_turns(api: Api):
    long = await _long(api, 25)
    path = f"/v1/conversations/{long.conversation_id}"
    whole = assert_json(await api.a.get(path))
    assert len(whole["messages"]) == 50 and whole["has_more"] is False

    pages, before = [], None
    while True:
        query = {"limit": "10", **({"before": before} if before else {})}
        page = assert_json(await api.a.get(f"{path}/messages", params=query))
        assert set(page) == {"messages", "has_more", "before"}
        pages.append(page["messages"])
        if not page["has_more"]:
            assert page["before"] is None
            break
        assert page["before"] == page["messages"][0]["id"]
        before = page["before"]
    assert [len(p) for p in pages] == [10, 10, 10, 10, 10]
    walked = [m for page in reversed(pages) for m in page]
    assert _ids(walked) == _ids(whole["messages"])
    # Every question, on every page, names the device that asked it (a client showed an old
    # page's questions as "another device"); an answer names its model instead.
    me = assert_json(await api.a.get("/v1/me"))
    for message in walked + whole["messages"]:
        asker = (message.get("device_id"), message.get("device"))
        assert asker == ((me["device_id"], me["device"]) if message["role"] == "user"
                         else (None, None)), message
    assert walked[0]["role"] == "user" and walked[-1]["content"].endswith("End of answer 25.")

    odd = assert_json(await api.a.get(f"{path}/messages", params={"limit": "3"}))
    assert len(odd["messages"]) == 4, "a page is widened to whole turns, never split"
    assert [m["role"] for m in odd["messages"]] == ["user", "assistant"] * 2

    jump = assert_json(await api.a.get(f"{path}/messages", params={
        "limit": "2", "until": str(long.answer_ids[4])}))
    assert jump["messages"][0]["id"] == str(long.question_ids[4])
    assert len(jump["messages"]) == 42 and jump["has_more"] is True

    default = assert_json(await api.a.get(f"{path}/messages"))
    assert len(default["messages"]) == 50 and default["has_more"] is False


async def test_state_and_feed_snapshot_carry_only_the_newest_page_when_limited(api: Api):
    long = await _long(api, 12)
    path = f"/v1/conversations/{long.conversation_id}"
    state = assert_json(await api.a.get(path, params={"limit": "6"}))
    assert _ids(state["messages"]) == [str(i) for pair in zip(
        long.question_ids[-3:], long.answer_ids[-3:], strict=True) for i in pair]
    assert state["has_more"] is True and state["before"] == str(long.question_ids[-3])

    async with api.a.stream("GET", f"{path}/events", params={"limit": "4"},
                            headers={"Accept": "text/event-stream"}) as response:
        assert response.status_code == 200
        data = None
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                data = line[5:].strip()
                break
    assert data is not None


    snapshot = json.loads(data)["conversation"]
    assert len(snapshot["messages"]) == 4 and snapshot["has_more"] is True
    assert snapshot["before"] == str(long.question_ids[-2])


async def test_a_limited_state_holds_the_question_of_every_run_it_lists(api: Api):
    """More queued turns than the page holds: the page reaches back to the running turn's
    question (before, it held only the newest queued questions, and a client showed the
    running turn with no question at all)."""
    cid = assert_json(await api.a.post("/v1/conversations", json={"title": "busy"}))["id"]
    running = assert_json(await api.a.post(f"/v1/conversations/{cid}/runs",
                                           json={"content": "the long one", "params": SLOW}))
    queued = [assert_json(await api.a.post(f"/v1/conversations/{cid}/runs",
                                           json={"content": f"later {n}"}))
              for n in range(5)]
    state = assert_json(await api.a.get(f"/v1/conversations/{cid}", params={"limit": "2"}))
    assert [r["id"] for r in state["runs"]] == [running["run_id"]] + [
        q["run_id"] for q in queued]
    assert [m["content"] for m in state["messages"]] == ["the long one"] + [
        f"later {n}" for n in range(5)]
    assert state["has_more"] is False
    await api.a.post(f"/v1/conversations/{cid}/stop")


async def test_a_long_export_is_streamed_page_by_page_and_whole(api: Api):
    """The Markdown export reads the transcript a page at a time and writes each out before
    reading the next (it used to read it whole into memory, then render it whole): the text is
    the same document, and it comes chunked."""
    long = await _long(api, 600)  # 1,200 messages: three pages of EXPORT_PAGE
    assert 2 * long.turns > 2 * EXPORT_PAGE
    me = assert_json(await api.a.get("/v1/me"))
    state = await conversation_state(api.pool, uuid.UUID(me["account_id"]),
                                     long.conversation_id)
    assert state is not None
    async with api.a.stream("GET", f"/v1/conversations/{long.conversation_id}/export"
                            ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/markdown; charset=utf-8"
        assert response.headers.get("transfer-encoding") == "chunked"
        text = (await response.aread()).decode()
    assert text == conversation_markdown(state)
    assert text.count("## You · ") == 600 and text.endswith("End of answer 600.\n")
    missing = await api.a.get(f"/v1/conversations/{uuid.uuid4()}/export")
    assert_error(missing, 404, "not_found")
    other = await api.b.get(f"/v1/conversations/{long.conversation_id}/export")
    assert_error(other, 404, "not_found")


async def test_the_conversation_list_pages_on_with_next(api: Api):
    """Past its `limit` the list ends with a `next` to ask for the page after (older
    conversations could only be found by search before). The cursor is the values of the
    page's last one: a conversation that becomes active meanwhile moves to the top and shifts
    nothing after it; a forged cursor is a 400."""
    made = [assert_json(await api.a.post("/v1/conversations", json={"title": f"c{n}"}))["id"]
            for n in range(5)]
    newest_first = list(reversed(made))
    first = assert_json(await api.a.get("/v1/conversations", params={"limit": "2"}))
    assert [c["id"] for c in first["conversations"]] == newest_first[:2]
    assert first["next"]
    # One of a later page becomes active (a post moves it to the top): the walk goes on where
    # it was, neither repeating the first page's last (as an offset would) nor skipping
    # another; the moved one is at the top of the next walk.
    await api.a.post(f"/v1/conversations/{newest_first[3]}/runs",
                     json={"content": "hello", "params": {"tokens": 1, "delay_ms": 0}})
    seen, after = [c["id"] for c in first["conversations"]], first["next"]
    while after:
        page = assert_json(await api.a.get("/v1/conversations",
                                           params={"limit": "2", "after": after}))
        seen += [c["id"] for c in page["conversations"]]
        after = page["next"]
    assert seen == [newest_first[i] for i in (0, 1, 2, 4)]
    top = assert_json(await api.a.get("/v1/conversations", params={"limit": "1"}))
    assert [c["id"] for c in top["conversations"]] == [newest_first[3]]
    whole = assert_json(await api.a.get("/v1/conversations"))
    assert whole["next"] is None and len(whole["conversations"]) == 5
    assert assert_json(await api.b.get("/v1/conversations")) == {"conversations": [],
                                                                 "next": None}
    past_9999 = base64.urlsafe_b64encode(
        f"9999-12-31T23:00:00-14:00|{uuid.uuid4()}".encode()).decode()
    for forged in ("nope", "bm9wZXxub3BlCg", first["next"][:-3], past_9999):
        assert_error(await api.a.get("/v1/conversations", params={"after": forged}), 400,
                     "invalid_after")


async def test_an_export_whose_conversation_is_deleted_midway_is_cut_not_passed_off_whole(
        api: Api):
    """The export reads its pages as it writes them: a conversation deleted meanwhile must not
    end in what looks like a whole document. The connection is cut, so the reader sees a
    transfer that did not complete."""
    created = assert_json(await api.a.post("/v1/conversations", json={"title": "big"}))
    me = assert_json(await api.a.get("/v1/me"))
    await write_long_conversation(  # ~12 MB: the first page fills every buffer on the way
        api.pool, account_id=uuid.UUID(me["account_id"]), device_id=api.device_a,
        conversation_id=uuid.UUID(created["id"]), turns=600,
        answer_of=lambda n: f"answer {n} " + "x" * 20_000)
    async with api.a.stream("GET", f"/v1/conversations/{created['id']}/export") as response:
        assert response.status_code == 200
        chunks = response.aiter_bytes()
        first = await anext(chunks)
        assert first.startswith(b"# big")
        # The daemon is still writing the first page, and reads the next only once it is out.
        deleted = await api.a.delete(f"/v1/conversations/{created['id']}")
        assert deleted.status_code == 204
        with pytest.raises(httpx.RemoteProtocolError):
            async for _ in chunks:
                pass


async def test_bad_cursors_and_limits_are_400s_with_stable_codes(api: Api):
    long = await _long(api, 3)
    other = await _long(api, 1)
    path = f"/v1/conversations/{long.conversation_id}"
    for query, code in [({"limit": "0"}, "invalid_limit"), ({"limit": "x"}, "invalid_limit"),
                        ({"limit": "1001"}, "invalid_limit"),
                        ({"before": "not-a-cursor"}, "invalid_before"),
                        ({"before": str(uuid.uuid4())}, "invalid_before"),
                        ({"before": str(other.question_ids[0])}, "invalid_before"),
                        ({"until": "1"}, "invalid_until"),
                        ({"until": str(uuid.uuid4())}, "invalid_until"),
                        ({"page": "2"}, "unknown_parameter")]:
        assert_error(await api.a.get(f"{path}/messages", params=query), 400, code)
    assert_error(await api.a.get(path, params={"limit": "-1"}), 400, "invalid_limit")
    assert_error(await api.a.get(f"{path}/events", params={"limit": "x"}), 400,
                 "invalid_limit")
    assert_error(await api.b.get(f"{path}/messages"), 404)
    assert_error(await api.b.get(f"{path}/messages",
                                 params={"before": str(long.question_ids[1])}), 404)
    # Whatever the query: a malformed cursor or limit said nothing about it before (400).
    for query in ({"before": "x"}, {"limit": "0"}, {"color": "blue"}):
        assert_error(await api.b.get(f"{path}/messages", params=query), 404)
    assert_error(await api.b.get(path, params={"limit": "0"}), 404)
    for query in ({"limit": "x"}, {"cursor": "not a cursor"}):
        assert_error(await api.b.get(f"{path}/events", params=query), 404)
    assert_error(await api.a.get(f"{path}/events", params={"cursor": "not a cursor"}), 400,
                 "invalid_cursor")
