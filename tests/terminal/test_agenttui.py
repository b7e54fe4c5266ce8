"""agenttui as a user's terminal drives it: keys in bursts and one by one, a bracketed paste, a
resize, the Stop key, two devices side by side, and a quit that gives the terminal back."""

from __future__ import annotations

import re
import termios

import pytest

from agentd.providers.demo import expected_answer
from agentd.vocabulary import MessageStatus, RunStatus
from agenttui.models import ConversationState
from tests.support.daemon import Daemon, poll_until
from tests.support.factories import Device
from tests.terminal.agenttui import PLACEHOLDER, composer_empty, composer_text, shows
from tests.terminal.conftest import OpenAgentTUI
from tests.terminal.driver import WAIT_S
from tests.tui.helpers import client_for

pytestmark = pytest.mark.terminal

QUICK = {"tokens": 6, "delay_ms": 0}


async def new_conversation(daemon: Daemon, device: Device, title: str) -> str:
    async with client_for(daemon, device) as api:
        return (await api.create_conversation(title)).id


async def conversation(daemon: Daemon, device: Device, conversation_id: str) -> ConversationState:
    async with client_for(daemon, device) as api:
        return await api.get_conversation(conversation_id)


async def questions(daemon: Daemon, device: Device, conversation_id: str) -> list[str]:
    state = await conversation(daemon, device, conversation_id)
    return [m.content for m in state.messages if m.role == "user"]


async def wait_answered(daemon: Daemon, device: Device, conversation_id: str,
                        count: int) -> ConversationState:
    """Until `count` turns ended with a complete answer; returns the conversation."""

    async def answered() -> ConversationState | None:
        state = await conversation(daemon, device, conversation_id)
        done = [m for m in state.messages
                if m.role == "assistant" and m.status == MessageStatus.COMPLETE]
        return state if len(done) >= count and not state.runs else None

    return await poll_until(answered, WAIT_S, interval=0.05, what=f"{count} answers")


def first_words(text: str, count: int = 4) -> str:
    return " ".join(text.split()[:count])


async def ready(terminal, device: Device) -> None:
    await terminal.wait_for(lambda screen: f"attached: {device.name}" in screen and
                            "● live" in screen and composer_empty(screen),
                            what="agenttui to attach to the conversation")


async def test_a_line_and_its_enter_in_one_write_are_sent_once(
        daemon: Daemon, desk: Device, open_agenttui: OpenAgentTUI) -> None:
    conversation_id = await new_conversation(daemon, desk, "bursts")
    terminal = open_agenttui(daemon.url, desk, conversation=conversation_id, params=QUICK)
    await ready(terminal, desk)

    terminal.write_raw("hello from a burst\r")  # one read: the text and its Enter together
    await terminal.wait_for(lambda s: "hello from a burst" in s.split(PLACEHOLDER)[0] and
                            composer_empty(s), what="the message sent and the composer empty")
    await wait_answered(daemon, desk, conversation_id, 1)
    answer = expected_answer("demo", "hello from a burst", 6)
    await terminal.wait_for(lambda s: shows(s, answer), what="the whole answer")
    assert await questions(daemon, desk, conversation_id) == ["hello from a burst"]

    # Several lines in one write: each Enter sends exactly the line before it, in order.
    lines = [f"burst line {n}" for n in range(2, 7)]
    terminal.write_raw("".join(f"{line}\r" for line in lines))
    await wait_answered(daemon, desk, conversation_id, 1 + len(lines))
    await terminal.wait_for(lambda s: lines[-1] in s and composer_empty(s),
                            what="the last line sent")
    assert await questions(daemon, desk, conversation_id) == ["hello from a burst", *lines]


async def test_keys_typed_one_at_a_time_are_sent_on_enter(
        daemon: Daemon, desk: Device, open_agenttui: OpenAgentTUI) -> None:
    conversation_id = await new_conversation(daemon, desk, "typing")
    terminal = open_agenttui(daemon.url, desk, conversation=conversation_id, params=QUICK)
    await ready(terminal, desk)

    await terminal.type("typed one key")
    terminal.press("ctrl+j")  # a line break, not a send
    await terminal.type("at a time")
    await terminal.wait_for(lambda s: composer_text(s) == "typed one key\nat a time",
                            what="both lines in the composer")
    assert await questions(daemon, desk, conversation_id) == []
    terminal.press("enter")
    await wait_answered(daemon, desk, conversation_id, 1)
    await terminal.wait_for(composer_empty, what="the composer to empty")
    assert await questions(daemon, desk, conversation_id) == ["typed one key\nat a time"]


async def test_a_bracketed_paste_stays_text_until_enter_then_goes_whole(
        daemon: Daemon, desk: Device, open_agenttui: OpenAgentTUI) -> None:
    conversation_id = await new_conversation(daemon, desk, "paste")
    terminal = open_agenttui(daemon.url, desk, conversation=conversation_id, params=QUICK)
    await ready(terminal, desk)
    lines = [f"line {n:03d}: " + "pasted text " * 3 for n in range(220)]
    text = "\n".join(lines)
    assert len(text.encode()) > 10_000

    terminal.paste(text)
    # The composer keeps its cursor in view: the paste is in when its last line shows there.
    await terminal.wait_for(lambda s: lines[-1].strip() in (composer_text(s) or ""),
                            what="the pasted text in the composer")
    assert await questions(daemon, desk, conversation_id) == [], "a pasted newline sent"
    terminal.press("enter")
    await wait_answered(daemon, desk, conversation_id, 1)
    await terminal.wait_for(composer_empty, what="the composer to empty")
    assert await questions(daemon, desk, conversation_id) == [text]


async def test_a_resize_lays_the_screen_out_again_and_loses_nothing(
        daemon: Daemon, desk: Device, open_agenttui: OpenAgentTUI) -> None:
    conversation_id = await new_conversation(daemon, desk, "resize")
    async with client_for(daemon, desk) as api:
        run = await api.create_run(conversation_id, "before the resize", params=QUICK)
        assert (await api.wait_run(run.run_id, wait_s=60)).status == RunStatus.COMPLETED
    answer = expected_answer("demo", "before the resize", 6)
    terminal = open_agenttui(daemon.url, desk, conversation=conversation_id, params=QUICK)
    await ready(terminal, desk)
    terminal.write_raw("a draft through resizes")

    for columns, rows in ((72, 20), (130, 40), (100, 30)):
        terminal.resize(columns, rows)

        def laid_out(screen: str, columns: int = columns, rows: int = rows) -> bool:
            lines = screen.split("\n")
            composer = [line for line in lines if "a draft through resizes" in line]
            return (len(lines) == rows and "⏎ Send" in lines[-1] and
                    composer_text(screen) == "a draft through resizes" and
                    # the composer's right edge sits on the new last column
                    bool(composer) and len(composer[0]) == columns and shows(screen, answer))

        await terminal.wait_for(laid_out, what=f"the layout at {columns}x{rows}")
    terminal.press("enter")
    await wait_answered(daemon, desk, conversation_id, 2)
    assert await questions(daemon, desk, conversation_id) == [
        "before the resize", "a draft through resizes"]


async def test_the_stop_key_cancels_the_streaming_turn_on_the_server(
        daemon: Daemon, desk: Device, open_agenttui: OpenAgentTUI) -> None:
    conversation_id = await new_conversation(daemon, desk, "stop")
    terminal = open_agenttui(daemon.url, desk, conversation=conversation_id,
                             params={"tokens": 5000, "delay_ms": 20})
    await ready(terminal, desk)
    terminal.write_raw("a very long answer please\r")
    await terminal.wait_for_text("▍ streaming…")
    terminal.press("escape")
    await terminal.wait_for_text("⊘ cancelled — partial answer kept")
    state = await conversation(daemon, desk, conversation_id)
    [answer] = [m for m in state.messages if m.role == "assistant"]
    async with client_for(daemon, desk) as api:
        run = await api.get_run(answer.run_id or "")
    assert run.status == RunStatus.CANCELLED and run.cancel_requested
    assert answer.status == MessageStatus.PARTIAL and answer.content
    await terminal.wait_for_text("○ idle")


async def test_two_devices_side_by_side_see_one_conversation_stream(
        daemon: Daemon, desk: Device, laptop: Device, open_agenttui: OpenAgentTUI) -> None:
    conversation_id = await new_conversation(daemon, desk, "side by side")
    # 8 s of streaming: room for a slow host; screens tall enough for the whole answer.
    mine = open_agenttui(daemon.url, desk, conversation=conversation_id, size=(100, 50),
                         params={"tokens": 200, "delay_ms": 40})
    theirs = open_agenttui(daemon.url, laptop, conversation=conversation_id, size=(100, 50))
    both = re.compile(r"attached: (desk, laptop|laptop, desk)")
    await mine.wait_for_text(both)
    await theirs.wait_for_text(both)

    mine.write_raw("sent from the desk\r")
    expected = expected_answer("demo", "sent from the desk", 200)
    # The laptop sees the desk's turn run and its answer arrive word by word...
    await theirs.wait_for(lambda s: "● running · asked from desk" in s and "▍ streaming…" in s
                          and shows(s, first_words(expected, 3)) and not shows(s, expected),
                          what="the answer streaming")
    # ...then the whole of it, while its own composer stays untouched.
    await theirs.wait_for(lambda s: "○ idle" in s and shows(s, expected),
                          what="the whole answer on the laptop")
    await wait_answered(daemon, desk, conversation_id, 1)
    assert composer_empty(theirs.screen_text())
    assert "sent from the desk" in theirs.screen_text()


async def test_quit_gives_the_terminal_back(daemon: Daemon, desk: Device,
                                           open_agenttui: OpenAgentTUI) -> None:
    terminal = open_agenttui(daemon.url, desk)
    await terminal.wait_for_text("type a message to start one")
    lflag = terminal.termios()[3]
    assert not lflag & (termios.ECHO | termios.ICANON), "the app runs the terminal raw"
    assert terminal.cursor_hidden

    terminal.press("ctrl+q")
    assert await terminal.wait_exit() == 0
    # The terminal's settings are the ones it had before: echo, line editing, signals.
    after, before = terminal.termios(), terminal.initial_termios
    assert after[:4] == before[:4]
    assert after[3] & termios.ECHO and after[3] & termios.ICANON and after[3] & termios.ISIG
    # Every mode the app switched on, it switched off again, last.
    output = terminal.output
    for on, off in ((b"\x1b[?1049h", b"\x1b[?1049l"),  # alternate screen
                    (b"\x1b[?25l", b"\x1b[?25h"),  # cursor hidden
                    (b"\x1b[?2004h", b"\x1b[?2004l"),  # bracketed paste
                    (b"\x1b[?1000h", b"\x1b[?1000l"),  # mouse reports
                    (b"\x1b[?1006h", b"\x1b[?1006l")):
        assert 0 <= output.rfind(on) < output.rfind(off), (on, off)
    assert not terminal.cursor_hidden


async def test_text_from_elsewhere_never_drives_the_terminal(
        daemon: Daemon, desk: Device, laptop: Device, open_agenttui: OpenAgentTUI) -> None:
    """A question another device sent, a title, an answer: their control characters went to the
    terminal as they were (Rich and Textual strip only a few), so `ESC ] 52` set the
    clipboard, `ESC [ 2 J` cleared the screen, `ESC ] 0` retitled the window."""
    clipboard = "\x1b]52;c;SU5KRUNURUQ=\x07"
    title = "\x1b]0;pwned-title\x07plain title"
    question = f"look {clipboard} here \x1b[2Jcleared \x1b[31mred\x1b[0m end"
    async with client_for(daemon, desk) as api:
        conversation_id = (await api.create_conversation(title)).id
    theirs = open_agenttui(daemon.url, laptop, conversation=conversation_id)
    await ready(theirs, laptop)
    async with client_for(daemon, desk) as api:
        await api.create_run(conversation_id, question, params=QUICK)
    # The text shows, its controls gone (what followed each ESC is ordinary text).
    await theirs.wait_for_text("]52;c;SU5KRUNURUQ=")
    await theirs.wait_for_text("[2Jcleared [31mred[0m end")
    await theirs.wait_for_text("plain title")
    await wait_answered(daemon, desk, conversation_id, 1)
    raw = theirs.output
    for sent in (b"\x1b]52;c;SU5K", b"\x1b[2Jcleared", b"\x1b]0;pwned", b"\x1b[31mred"):
        assert sent not in raw, sent
