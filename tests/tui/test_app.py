"""The TUI driven by Pilot against live daemons: streaming, two devices on one conversation,
a stop from the other device, and a daemon killed under an open stream."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any
from uuid import UUID

import asyncpg
import pytest

from agentd.accounts import revoke_device
from agentd.providers.demo import expected_answer
from agentd.vocabulary import MessageStatus, RunStatus
from agenttui.client import ConnectionState
from agenttui.conversation import Turn
from agenttui.widgets.transcript import TurnView
from tests.support.daemon import Daemon, SpawnDaemon, poll_until
from tests.support.factories import Device
from tests.tui.conftest import READY_TIMEOUT_S
from tests.tui.helpers import Posts, client_for, running_tui, wait_for


def turns(app) -> list[Turn]:
    model = app.main.model
    return model.turn_list() if model is not None else []


def view(app, turn: Turn) -> TurnView:
    return app.main.transcript.views[turn.key]


async def type_text(pilot, text: str) -> None:
    await pilot.press(*["space" if c == " " else c for c in text])


async def test_message_streams_to_completion(daemon: Daemon, desk: Device,
                                             agenttui_dirs: Path) -> None:
    prompt, tokens = "tell me about leases", 60
    expected = expected_answer("demo", prompt, tokens)
    async with running_tui(daemon.url, desk, agenttui_dirs,
                           params={"tokens": tokens, "delay_ms": 50}) as (app, pilot):
        screen = app.main
        await wait_for(pilot, lambda: "no conversations yet" in screen.bar.plain, "the TUI to boot")
        await type_text(pilot, prompt)
        assert screen.composer.text == prompt
        await pilot.press("enter")

        partial_seen = []

        def finished() -> bool:
            if not turns(app):
                return False
            turn = turns(app)[-1]
            shown = view(app, turn).answer.shown_text if turn.key in screen.transcript.views \
                else ""
            if turn.running and view(app, turn).answer.streaming and \
                    0 < len(shown) < len(expected):
                partial_seen.append(shown)
            return turn.status == RunStatus.COMPLETED

        await wait_for(pilot, finished, "the answer to complete")
        await pilot.pause()
        turn = turns(app)[-1]
        answer = view(app, turn).answer
        assert partial_seen, "the answer never showed up partially: it did not stream"
        assert all(expected.startswith(p) for p in partial_seen)
        assert answer.md.source == expected
        usage = f"{tokens} tokens out · {len(prompt.split())} in"
        # The model that wrote it follows once this device has read it from a snapshot.
        assert answer.status_text in (usage, f"{usage} · demo")
        assert screen.composer.text == ""
        assert screen.bar.plain.startswith("○ idle")
        assert "attached: desk" in screen.bar.plain and "● live" in screen.bar.plain
        assert [c.title for c in screen.conversation_list.conversations] == [prompt]


async def test_tool_calls_show_as_one_compact_line_live_and_after_a_reload(
        daemon: Daemon, desk: Device, laptop: Device, agenttui_dirs: Path) -> None:
    async with client_for(daemon, desk) as api:
        conversation = await api.create_conversation("tools")
    params = {"tokens": 6, "delay_ms": 0, "tool": "calculator"}
    async with running_tui(daemon.url, desk, agenttui_dirs, conversation=conversation.id,
                           params=params) as (app, pilot):
        await wait_for(pilot, lambda: app.main.model and app.main.model.snapshots, "attach")
        app.main.composer.text = "what is 6 * 7?"
        await pilot.press("enter")
        await wait_for(pilot, lambda: turns(app) and turns(app)[-1].finished, "the turn to end")
        await pilot.pause()
        live = view(app, turns(app)[-1])
        assert live.tool_texts == [
            '⚙ calculator(expression="6 * 7") → {"expression": "6 * 7", "value": 42}']
        assert live.answer.md.source.startswith("tool said:")
    # Another device opening the conversation later renders the same line from the transcript.
    async with running_tui(daemon.url, laptop, agenttui_dirs,
                           conversation=conversation.id) as (later, pilot):
        await wait_for(pilot, lambda: turns(later) and turns(later)[-1].finished, "the reload")
        await pilot.pause()
        reloaded = view(later, turns(later)[-1])
        assert reloaded.tool_texts == live.tool_texts
        assert reloaded.answer.md.source == live.answer.md.source


async def test_two_devices_see_the_same_answer_and_each_others_ownership(
        daemon: Daemon, desk: Device, laptop: Device, agenttui_dirs: Path) -> None:
    prompt, tokens = "shared question", 80
    expected = expected_answer("demo", prompt, tokens)
    async with client_for(daemon, desk) as api:
        conversation = await api.create_conversation("shared")
    async with running_tui(daemon.url, desk, agenttui_dirs, conversation=conversation.id,
                           params={"tokens": tokens, "delay_ms": 50}) as (mine, my_pilot), \
            running_tui(daemon.url, laptop, agenttui_dirs,
                        conversation=conversation.id) as (theirs, their_pilot):
        def attached_both(app) -> bool:
            return {"desk", "laptop"} <= {a.device for a in app.main.model.attached} \
                if app.main.model else False

        await wait_for(my_pilot, lambda: attached_both(mine), "desk to see laptop attached")
        await wait_for(their_pilot, lambda: attached_both(theirs), "laptop to see desk attached")
        mine.main.composer.text = prompt
        await my_pilot.press("enter")

        def laptop_sees_desk_running() -> bool:
            bar = theirs.main.bar.plain
            return "● running" in bar and "asked from desk" in bar and "(you)" not in bar

        await wait_for(their_pilot, laptop_sees_desk_running, "laptop to show desk's run")
        bar = theirs.main.bar.plain
        assert "executing on " in bar and "lease " in bar, bar
        assert "attached: " in bar and "desk" in bar and "laptop" in bar, bar
        assert view(theirs, turns(theirs)[-1]).head_text.startswith("desk")
        await wait_for(my_pilot, lambda: "asked from desk (you)" in mine.main.bar.plain
                       or (turns(mine) and turns(mine)[-1].finished), "desk to own the run")

        for app, pilot in ((mine, my_pilot), (theirs, their_pilot)):
            await wait_for(pilot, lambda app=app: turns(app) and
                           turns(app)[-1].status == RunStatus.COMPLETED, "the run to complete")
            await pilot.pause()
            assert view(app, turns(app)[-1]).answer.md.source == expected
            assert app.main.bar.plain.startswith("○ idle")


async def test_stop_from_the_second_device_cancels_the_first_devices_run(
        daemon: Daemon, desk: Device, laptop: Device, agenttui_dirs: Path) -> None:
    async with client_for(daemon, desk) as api:
        conversation = await api.create_conversation("stop me")
    async with running_tui(daemon.url, desk, agenttui_dirs, conversation=conversation.id,
                           params={"tokens": 2000, "delay_ms": 40}) as (mine, my_pilot), \
            running_tui(daemon.url, laptop, agenttui_dirs,
                        conversation=conversation.id) as (theirs, their_pilot):
        await wait_for(my_pilot, lambda: mine.main.model and mine.main.model.snapshots,
                       "desk to attach")
        await wait_for(their_pilot, lambda: theirs.main.model and theirs.main.model.snapshots,
                       "laptop to attach")
        mine.main.composer.text = "a long answer please"
        await my_pilot.press("enter")
        await wait_for(my_pilot, lambda: mine.main.model.asked_here, "the first turn to queue")
        mine.main.composer.text = "and then this follow-up"
        await my_pilot.press("enter")

        def streaming_with_one_queued() -> bool:
            items = turns(theirs)
            return len(items) == 2 and items[0].running and bool(items[0].text) \
                and items[1].queued and "queued #1" in view(theirs, items[1]).head_text

        await wait_for(their_pilot, streaming_with_one_queued,
                       "laptop to see the answer streaming and a turn queued")
        await their_pilot.press("escape")  # Stop, on the device that did not ask

        for app, pilot in ((theirs, their_pilot), (mine, my_pilot)):
            await wait_for(pilot, lambda app=app: len(turns(app)) == 2 and
                           turns(app)[0].status == RunStatus.CANCELLED and
                           turns(app)[1].question_status == MessageStatus.DRAFT,
                           "both turns to end cancelled")
            await pilot.pause()
        await wait_for(my_pilot, lambda: mine.main.composer.text, "the draft to come back")

        state = await api_state(daemon, desk, conversation.id)
        partial = [m for m in state.messages if m.role == "assistant"]
        assert len(partial) == 1 and partial[0].status == MessageStatus.PARTIAL
        assert partial[0].content
        for app in (mine, theirs):
            first, second = turns(app)
            answer = view(app, first).answer
            assert answer.md.source == partial[0].content  # the partial answer, kept
            # Then its tokens and model, once this device has read them (" · demo").
            assert answer.status_text.startswith("⊘ cancelled — partial answer kept")
            assert "draft" in view(app, second).head_text
            assert app.main.bar.plain.startswith("○ idle")
        # The draft returns to the composer of the device that wrote it, and only there.
        assert mine.main.composer.text == "and then this follow-up"
        assert theirs.main.composer.text == ""
        assert "handed back to your composer" in view(mine, turns(mine)[1]).head_text


async def test_drafts_return_in_the_order_they_were_queued_before_what_was_typed(
        daemon: Daemon, desk: Device, agenttui_dirs: Path) -> None:
    async with client_for(daemon, desk) as api:
        conversation = await api.create_conversation("drafts")
    async with running_tui(daemon.url, desk, agenttui_dirs, conversation=conversation.id,
                           params={"tokens": 5, "delay_ms": 60_000}) as (app, pilot):
        screen = app.main
        await wait_for(pilot, lambda: screen.model and screen.model.snapshots, "attach")
        for text in ("think for a minute", "one", "two\nlines", "three"):
            screen.composer.text = text
            await pilot.press("enter")
            await wait_for(pilot, lambda text=text: turns(app) and
                           turns(app)[-1].question == text, f"{text!r} to queue")
        await wait_for(pilot, lambda: turns(app)[0].running and
                       len(screen.model.queued_turns) == 3, "one running, three queued")
        screen.composer.text = "typed meanwhile"
        await pilot.press("escape")
        await wait_for(pilot, lambda: screen.model.state == "idle" and
                       all(t.question_status == MessageStatus.DRAFT for t in turns(app)[1:]),
                       "the stop to land")
        await pilot.pause()
        assert screen.composer.text == "one\n\ntwo\nlines\n\nthree\n\ntyped meanwhile"


async def test_a_draft_handed_back_stays_offered_until_it_is_sent_or_deleted(
        daemon: Daemon, desk: Device, agenttui_dirs: Path) -> None:
    async with client_for(daemon, desk) as api:
        conversation = await api.create_conversation("drafts kept")
    draft = "do not lose me"

    def open_tui(transport: Posts | None = None) -> contextlib.AbstractAsyncContextManager[Any]:
        return running_tui(daemon.url, desk, agenttui_dirs, conversation=conversation.id,
                           transport=transport, params={"tokens": 5, "delay_ms": 60_000})

    async with open_tui() as (app, pilot):
        screen = app.main
        await wait_for(pilot, lambda: screen.model and screen.model.snapshots, "attach")
        for text in ("think for a minute", draft):
            screen.composer.text = text
            await pilot.press("enter")
            await wait_for(pilot, lambda text=text: turns(app) and
                           turns(app)[-1].question == text, f"{text!r} to queue")
        await pilot.press("escape")
        await wait_for(pilot, lambda: screen.composer.text == draft, "the draft back")
        # The terminal goes away (no quit): nothing says the draft was dealt with.
    async with open_tui() as (app, pilot):
        await wait_for(pilot, lambda: app.main.composer.text == draft, "the draft offered again")
        await pilot.press("ctrl+q")  # quit with the draft still in the composer: kept
        await wait_for(pilot, lambda: app.return_code is not None or not app.is_running,
                       "the quit")
    posts = Posts()
    async with open_tui(posts) as (app, pilot):
        screen = app.main
        await wait_for(pilot, lambda: screen.composer.text == draft, "the draft once more")
        posts.refuse_posts = 1
        await pilot.press("enter")  # sent, but refused: back in the composer, still a draft
        await wait_for(pilot, lambda: posts.keys and screen.composer.text == draft,
                       "the refused send back")
        # The terminal goes away again.
    async with open_tui() as (app, pilot):
        screen = app.main
        await wait_for(pilot, lambda: screen.composer.text == draft, "the draft after a refusal")
        screen.composer.text = ""  # deleted: the user does not want it
        await pilot.press("ctrl+q")
        await wait_for(pilot, lambda: app.return_code is not None or not app.is_running,
                       "the quit")
    async with open_tui() as (app, pilot):
        screen = app.main
        await wait_for(pilot, lambda: screen.model and screen.model.snapshots and
                       len(turns(app)) == 2 and
                       turns(app)[1].question_status == MessageStatus.DRAFT, "the conversation")
        draft_id = turns(app)[1].question_id
        assert draft_id in app.drafts, "the deletion was not recorded"
        await pilot.pause()
        assert screen.composer.text == "", "a deleted draft came back"


async def api_state(daemon: Daemon, device: Device, conversation_id: str):
    async with client_for(daemon, device) as api:
        return await api.get_conversation(conversation_id)


async def test_daemon_killed_mid_stream_reconnects_and_shows_the_whole_answer_once(
        request: pytest.FixtureRequest, spawn_daemon: SpawnDaemon, dsn: str, tmp_path: Path,
        desk: Device, laptop: Device, agenttui_dirs: Path) -> None:
    prompt, tokens = "survive the restart", 300
    expected = expected_answer("demo", prompt, tokens)
    worker = spawn_daemon(name="worker")
    await worker.wait_ready(timeout=READY_TIMEOUT_S)
    async with client_for(worker, laptop) as api:
        conversation = await api.create_conversation("restart")
        run = await api.create_run(conversation.id, prompt,  # ~12 s: outlives two restarts
                                   params={"tokens": tokens, "delay_ms": 40})

        async def running() -> bool:
            return (await api.get_run(run.run_id)).status == RunStatus.RUNNING

        await poll_until(running, READY_TIMEOUT_S, what="the worker to claim the run")
    # The TUI's daemon is not the one executing the run: killing it only kills connections.
    front = spawn_daemon(name="front")
    await front.wait_ready(timeout=READY_TIMEOUT_S)
    async with running_tui(front.url, desk, agenttui_dirs,
                           conversation=conversation.id) as (app, pilot):
        await wait_for(pilot, lambda: turns(app) and turns(app)[-1].running and
                       len(turns(app)[-1].text) > 0, "the answer to stream")
        assert "asked from laptop" in app.main.bar.plain
        front.kill()
        await front.wait_exit()
        await wait_for(pilot, lambda: "reconnecting" in app.main.bar.plain,
                       "the bar to show reconnecting")
        text_at_cut = turns(app)[-1].text
        assert text_at_cut and expected.startswith(text_at_cut)

        again = Daemon(dsn=dsn, workdir=tmp_path / "front-2", name="front-2", port=front.port)
        request.node._agentd_daemons.append(again)  # killed and logged like the rest
        again.start()
        await wait_for(pilot, lambda: turns(app)[-1].status == RunStatus.COMPLETED,
                       "the answer to complete after the restart")
        await pilot.pause()
        answer = view(app, turns(app)[-1]).answer
        assert answer.md.source == expected  # nothing repeated, nothing missing
        assert app.main.model.connection.state == ConnectionState.RESUMED
        assert "resumed from seq" in app.main.bar.plain


async def test_a_list_that_cannot_be_read_is_said_once_not_at_every_refresh(
        daemon: Daemon, desk: Device, agenttui_dirs: Path, pool: asyncpg.Pool) -> None:
    """With the device revoked (or the daemon down) the list's refresh, every 30 s, warned
    each time, without end, beside the bar that already said why."""
    async with running_tui(daemon.url, desk, agenttui_dirs) as (app, pilot):
        screen = app.main
        await wait_for(pilot, lambda: screen.me is not None, "the device to log in")
        await revoke_device(pool, UUID(desk.device_id))
        for _ in range(3):
            await screen._refresh_list()
        assert sum("Could not list conversations" in n for n in screen.notices) == 1


async def test_a_conversation_opened_twice_quickly_is_followed(
        daemon: Daemon, desk: Device, agenttui_dirs: Path) -> None:
    """A second open of the same conversation (a double click) cancelled the first before its
    feed began, then saw it open with a feed running (the previous conversation's) and did
    nothing: the conversation showed, never followed, `connecting…` for good."""
    async with client_for(daemon, desk) as api:
        first = await api.create_conversation("first")
        second = await api.create_conversation("second")
    async with running_tui(daemon.url, desk, agenttui_dirs, conversation=first.id) as (
            app, pilot):
        screen = app.main
        await wait_for(pilot, lambda: screen.model and screen.model.snapshots, "the first feed")
        async with screen._render_lock:  # the transcript busy: the open waits for it
            screen.action_open(second.id)
            await pilot.pause()
            screen.action_open(second.id)
            await pilot.pause()
        await wait_for(pilot, lambda: screen.model.conversation_id == second.id and
                       screen.model.snapshots, "the second conversation followed")
