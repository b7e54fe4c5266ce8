"""The client-side conversation model, fed wire-shaped items: snapshots win, events apply once,
streamed text survives a resumed snapshot, drafts reach only their author and only once."""

from __future__ import annotations

from typing import Any

from agentd.vocabulary import EventType, MessageStatus, RunStatus
from agenttui.client import ConnectionState, ConnectionStatus, LeaseChanged, Snapshot
from agenttui.conversation import ConversationModel
from agenttui.models import (
    ConversationState,
    Draft,
    Lease,
    Me,
    MessagePage,
    RunEvent,
    StopResult,
)

ME = Me("team", "acct", "desk", "dev-desk")
OTHER = "dev-laptop"
CONV = "conv-1"


def snapshot(messages: list[dict[str, Any]], runs: list[dict[str, Any]] | None = None,
             lease: dict[str, Any] | None = None, *, resumed: bool = False) -> Snapshot:
    return Snapshot(ConversationState.from_wire({
        "id": CONV, "title": "t", "created_at": None, "updated_at": None,
        "messages": messages, "runs": runs or [], "lease": lease, "attached": []}), resumed)


def message(mid: str, role: str, content: str, status: str, run_id: str) -> dict[str, Any]:
    return {"id": mid, "role": role, "content": content, "status": status, "run_id": run_id,
            "created_at": "2030-01-01T00:00:00Z"}


def run(rid: str, status: str, device: str, **extra: Any) -> dict[str, Any]:
    return {"id": rid, "conversation_id": CONV, "status": status, "device_id": device,
            "cancel_requested": False, "worker_id": extra.get("worker"),
            "lease_expires_at": extra.get("lease"), "error": None, "usage": None,
            "created_at": None, "started_at": None, "finished_at": None}


def event(rid: str, seq: int, kind: EventType, **payload: Any) -> RunEvent:
    return RunEvent.from_wire({**payload, "type": str(kind), "seq": seq, "run_id": rid})


def test_events_build_a_turn_and_repeats_are_ignored() -> None:
    model = ConversationModel(ME, CONV)
    model.apply(snapshot([]))
    model.note_created("r1")
    for item in (event("r1", 1, EventType.USER_MESSAGE, message_id="m1", content="hi"),
                 event("r1", 2, EventType.RUN_QUEUED),
                 event("r1", 3, EventType.RUN_STARTED, worker_id="w:1:a",
                       lease_expires_at="2030-01-01T00:00:30Z"),
                 event("r1", 4, EventType.CONTENT_DELTA, delta="hello"),
                 event("r1", 4, EventType.CONTENT_DELTA, delta="hello"),  # a repeat
                 event("r1", 5, EventType.CONTENT_DELTA, delta=" world")):
        model.apply(item)
    turn = model.turns["r1"]
    assert turn.text == "hello world"
    assert model.state == "running"
    assert model.owner()[1:3] == ("desk", "w:1:a")
    assert model.owner_is_me()
    model.apply(event("r1", 6, EventType.COMPLETE, status="completed", error=None))
    assert turn.status == RunStatus.COMPLETED and model.state == "idle"
    assert model.last_answer() == "hello world"


def test_resumed_snapshot_keeps_streamed_text_and_a_fresh_one_starts_over() -> None:
    model = ConversationModel(ME, CONV)
    active = [run("r1", "running", OTHER, worker="w")]
    question = [message("m1", "user", "q", "complete", "r1")]
    model.apply(snapshot(question, active))
    model.apply(event("r1", 3, EventType.CONTENT_DELTA, delta="partial"))
    model.apply(snapshot(question, active, resumed=True))
    assert model.turns["r1"].text == "partial"
    model.apply(event("r1", 3, EventType.CONTENT_DELTA, delta="partial"))  # already seen
    assert model.turns["r1"].text == "partial"
    model.apply(snapshot(question, active, resumed=False))  # the feed replays from seq 1
    assert model.turns["r1"].text == ""


def test_durable_answer_wins_over_streamed_text_after_a_reconnect() -> None:
    model = ConversationModel(ME, CONV)
    model.apply(snapshot([message("m1", "user", "q", "complete", "r1")],
                         [run("r1", "running", OTHER)]))
    model.apply(event("r1", 3, EventType.CONTENT_DELTA, delta="one"))
    # The run finished while we were away: the snapshot has the whole answer.
    model.apply(snapshot([message("m1", "user", "q", "complete", "r1"),
                          message("a1", "assistant", "one two", "complete", "r1")],
                         resumed=True))
    model.apply(event("r1", 4, EventType.CONTENT_DELTA, delta=" two"))
    assert model.turns["r1"].text == "one two"
    assert model.turns["r1"].status == RunStatus.COMPLETED


def test_lease_names_the_owner_and_queue_positions_follow_run_order() -> None:
    model = ConversationModel(ME, CONV)
    model.apply(snapshot(
        [message("m1", "user", "a", "complete", "r1"), message("m2", "user", "b", "queued", "r2"),
         message("m3", "user", "c", "queued", "r3")],
        [run("r1", "running", OTHER), run("r2", "queued", ME.device_id),
         run("r3", "queued", OTHER)]))
    model.apply(LeaseChanged(Lease.from_wire({
        "run_id": "r1", "device": "laptop", "device_id": OTHER, "worker_id": "w:2:b",
        "fence": 3, "expires_at": "2030-01-01T00:00:30Z"})))
    assert model.state == "running"
    assert model.owner()[1:3] == ("laptop", "w:2:b")
    assert not model.owner_is_me()
    assert [model.queue_position(t) for t in model.turn_list()] == [None, 1, 2]
    model.apply(ConnectionStatus(ConnectionState.RECONNECTING, attempt=2))
    assert model.connection.attempt == 2


def test_a_draft_goes_to_its_author_once() -> None:
    consumed: set[str] = set()
    mine = ConversationModel(ME, CONV, is_consumed=consumed.__contains__)
    theirs = ConversationModel(Me("team", "acct", "laptop", OTHER), CONV)
    for model in (mine, theirs):
        model.apply(snapshot([message("m1", "user", "later", "queued", "r1")],
                             [run("r1", "queued", ME.device_id)]))
        changes = model.apply(event("r1", 3, EventType.COMPLETE, status="cancelled",
                                    error="stopped before it started"))
        assert model.turns["r1"].question_status == MessageStatus.DRAFT
        assert changes.drafts is (model is mine)
    drafts = mine.take_drafts()
    assert [d.content for d in drafts] == ["later"]
    assert theirs.take_drafts() == []
    consumed.update(d.message_id for d in drafts)
    # A restart sees the same draft in its snapshot: already handed back, not offered again.
    again = ConversationModel(ME, CONV, is_consumed=consumed.__contains__)
    again.apply(snapshot([message("m1", "user", "later", "draft", "r1")]))
    again.note_run(again_run := _run_row("r1", ME.device_id))
    assert again_run.status == RunStatus.CANCELLED
    assert again.take_drafts() == []
    fresh = ConversationModel(ME, CONV)
    fresh.apply(snapshot([message("m1", "user", "later", "draft", "r1")]))
    assert fresh.runs_to_resolve() == ["r1"]
    assert fresh.note_run(_run_row("r1", ME.device_id)).drafts
    assert [d.content for d in fresh.take_drafts()] == ["later"]


def test_drafts_come_back_in_the_order_they_were_queued() -> None:
    model = ConversationModel(ME, CONV)
    model.apply(snapshot([message(f"m{n}", "user", f"turn {n}", "queued", f"r{n}")
                          for n in (1, 2, 3, 4)],
                         [run(f"r{n}", "queued", ME.device_id) for n in (1, 2, 3, 4)]))
    # One ending arrives on the feed first; the stop's answer lists the rest in any order.
    model.apply(event("r2", 3, EventType.COMPLETE, status="cancelled", error="stopped"))
    model.note_stop(StopResult(("r4", "r1", "r3"), (), tuple(
        Draft(f"r{n}", f"m{n}", f"turn {n}") for n in (4, 1, 3))))
    assert [d.content for d in model.take_drafts()] == ["turn 1", "turn 2", "turn 3", "turn 4"]
    assert model.take_drafts() == []


def _run_row(rid: str, device: str) -> Any:
    from agenttui.models import Run

    return Run.from_wire({**run(rid, "cancelled", device), "error": "stopped before it started"})


def test_a_stop_requested_elsewhere_shows_cancelling_and_names_the_asker() -> None:
    """`run_state` flips the running turn to cancelling on every device before it ends, and
    the device named by `run_queued` is who asked."""
    from agenttui.client import RunStateChanged

    model = ConversationModel(ME, CONV)
    model.apply(snapshot([]))
    for item in (event("r1", 1, EventType.USER_MESSAGE, message_id="m1", content="hi"),
                 event("r1", 2, EventType.RUN_QUEUED, device_id=OTHER, device="laptop"),
                 event("r1", 3, EventType.RUN_STARTED, worker_id="w:1:a",
                       lease_expires_at="2030-01-01T00:00:30Z")):
        model.apply(item)
    assert model.state == "running"
    assert model.owner()[1] == "laptop"
    assert model.apply(RunStateChanged("r1", "running", True)).bar
    assert model.state == "cancelling"


def test_tool_arguments_that_are_no_json_object_are_shown_as_they_came() -> None:
    """A model may send arguments that are no JSON object (`{"path": "a`): the daemon keeps
    that text and tells the model. The client read them with dict(), so one such call made the
    conversation unreadable on every device, its live feed and every snapshot after it."""
    broken = '{"path": "a'
    call = {**message("m2", "assistant", "", "complete", "r1"),
            "tool_calls": [{"id": "c1", "name": "read_file", "arguments": broken}]}
    model = ConversationModel(ME, CONV)
    model.apply(snapshot([message("m1", "user", "q", "complete", "r1"), call],
                         [run("r1", "completed", OTHER)]))
    step = model.turns["r1"].tools["c1"]
    assert step.arguments == broken
    assert broken.replace('"', '\\"') in step.summary()

    model.apply(event("r2", 1, EventType.USER_MESSAGE, message_id="m3", content="again"))
    model.apply(event("r2", 2, EventType.TOOL_CALL, call_id="c2", name="read_file",
                      arguments=[1, 2]))
    assert model.turns["r2"].tools["c2"].arguments == [1, 2]
    assert "read_file([1, 2])" in model.turns["r2"].tools["c2"].summary()


def _page_state(messages: list[dict[str, Any]], before: str) -> Snapshot:
    return Snapshot(ConversationState.from_wire({
        "id": CONV, "title": "t", "created_at": None, "updated_at": None,
        "messages": messages, "runs": [], "lease": None, "attached": [],
        "has_more": True, "before": before}), False)


def _turn(n: int) -> list[dict[str, Any]]:
    return [message(f"q{n}", "user", f"question {n}", "complete", f"r{n}"),
            message(f"a{n}", "assistant", f"answer {n}", "complete", f"r{n}")]


def test_an_older_page_asked_before_a_fresh_snapshot_that_does_not_join_is_dropped() -> None:
    """A page is asked below the oldest loaded turn; meanwhile a fresh snapshot (the feed came
    back after many turns) does not join what was held and brings its own cursor. The page
    would have gone on top of it and hidden the turns in between: it is dropped, and the next
    page is asked from the snapshot's cursor."""
    model = ConversationModel(ME, CONV)
    model.apply(_page_state(_turn(10) + _turn(11), before="q10"))
    asked = model.before
    assert asked == "q10"
    model.apply(_page_state(_turn(50) + _turn(51), before="q50"))  # joins nothing held
    page = MessagePage.from_wire({"messages": _turn(8) + _turn(9), "has_more": True,
                                  "before": "q8"})
    model.apply_page(page, asked)
    assert model.order == ["r50", "r51"] and model.before == "q50"
    # Asked from the current cursor, a page goes on top.
    older = MessagePage.from_wire({"messages": _turn(48) + _turn(49), "has_more": True,
                                   "before": "q48"})
    model.apply_page(older, model.before)
    assert model.order == ["r48", "r49", "r50", "r51"] and model.before == "q48"


def test_a_tool_step_message_is_found_in_its_turn() -> None:
    """A search hit can name a tool call or its result: the jump found only questions and
    answers, and said the message was no longer in the conversation."""
    model = ConversationModel(ME, CONV)
    call = {**message("m2", "assistant", "", "complete", "r1"),
            "tool_calls": [{"id": "c1", "name": "clock", "arguments": {}}]}
    result = {**message("m3", "tool", '{"now": "noon"}', "complete", "r1"),
              "tool_call_id": "c1"}
    model.apply(snapshot([message("m1", "user", "what time is it", "complete", "r1"), call,
                          result, message("m4", "assistant", "noon", "complete", "r1")],
                         [run("r1", "completed", OTHER)]))
    assert [model.key_of_message(m) for m in ("m1", "m2", "m3", "m4")] == ["r1"] * 4
    assert model.key_of_message("elsewhere") is None
    # A turn that ran live: its steps' messages are known from its events.
    model.apply(event("r2", 1, EventType.USER_MESSAGE, message_id="n1", content="again"))
    model.apply(event("r2", 2, EventType.TOOL_CALL, call_id="c2", name="clock",
                      arguments={}, message_id="n2"))
    model.apply(event("r2", 3, EventType.TOOL_RESULT, call_id="c2", name="clock",
                      result={"now": "noon"}, message_id="n3"))
    assert [model.key_of_message(m) for m in ("n1", "n2", "n3")] == ["r2"] * 3


def test_every_question_loaded_names_the_device_that_asked_it() -> None:
    """Questions carry their asker: those of a snapshot and of older pages are labelled by it,
    not "another device" (only the 20 newest turns' runs used to be looked up one by one)."""
    model = ConversationModel(ME, CONV)

    def asked(n: int, device_id: str, device: str) -> list[dict[str, Any]]:
        question, answer = _turn(n)
        return [{**question, "device_id": device_id, "device": device}, answer]

    model.apply(_page_state(asked(10, OTHER, "laptop") + asked(11, ME.device_id, ME.device),
                            before="q10"))
    page = MessagePage.from_wire({"messages": asked(9, OTHER, "laptop"), "has_more": False,
                                  "before": None})
    model.apply_page(page, model.before)
    older, theirs, mine = (model.turns[key] for key in ("r9", "r10", "r11"))
    assert model.device_name(older.device_id) == model.device_name(theirs.device_id) == "laptop"
    assert model.mine(mine) and not model.mine(theirs) and not model.mine(older)
    assert model.runs_to_resolve() == []  # nothing left to look up one by one


def test_a_tool_result_nested_too_deep_to_read_is_shown_as_it_is() -> None:
    """JSON nested past what the decoder recurses into (a tool's odd output): the model showed
    nothing more of the conversation, its update broken by a RecursionError."""
    deep = "[" * 5000 + "]" * 5000
    model = ConversationModel(ME, CONV)
    call = {**message("m2", "assistant", "", "complete", "r1"),
            "tool_calls": [{"id": "c1", "name": "clock", "arguments": {}}]}
    result = {**message("m3", "tool", deep, "complete", "r1"), "tool_call_id": "c1"}
    model.apply(snapshot([message("m1", "user", "q", "complete", "r1"), call, result],
                         [run("r1", "completed", OTHER)]))
    assert model.turns["r1"].tools["c1"].result == deep
