"""The real agenttui binary on a pseudo-terminal opens a 2,000-message conversation: its last
answer shows (polled against a deadline; bench/tui.py measures how fast), and PageUp from the
composer scrolls back to earlier answers."""

from __future__ import annotations

import re
import uuid

import asyncpg
import pytest

from tests.support.daemon import Daemon
from tests.support.factories import Device
from tests.support.long_conversation import last_line, write_long_conversation
from tests.terminal.agenttui import composer_empty
from tests.terminal.conftest import OpenAgentTUI
from tests.tui.helpers import client_for

pytestmark = pytest.mark.terminal

TURNS = 1000
PAGE_UP = b"\x1b[5~"  # what a terminal sends for PageUp


async def test_a_2000_message_conversation_opens_on_its_last_answer(
        daemon: Daemon, pool: asyncpg.Pool, desk: Device,
        open_agenttui: OpenAgentTUI) -> None:
    async with client_for(daemon, desk) as api:
        me = await api.me()
        created = await api.create_conversation("long")
    long = await write_long_conversation(
        pool, account_id=uuid.UUID(me.account_id), device_id=uuid.UUID(desk.device_id),
        conversation_id=uuid.UUID(created.id), turns=TURNS)
    assert long.messages == 2000

    terminal = open_agenttui(daemon.url, desk, conversation=created.id)
    await terminal.wait_for_text(last_line(TURNS))

    terminal.write_raw(PAGE_UP * 8)
    earlier = await terminal.wait_for_text(re.compile(r"End of answer (9[0-8]\d|99[0-5])\."))
    assert earlier != last_line(TURNS)


async def test_short_turns_on_a_tall_terminal_fill_it_and_page_back(
        daemon: Daemon, pool: asyncpg.Pool, desk: Device,
        open_agenttui: OpenAgentTUI) -> None:
    """One-line answers on a 100-line terminal: the screen fills with the newest turns, the
    last at the bottom and staying there while it fills, a turn asked then shows below them,
    and PageUp reaches earlier ones. (That the window then keeps them mounted instead of
    trimming back to its usual size, which moved the view off the newest with "↓ 8 newer
    turns", is asserted in tests/tui/test_long_conversation.py: here it would take waiting
    for something not to happen.)"""
    async with client_for(daemon, desk) as api:
        me = await api.me()
        created = await api.create_conversation("short")
    await write_long_conversation(
        pool, account_id=uuid.UUID(me.account_id), device_id=uuid.UUID(desk.device_id),
        conversation_id=uuid.UUID(created.id), turns=TURNS, answer_of=lambda n: f"Short {n}.")

    terminal = open_agenttui(daemon.url, desk, conversation=created.id, size=(110, 100),
                             record_screens=True)
    # A 100-line screen holds well over a dozen such turns: the newest and one 12 before it.
    await terminal.wait_for(
        lambda screen: f"Short {TURNS}." in screen and f"Short {TURNS - 12}." in screen,
        what="the screen full of the newest turns")
    # Filling the screen mounts a few pages of older turns above the newest. Once the newest
    # was on the screen, it never left it on the way: no frame pushed it out of view with a
    # blank band above (what Textual drew while the turns were shorter than the screen).
    newest = f"Short {TURNS}."
    screens = terminal.screens
    shown = next(n for n, screen in enumerate(screens) if newest in screen)
    left = [screen for screen in screens[shown:] if newest not in screen]
    assert not left, f"the newest turn left the screen while it filled:\n{left[0]}"
    # And the view still follows the newest: a turn asked now shows at the bottom.
    await terminal.type("one more short question")
    terminal.press("enter")
    await terminal.wait_for(
        lambda screen: composer_empty(screen) and "one more short question" in screen,
        what="the new question in the transcript")

    terminal.write_raw(PAGE_UP * 10)
    earlier = await terminal.wait_for_text(re.compile(r"Short (9[0-7]\d)\."))
    assert earlier != f"Short {TURNS}."
