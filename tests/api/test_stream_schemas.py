"""The document describes every event the two streams send: each one read from a live daemon
matches its variant of the stream's `itemSchema` (the event name, and the JSON data against the
variant's `contentSchema`), and every event type of the vocabulary has a variant."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema

from agentd.vocabulary import STREAM_ERROR_EVENT, EventType
from tests.api.conftest import Api
from tests.api.helpers import start_run, wait_run
from tests.support.daemon import poll_until
from tests.support.factories import create_conversation
from tests.support.sse import Frame, read_sse

RUN_ITEM = "RunStreamEvent"
FEED_ITEM = "ConversationStreamEvent"


def variants(spec: dict[str, Any], item: str) -> dict[str, dict[str, Any]]:
    """Event name -> the schema of one such event, from the stream's itemSchema."""
    return {v["properties"]["event"]["const"]: v
            for v in spec["components"]["schemas"][item]["anyOf"]}


def assert_described(spec: dict[str, Any], item: str, event: Frame) -> None:
    variant = variants(spec, item).get(event.event)
    assert variant is not None, f"{item}: no variant for event {event.event!r}"
    frame = {"event": event.event, "data": json.dumps(event.data)}
    if event.id is not None:
        frame["id"] = event.id
    root = {"components": spec["components"]}  # what the document's $refs point into
    jsonschema.validate(frame, {**variant, **root})
    data_schema = {**variant["properties"]["data"]["contentSchema"], **root}
    jsonschema.Draft202012Validator(data_schema, format_checker=jsonschema.FormatChecker()) \
        .validate(event.data)


async def test_every_streamed_event_matches_the_document(api: Api) -> None:
    spec = (await api.a.get("/openapi.json")).json()
    for item in (RUN_ITEM, FEED_ITEM):
        media = spec["paths"][f"/v1/{'runs' if item == RUN_ITEM else 'conversations'}"
                              "/{id}/events"]["get"]["responses"]["200"]["content"]
        assert media["text/event-stream"]["itemSchema"] == {
            "$ref": f"#/components/schemas/{item}"}
        names = set(variants(spec, item))
        assert {str(t) for t in EventType} | {STREAM_ERROR_EVENT} <= names

    conversation_id = await create_conversation(api.a, "streams described")
    turn = await start_run(api.a, conversation_id, "add these", params={
        "tokens": 4, "delay_ms": 0, "tool": "calculator",
        "tool_args": {"expression": "1 + 2"}})
    await wait_run(api.a, turn["run_id"])

    run_events = await read_sse(api.a, f"/v1/runs/{turn['run_id']}/events")
    assert {"user_message", "run_queued", "run_started", "content_delta", "tool_call",
            "tool_result", "complete"} <= {e.event for e in run_events}
    for event in run_events:
        assert_described(spec, RUN_ITEM, event)

    # A second turn while a device is attached: the feed carries its events (with run_id),
    # lease and presence changes, and the conversation's new totals once it ends.
    seen: set[str] = set()

    def both_seen(event: Frame) -> bool:
        seen.add(event.event)
        return {"complete", "conversation"} <= seen

    feed_task = asyncio.create_task(read_sse(
        api.a, f"/v1/conversations/{conversation_id}/events", stop_after=both_seen))

    async def attached() -> bool:
        state = (await api.a.get(f"/v1/conversations/{conversation_id}")).json()
        return bool(state["attached"]) or feed_task.done()

    await poll_until(attached, 30, interval=0.05, what="the feed to attach")
    await start_run(api.a, conversation_id, "once more")
    feed = await feed_task
    assert feed[0].event == "snapshot" and {"content_delta", "complete"} <= seen
    for event in feed:
        assert_described(spec, FEED_ITEM, event)
