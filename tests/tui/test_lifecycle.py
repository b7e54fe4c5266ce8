"""The conversation life cycle in the TUI, driven by Pilot against live daemons: the model picker,
a selection moving through the transcript, fork, retry, edit and resend, cancelling one queued
turn from another device, archive, delete and usage, each seen live by a second device."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from textual.command import CommandList, CommandPalette
from textual.widgets import OptionList

from agentd.providers.demo import expected_answer
from agentd.vocabulary import MessageStatus, RunStatus
from agenttui.screens.confirm import Confirm
from agenttui.screens.edit import EditPrompt
from agenttui.screens.lifecycle import ANSWER, QUESTION, Selection
from agenttui.screens.models import ModelPicker
from agenttui.widgets.transcript import TurnView
from tests.support.daemon import Daemon, SpawnDaemon
from tests.support.factories import Device
from tests.tui.conftest import READY_TIMEOUT_S
from tests.tui.helpers import Valve, client_for, running_tui, wait_for

FAST = {"tokens": 4, "delay_ms": 0}
SLOW = {"tokens": 2000, "delay_ms": 40}


def turns(app: Any) -> list[Any]:
    model = app.main.model
    return model.turn_list() if model is not None else []


def view(app: Any, key: str) -> TurnView:
    return app.main.transcript.views[key]


def attached(app: Any) -> bool:
    model = app.main.model
    return bool(model and model.snapshots)


@contextlib.asynccontextmanager
async def attached_to_new(daemon: Daemon, device: Device, dirs: Path, title: str,
                          params: dict[str, Any]) -> AsyncIterator[tuple[Any, Any]]:
    """A TUI of `device` attached to a new conversation: (the app, its pilot)."""
    async with client_for(daemon, device) as api:
        conversation = await api.create_conversation(title)
    async with running_tui(daemon.url, device, dirs, conversation=conversation.id,
                           params=params) as (app, pilot):
        await wait_for(pilot, lambda: attached(app), "the TUI to attach")
        yield app, pilot


async def send(app: Any, pilot: Any, text: str) -> None:
    app.main.composer.text = text
    await pilot.press("enter")


async def finished_turns(app: Any, pilot: Any, count: int) -> list[Any]:
    await wait_for(pilot, lambda: len(turns(app)) == count and all(
        t.finished for t in turns(app)), f"{count} finished turns")
    await pilot.pause()
    return turns(app)


async def palette(app: Any, pilot: Any, title: str) -> None:
    """Run a command from the command palette, as a user does: Ctrl+P, its name, Enter."""
    await pilot.press("ctrl+p")
    await wait_for(pilot, lambda: isinstance(app.screen, CommandPalette), "the palette")
    await pilot.press(*[{" ": "space"}.get(c, c) for c in title])
    await wait_for(pilot, lambda: app.screen.query_one(CommandList).option_count and str(
        app.screen.query_one(CommandList).get_option_at_index(0).prompt).startswith(title),
        f"{title!r} to be the palette's first hit")
    await pilot.press("enter")
    await wait_for(pilot, lambda: not isinstance(app.screen, CommandPalette),
                   "the palette to close")


async def two_models(spawn_daemon: SpawnDaemon) -> Daemon:
    daemon = spawn_daemon(env={"AGENTD_DEMO_MODELS": "demo,echo", "OPENAI_API_KEY": "",
                               "ANTHROPIC_API_KEY": ""})
    await daemon.wait_ready(timeout=READY_TIMEOUT_S)
    return daemon


async def test_the_model_picker_sets_the_conversations_model_for_every_device(
        spawn_daemon: SpawnDaemon, desk: Device, laptop: Device, agenttui_dirs: Path) -> None:
    daemon = await two_models(spawn_daemon)
    async with client_for(daemon, desk) as api:
        conversation = await api.create_conversation("models")
    async with running_tui(daemon.url, desk, agenttui_dirs, conversation=conversation.id,
                           params=FAST) as (mine, pilot), \
            running_tui(daemon.url, laptop, agenttui_dirs,
                        conversation=conversation.id) as (theirs, their_pilot):
        await wait_for(pilot, lambda: attached(mine), "desk to attach")
        await wait_for(their_pilot, lambda: attached(theirs), "laptop to attach")
        assert "model demo (default)" in mine.main.bar.plain
        assert "Choose model" in {c.title for c in mine.get_system_commands(mine.screen)}

        await pilot.press("f9")
        picker = await wait_for(pilot, lambda: isinstance(mine.screen, ModelPicker) and
                                mine.screen, "the model picker")
        options = picker.query_one(OptionList)
        labels = {options.get_option_at_index(i).id: options.get_option_at_index(i)
                  for i in range(options.option_count)}
        assert {"demo", "demo:echo", "openai:gpt-4o"} <= set(labels)
        assert labels["openai:gpt-4o"].disabled and not labels["demo:echo"].disabled
        assert "API key" in str(labels["openai:gpt-4o"].prompt)
        options.highlighted = list(labels).index("demo:echo")
        await pilot.press("enter")
        await wait_for(pilot, lambda: mine.screen is mine.main, "the picker to close")

        for app, app_pilot in ((mine, pilot), (theirs, their_pilot)):
            await wait_for(app_pilot, lambda app=app: "model demo:echo" in app.main.bar.plain,
                           "the bar to show the chosen model (live on the other device too)")
        assert (await api_state(daemon, desk, conversation.id)).conversation.model == \
            "demo:echo"

        await send(mine, pilot, "who answers?")
        [turn] = await finished_turns(mine, pilot, 1)
        assert view(mine, turn.key).answer.md.source == expected_answer("echo", "who answers?",
                                                                        4)


async def test_select_a_message_fork_and_you_are_in_the_copy(
        daemon: Daemon, desk: Device, agenttui_dirs: Path) -> None:
    async with attached_to_new(daemon, desk, agenttui_dirs, "original", FAST) as (app, pilot):
        original_id = app.main.model.conversation_id
        await send(app, pilot, "first question")
        await finished_turns(app, pilot, 1)
        await send(app, pilot, "second question")
        first, second = await finished_turns(app, pilot, 2)

        await pilot.press("alt+up")  # from the composer: the last message
        assert app.main.selection == Selection(second.key, ANSWER)
        await pilot.press("alt+up", "alt+up")
        assert app.main.selection == Selection(first.key, ANSWER)
        assert view(app, first.key).answer.has_class("-selected")
        assert "selected: the answer" in app.main.bar.plain
        await pilot.press("alt+up")
        assert app.main.selection == Selection(first.key, QUESTION)
        await pilot.press("alt+down")
        assert app.main.selection == Selection(first.key, ANSWER)

        await pilot.press("f3")
        await wait_for(pilot, lambda: app.main.model and
                       app.main.model.conversation_id != original_id and
                       app.main.model.snapshots, "the TUI to open the copy")
        copy = await finished_turns(app, pilot, 1)
        assert copy[0].question == "first question" and copy[0].text == first.text
        assert app.main.sub_title == "original (fork)"
        assert "copied when forked" in view(app, copy[0].key).head_text
        assert app.main.selection is None
        await wait_for(pilot, lambda: len(app.main.conversation_list.conversations) == 2,
                       "the copy in the list")
        # In the copy, the conversation goes on from the fork point.
        await send(app, pilot, "a different second question")
        await finished_turns(app, pilot, 2)
    original = await api_state(daemon, desk, original_id)
    assert [m.content for m in original.messages if m.role == "user"] == [
        "first question", "second question"]


async def test_retry_and_edit_keep_the_old_exchange_marked_on_every_device(
        daemon: Daemon, desk: Device, laptop: Device, agenttui_dirs: Path) -> None:
    async with client_for(daemon, desk) as api:
        conversation = await api.create_conversation("retry")
    async with running_tui(daemon.url, desk, agenttui_dirs, conversation=conversation.id,
                           params=FAST) as (mine, pilot), \
            running_tui(daemon.url, laptop, agenttui_dirs,
                        conversation=conversation.id) as (theirs, their_pilot):
        await wait_for(pilot, lambda: attached(mine), "desk to attach")
        await wait_for(their_pilot, lambda: attached(theirs), "laptop to attach")
        await send(mine, pilot, "an answer I will not like")
        [old] = await finished_turns(mine, pilot, 1)

        await pilot.press("f4")
        for app, app_pilot in ((mine, pilot), (theirs, their_pilot)):
            first, again = await finished_turns(app, app_pilot, 2)
            await wait_for(app_pilot, lambda app=app: turns(app)[0].superseded,
                           "the old exchange to be marked superseded")
            assert first.key == old.key and again.question == old.question
            assert view(app, first.key).has_class("-superseded")
            assert "superseded" in view(app, first.key).head_text
            assert not again.superseded

        await pilot.press("f5")
        editor = await wait_for(pilot, lambda: isinstance(mine.screen, EditPrompt) and
                                mine.screen, "the editor")
        composer = editor.query_one("#edited")
        assert composer.text == "an answer I will not like"
        composer.text = "a better question"
        await pilot.press("enter")
        for app, app_pilot in ((mine, pilot), (theirs, their_pilot)):
            await finished_turns(app, app_pilot, 3)
            await wait_for(app_pilot, lambda app=app: [t.superseded for t in turns(app)] == [
                True, True, False], "only the edited turn to stand")
            assert turns(app)[2].question == "a better question"
        assert mine.main.composer.text == ""  # the main composer was never touched
    state = await api_state(daemon, desk, conversation.id)
    live = [m.content for m in state.messages if m.role == "user" and not m.superseded_by]
    assert live == ["a better question"]


async def test_an_edit_the_daemon_refuses_comes_back_to_the_composer(
        daemon: Daemon, desk: Device, agenttui_dirs: Path) -> None:
    """The editor closes on Enter: an edit refused (its turn still running) used to take what
    was written in it along, with only a notice left."""
    async with attached_to_new(daemon, desk, agenttui_dirs, "edit refused", SLOW) as (
            app, pilot):
        await send(app, pilot, "a long one")
        await wait_for(pilot, lambda: turns(app) and turns(app)[0].running, "it to run")
        await pilot.press("f5")
        editor = await wait_for(pilot, lambda: isinstance(app.screen, EditPrompt) and
                                app.screen, "the editor")
        editor.query_one("#edited").text = "words I took care over"
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.main.composer.text == "words I took care over",
                       "the refused edit back in the composer")
        assert len(turns(app)) == 1 and turns(app)[0].question == "a long one"


async def test_cancel_one_queued_turn_from_another_device_returns_the_draft_to_its_author(
        daemon: Daemon, desk: Device, laptop: Device, agenttui_dirs: Path) -> None:
    async with client_for(daemon, desk) as api:
        conversation = await api.create_conversation("queue")
    async with running_tui(daemon.url, desk, agenttui_dirs, conversation=conversation.id,
                           params=SLOW) as (mine, pilot), \
            running_tui(daemon.url, laptop, agenttui_dirs,
                        conversation=conversation.id) as (theirs, their_pilot):
        await wait_for(pilot, lambda: attached(mine), "desk to attach")
        await wait_for(their_pilot, lambda: attached(theirs), "laptop to attach")
        await send(mine, pilot, "a long one")
        await wait_for(pilot, lambda: turns(mine) and turns(mine)[0].running, "it to run")
        await send(mine, pilot, "keep these words")
        await send(mine, pilot, "and these after them")
        await wait_for(their_pilot, lambda: len(turns(theirs)) == 3 and turns(theirs)[2].queued,
                       "laptop to see two queued turns")

        # Laptop selects the first queued turn (its question) and cancels just that one.
        await their_pilot.press("alt+up", "alt+up")
        assert theirs.main.selection == Selection(turns(theirs)[1].key, QUESTION)
        await their_pilot.press("ctrl+g")
        for app, app_pilot in ((mine, pilot), (theirs, their_pilot)):
            await wait_for(app_pilot, lambda app=app: turns(app)[1].question_status ==
                           MessageStatus.DRAFT, "the cancelled turn to show as a draft")
        await wait_for(pilot, lambda: mine.main.composer.text == "keep these words",
                       "the draft in its author's composer")
        assert theirs.main.composer.text == ""
        running, cancelled, behind = turns(mine)
        assert running.running and not running.cancel_requested  # the others go on
        assert behind.queued and "queued #1" in view(mine, behind.key).head_text
        assert cancelled.status == RunStatus.CANCELLED
        await pilot.press("escape")
        await wait_for(pilot, lambda: all(t.finished for t in turns(mine)), "the stop")


async def test_archive_then_delete_and_every_device_sees_it_go(
        daemon: Daemon, desk: Device, laptop: Device, agenttui_dirs: Path) -> None:
    async with client_for(daemon, desk) as api:
        stays = await api.create_conversation("stays")
        conversation = await api.create_conversation("goes")
    async with running_tui(daemon.url, desk, agenttui_dirs, conversation=conversation.id,
                           params=FAST) as (mine, pilot), \
            running_tui(daemon.url, laptop, agenttui_dirs,
                        conversation=conversation.id) as (theirs, their_pilot):
        await wait_for(pilot, lambda: attached(mine), "desk to attach")
        await wait_for(their_pilot, lambda: attached(theirs), "laptop to attach")
        await send(mine, pilot, "count my tokens")
        [turn] = await finished_turns(mine, pilot, 1)
        tokens = turn.usage["input_tokens"] + turn.usage["output_tokens"]
        assert view(mine, turn.key).answer.status_text in ("4 tokens out · 3 in",
                                                           "4 tokens out · 3 in · demo")
        for app, app_pilot in ((mine, pilot), (theirs, their_pilot)):
            await wait_for(app_pilot, lambda app=app: f"{tokens:,} tokens" in
                           app.main.bar.plain, "the conversation total on the bar")

        titles = {c.title for c in mine.get_system_commands(mine.screen)}
        assert {"Archive conversation", "Delete conversation", "Show archived conversations",
                "Fork", "Retry", "Edit and resend", "Cancel queued turn"} <= titles
        await palette(mine, pilot, "Archive conversation")
        for app, app_pilot in ((mine, pilot), (theirs, their_pilot)):
            await wait_for(app_pilot, lambda app=app: "archived" in app.main.bar.plain and
                           [c.id for c in app.main.conversation_list.conversations] ==
                           [stays.id], "the archived conversation to leave the lists")
        await palette(mine, pilot, "Show archived conversations")
        await wait_for(pilot, lambda: [c.id for c in mine.main.conversation_list.conversations]
                       == [conversation.id], "the archived list")
        await palette(mine, pilot, "Show conversations")
        await palette(mine, pilot, "Restore conversation")
        await wait_for(their_pilot, lambda: "archived" not in theirs.main.bar.plain and
                       len(theirs.main.conversation_list.conversations) == 2, "the restore")

        await palette(mine, pilot, "Delete conversation")
        confirm = await wait_for(pilot, lambda: isinstance(mine.screen, Confirm), "confirm")
        assert confirm
        await pilot.press("y")
        for app, app_pilot in ((mine, pilot), (theirs, their_pilot)):
            await wait_for(app_pilot, lambda app=app: app.main.model is not None and
                           app.main.model.conversation_id == stays.id,
                           "every device to leave the deleted conversation")
            assert [c.id for c in app.main.conversation_list.conversations] == [stays.id]
        assert "This conversation was deleted on another device." in theirs.main.notices
        assert "Conversation deleted." in mine.main.notices
    async with client_for(daemon, desk) as api:
        assert [c.id for c in await api.list_conversations()] == [stays.id]


async def test_a_conversation_deleted_while_this_device_was_away_is_left(
        daemon: Daemon, desk: Device, laptop: Device, agenttui_dirs: Path) -> None:
    """The deletion's frame never reached the laptop (its link was down): its reconnect met a
    404 and it stayed on a dead screen, every Enter refused. It now leaves the conversation
    as when the deletion is heard."""
    async with client_for(daemon, desk) as api:
        stays = await api.create_conversation("stays")
        goes = await api.create_conversation("goes")
        valve = Valve()
        async with running_tui(daemon.url, laptop, agenttui_dirs, conversation=goes.id,
                               transport=valve) as (theirs, pilot):
            await wait_for(pilot, lambda: attached(theirs), "the laptop to attach")
            valve.down()
            valve.cut()  # the link goes: the feed reconnects, and waits for the host
            await api.delete_conversation(goes.id)
            valve.up()
            await wait_for(pilot, lambda: theirs.main.model is not None and
                           theirs.main.model.conversation_id == stays.id,
                           "the laptop to leave the deleted conversation")
            assert "This conversation was deleted on another device." in theirs.main.notices


async def api_state(daemon: Daemon, device: Device, conversation_id: str) -> Any:
    async with client_for(daemon, device) as api:
        return await api.get_conversation(conversation_id)
