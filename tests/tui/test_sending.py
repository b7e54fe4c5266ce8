"""Sending from the TUI when the network is slow or loses answers, against a live daemon: a
message lands in the conversation it was typed in, a send whose answer was lost is resent
without a duplicate, and a feed that gave up starts again when its conversation is selected."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agenttui.client import ConnectionState
from agenttui.screens import main as main_screen
from tests.support.daemon import Daemon, poll_until
from tests.support.factories import Device
from tests.tui.helpers import WAIT_S, Posts, client_for, running_tui, wait_for

QUICK = {"tokens": 3, "delay_ms": 0}
FIRST = "Plan:\n\nfirst words"


async def user_messages(daemon: Daemon, device: Device, conversation_id: str) -> list[str]:
    async with client_for(daemon, device) as api:
        state = await api.get_conversation(conversation_id)
    return [m.content for m in state.messages if m.role == "user"]


@contextlib.asynccontextmanager
async def sending_tui(daemon: Daemon, device: Device, dirs: Path, title: str,
                      ) -> AsyncIterator[tuple[str, Posts, Any, Any]]:
    """A TUI attached to a new conversation, its posts through a Posts transport: (the
    conversation's id, the transport, the main screen, the pilot)."""
    async with client_for(daemon, device) as api:
        conversation = (await api.create_conversation(title)).id
    posts = Posts()
    async with running_tui(daemon.url, device, dirs, conversation=conversation,
                           transport=posts, params=QUICK) as (app, pilot):
        screen = app.main
        await wait_for(pilot, lambda: screen.model and screen.model.snapshots, "the feed")
        yield conversation, posts, screen, pilot


async def sent_uncertain(pilot: Any, screen: Any, text: str) -> None:
    """Send `text` and wait until it is back in the composer with the warning that it may
    have been sent (its answer lost, or not the daemon's)."""
    screen.composer.text = text
    await pilot.press("enter")
    await wait_for(pilot, lambda: screen.composer.text == text and
                   any("may not have been sent" in n for n in screen.notices),
                   "the text back, with a warning that says it may have been sent")


async def test_a_message_goes_where_it_was_typed_though_a_slow_send_outlasts_a_switch(
        daemon: Daemon, desk: Device, agenttui_dirs: Path) -> None:
    async with client_for(daemon, desk) as api:
        first = (await api.create_conversation("typed here")).id
        second = (await api.create_conversation("moved on to")).id
    posts = Posts()
    async with running_tui(daemon.url, desk, agenttui_dirs, conversation=first,
                           transport=posts, params=QUICK) as (app, pilot):
        screen = app.main
        await wait_for(pilot, lambda: screen.model and screen.model.snapshots, "the feed")
        posts.hold()
        screen.composer.text = "one"
        await pilot.press("enter")
        await wait_for(pilot, lambda: posts.held == 1, "the first send to wait on the daemon")
        screen.composer.text = "two"  # typed in the same conversation, sent behind "one"
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.composer.text == "", "the second Enter")
        screen.action_open(second)
        await wait_for(pilot, lambda: screen.model.conversation_id == second and
                       screen.model.snapshots, "the other conversation")
        posts.release()

        async def both_posted() -> bool:
            return len(await user_messages(daemon, desk, first)) + \
                len(await user_messages(daemon, desk, second)) >= 2

        await poll_until(both_posted, WAIT_S, interval=0.05, what="both messages posted")
        assert await user_messages(daemon, desk, first) == ["one", "two"]
        assert await user_messages(daemon, desk, second) == []
        await wait_for(pilot, lambda: any("sent to the conversation it was typed in" in n
                                          for n in screen.notices), "the notice")


async def test_two_lost_sends_handed_back_together_are_resent_one_by_one(
        daemon: Daemon, desk: Device, agenttui_dirs: Path) -> None:
    """Two sends whose answers were both lost come back as one composer text. Only the second
    one's key was kept, so Enter posted a third turn, both texts joined, beside the two that
    had reached the daemon. Each now goes again under its own key: both are replayed."""
    async with sending_tui(daemon, desk, agenttui_dirs, "two lost") as (
            conversation, posts, screen, pilot):
        posts.lose_answers = True
        posts.hold()  # a slow link: the second is typed and sent while the first waits
        screen.composer.text = FIRST  # a message with a blank line of its own
        await pilot.press("enter")
        await wait_for(pilot, lambda: posts.held == 1, "the first send to wait on the daemon")
        screen.composer.text = "second words"
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.composer.text == "", "the second Enter")
        posts.release()
        await wait_for(pilot, lambda: screen.composer.text == FIRST + "\n\nsecond words",
                       "both texts back in the composer, in order")
        assert await user_messages(daemon, desk, conversation) == [FIRST, "second words"]
        posts.lose_answers = False
        await pilot.press("enter")  # both, unchanged
        await wait_for(pilot, lambda: screen.composer.text == "" and
                       sum("had reached the daemon" in n for n in screen.notices) == 2,
                       "both sends replayed")
        assert await user_messages(daemon, desk, conversation) == [FIRST, "second words"]


async def test_a_send_answered_with_something_not_agentds_is_kept_and_not_doubled(
        daemon: Daemon, desk: Device, agenttui_dirs: Path) -> None:
    """A 2xx whose body is not the daemon's (a proxy's page): the send failed inside the worker
    with a JSON error, after Enter had cleared the composer, and the text was gone."""
    async with sending_tui(daemon, desk, agenttui_dirs, "garbled") as (
            conversation, posts, screen, pilot):
        posts.garble_answers = True
        await sent_uncertain(pilot, screen, "keep me")
        assert await user_messages(daemon, desk, conversation) == ["keep me"]  # it was
        posts.garble_answers = False
        await pilot.press("enter")
        await wait_for(pilot, lambda: any("had reached the daemon" in n
                                          for n in screen.notices), "the replayed send")
        assert await user_messages(daemon, desk, conversation) == ["keep me"]


async def test_the_same_words_typed_anew_after_a_lost_send_landed_are_a_new_turn(
        daemon: Daemon, desk: Device, agenttui_dirs: Path) -> None:
    """A lost send that the feed then showed landed: its copy deleted from the composer, the
    same words typed again later were matched to it and posted under its key, so the daemon
    replayed the old turn and the new one was never queued."""
    async with sending_tui(daemon, desk, agenttui_dirs, "same words") as (
            conversation, posts, screen, pilot):
        posts.lose_answers = True
        await sent_uncertain(pilot, screen, "yes")
        posts.lose_answers = False
        await wait_for(pilot, lambda: screen.model is not None and any(
            t.question == "yes" for t in screen.model.turns.values()), "the feed to show it")
        screen.composer.text = ""  # the user sees it landed and deletes the copy
        await pilot.pause()
        screen.composer.text = "yes"  # later: the same answer to a new question
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.composer.text == "", "the send")

        async def two() -> list[str] | None:
            messages = await user_messages(daemon, desk, conversation)
            return messages if len(messages) == 2 else None

        assert await poll_until(two, WAIT_S, what="the second turn") == ["yes", "yes"]


async def test_a_lost_send_with_words_typed_after_it_key_by_key_is_not_doubled(
        daemon: Daemon, desk: Device, agenttui_dirs: Path) -> None:
    """The lost send is back in the composer; the user types a new paragraph after it, key by
    key. Its first newline left text that was neither the copy alone nor the copy and a blank
    line: the copy was forgotten, and Enter posted it again inside a new message."""
    async with sending_tui(daemon, desk, agenttui_dirs, "typed after") as (
            conversation, posts, screen, pilot):
        posts.lose_answers = True
        await sent_uncertain(pilot, screen, "lost one")
        posts.lose_answers = False
        screen.composer.move_cursor(screen.composer.document.end)
        await pilot.press("ctrl+j", "ctrl+j", *"more")
        assert screen.composer.text == "lost one\n\nmore"
        await pilot.press("enter")

        async def both() -> list[str] | None:
            messages = await user_messages(daemon, desk, conversation)
            return messages if len(messages) >= 2 else None

        assert await poll_until(both, WAIT_S, what="the new message") == ["lost one", "more"]
        await wait_for(pilot, lambda: any("had reached the daemon" in n
                                          for n in screen.notices), "the replayed send")


async def test_a_send_whose_answer_was_lost_is_resent_without_a_second_turn(
        daemon: Daemon, desk: Device, agenttui_dirs: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with sending_tui(daemon, desk, agenttui_dirs, "lost answers") as (
            conversation, posts, screen, pilot):
        posts.lose_answers = True
        await sent_uncertain(pilot, screen, "only once")
        assert not any(n.startswith("Not sent") for n in screen.notices)
        assert await user_messages(daemon, desk, conversation) == ["only once"]  # it was

        posts.lose_answers = False
        await pilot.press("enter")  # the same text, unchanged
        await wait_for(pilot, lambda: any("had reached the daemon" in n
                                          for n in screen.notices), "the replayed send")
        assert screen.composer.text == ""
        assert await user_messages(daemon, desk, conversation) == ["only once"]
        assert len(posts.keys) >= 2 and len(set(posts.keys)) == 1, posts.keys

        # Another text is another message: a key of its own.
        screen.composer.text = "something else"
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(posts.keys) > 1 and posts.keys[-1] != posts.keys[0],
                       "the next post")

        async def posted() -> list[str] | None:
            messages = await user_messages(daemon, desk, conversation)
            return messages if len(messages) >= 2 else None

        assert await poll_until(posted, WAIT_S, interval=0.05, what="the second message") == [
            "only once", "something else"]

        # The same text typed again long after a lost answer is a new message: its own key.
        posts.lose_answers = True
        screen.composer.text = "later"
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.composer.text == "later", "the text back")
        lost_key = posts.keys[-1]
        posts.lose_answers = False
        monkeypatch.setattr(main_screen, "RESEND_WINDOW_S", 0.0)  # the window has passed
        await pilot.press("enter")
        await wait_for(pilot, lambda: posts.keys[-1] != lost_key, "a post with a new key")


async def test_a_lost_send_resent_after_its_settings_changed_is_known_posted(
        daemon: Daemon, desk: Device, agenttui_dirs: Path) -> None:
    """A send whose answer was lost had landed; the params (or the model) change before it is
    sent again, so the daemon answers its key with 409 idempotency_conflict. That 409 says the
    first post went in: the TUI used to say "Not sent" and hand the text back, and sending it
    once more posted it twice."""
    async with sending_tui(daemon, desk, agenttui_dirs, "lost, then changed") as (
            conversation, posts, screen, pilot):
        posts.lose_answers = True
        screen.composer.text = "only once"
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.composer.text == "only once",
                       "the lost send back in the composer")
        posts.lose_answers = False
        screen.app.settings = dataclasses.replace(screen.app.settings,
                                                  params={"tokens": 4, "delay_ms": 0})
        await pilot.press("enter")
        await wait_for(pilot, lambda: any("had reached the daemon" in n
                                          for n in screen.notices), "the send known posted")
        assert screen.composer.text == ""
        assert not any(n.startswith("Not sent") for n in screen.notices)
        assert await user_messages(daemon, desk, conversation) == ["only once"]


async def test_a_message_sent_behind_an_uncertain_one_leaves_it_its_resend(
        daemon: Daemon, desk: Device, agenttui_dirs: Path) -> None:
    async with sending_tui(daemon, desk, agenttui_dirs, "one behind the other") as (
            conversation, posts, screen, pilot):
        posts.hold()
        posts.lose_for = {"first"}
        screen.composer.text = "first"
        await pilot.press("enter")
        await wait_for(pilot, lambda: posts.held == 1, "the first send to wait on the daemon")
        screen.composer.text = "second"  # queued behind "first", sent once it is settled
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.composer.text == "", "the second Enter")
        posts.release()

        async def both() -> bool:
            return len(await user_messages(daemon, desk, conversation)) >= 2

        await poll_until(both, WAIT_S, interval=0.05, what="both messages posted")
        await wait_for(pilot, lambda: screen.composer.text == "first" and
                       any("may not have been sent" in n for n in screen.notices),
                       "the first text back, uncertain")
        posts.lose_for = set()
        await pilot.press("enter")  # "first" again, exactly as it was
        await wait_for(pilot, lambda: any("had reached the daemon" in n
                                          for n in screen.notices), "the replayed send")
        assert await user_messages(daemon, desk, conversation) == ["first", "second"]


async def test_selecting_a_conversation_whose_feed_gave_up_starts_it_again(
        daemon: Daemon, desk: Device, agenttui_dirs: Path) -> None:
    async with client_for(daemon, desk) as api:
        conversation = (await api.create_conversation("refused once")).id
    posts = Posts()
    posts.refuse_feeds = 1
    async with running_tui(daemon.url, desk, agenttui_dirs, conversation=conversation,
                           transport=posts) as (app, pilot):
        screen = app.main
        await wait_for(pilot, lambda: screen.model and
                       screen.model.connection.state == ConnectionState.CLOSED and
                       "✗ disconnected: refused by the test" in screen.bar.plain,
                       "the feed to give up")
        await wait_for(pilot, lambda: screen.conversation_list.conversations, "the list")
        await pilot.press("ctrl+l")  # the list, on the open conversation
        assert screen.conversation_list.current == conversation
        await pilot.press("enter")  # selected again
        await wait_for(pilot, lambda: screen.model.connection.connected and
                       screen.model.snapshots and "● live" in screen.bar.plain,
                       "the feed to follow the conversation again")
        assert screen.model.conversation_id == conversation


async def test_a_lost_send_handed_back_with_more_text_is_replayed_and_the_rest_posted_new(
        daemon: Daemon, desk: Device, agenttui_dirs: Path) -> None:
    """A send whose answer was lost comes back to the composer; the user writes more below it
    and sends. The whole went out as one new message, so the lost send, which had reached the
    daemon, was posted a second time inside it. Now the lost send goes again under its own key
    (replayed, not posted twice) and the text below it as a message of its own."""
    async with sending_tui(daemon, desk, agenttui_dirs, "lost and more") as (
            conversation, posts, screen, pilot):
        posts.lose_for = {FIRST}
        screen.composer.text = FIRST  # a message with a blank line of its own
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.composer.text == FIRST and
                       any("may not have been sent" in n for n in screen.notices),
                       "the lost send back in the composer")
        assert await user_messages(daemon, desk, conversation) == [FIRST]  # it was posted
        posts.lose_for = set()
        screen.composer.text = FIRST + "\n\nand one more thing"  # typed below it
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.composer.text == "" and
                       any("had reached the daemon" in n for n in screen.notices),
                       "the lost send replayed")

        async def both() -> list[str] | None:
            messages = await user_messages(daemon, desk, conversation)
            return messages if len(messages) >= 2 else None

        assert await poll_until(both, WAIT_S, what="the new message posted") == [
            FIRST, "and one more thing"]


async def test_a_lost_send_edited_where_it_stands_is_a_new_message(
        daemon: Daemon, desk: Device, agenttui_dirs: Path) -> None:
    """Words added at the end of a lost send's own line change that message: it goes whole, as
    a new message, not as the lost send replayed with the words posted apart."""
    async with sending_tui(daemon, desk, agenttui_dirs, "lost and edited") as (
            conversation, posts, screen, pilot):
        posts.lose_for = {"edit me"}
        screen.composer.text = "edit me"
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.composer.text == "edit me" and
                       any("may not have been sent" in n for n in screen.notices),
                       "the lost send back in the composer")
        posts.lose_for = set()
        screen.composer.text = "edit me, please"
        await pilot.press("enter")

        async def both() -> list[str] | None:
            messages = await user_messages(daemon, desk, conversation)
            return messages if len(messages) >= 2 else None

        assert await poll_until(both, WAIT_S, what="the edited message posted") == [
            "edit me", "edit me, please"]
        assert not any("had reached the daemon" in n for n in screen.notices)
