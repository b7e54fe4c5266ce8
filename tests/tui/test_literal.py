"""Users' and models' words are shown as typed: titles, device names, messages, search hits,
palette entries and toasts that look like Textual markup render literally and never raise."""

from __future__ import annotations

from pathlib import Path

import asyncpg
import httpx
import pytest
from textual.widgets import Input

from agentd.vocabulary import RunStatus
from agenttui.screens.prompt import TextPrompt
from tests.support.daemon import Daemon
from tests.support.factories import Device, new_device
from tests.tui.helpers import client_for, running_tui, screen_text, search_for, wait_for

# Each is markup to Textual: styles, a link, a click action, a bare close tag, an open bracket.
HOSTILE_TITLES = ["[bold]x", "[link=http://x]y[/link]", "[@click=app.quit]q[/]", "[/]",
                  "[red"]
HOSTILE_DEVICE = "[b]desk[/b]"
NEEDLE = "needle [/] [bold]hay[/bold] [@click=app.bell]b[/]"


@pytest.fixture
async def hostile(pool: asyncpg.Pool) -> Device:
    return await new_device(pool, "team", HOSTILE_DEVICE)


async def conversations_with_hostile_titles(daemon: Daemon, device: Device) -> dict[str, str]:
    """title -> id; the first title's conversation holds a completed turn quoting NEEDLE."""
    ids = {}
    async with client_for(daemon, device) as api:
        for title in HOSTILE_TITLES:
            ids[title] = (await api.create_conversation(title)).id
        run = await api.create_run(ids[HOSTILE_TITLES[0]], NEEDLE,
                                   params={"tokens": 5, "delay_ms": 0})
        assert (await api.wait_run(run.run_id, wait_s=60)).status == RunStatus.COMPLETED
    return ids


def toasts(app) -> list[str]:
    """The text each toast on the screen paints."""
    return [toast.render().plain for toast in app.screen.query("Toast")]


async def test_list_header_bar_transcript_and_toasts_show_text_as_typed(
        daemon: Daemon, hostile: Device, agenttui_dirs: Path, tmp_path: Path) -> None:
    ids = await conversations_with_hostile_titles(daemon, hostile)
    first = HOSTILE_TITLES[0]
    exports = tmp_path / "[b]exports[/b]"
    async with running_tui(daemon.url, hostile, agenttui_dirs, conversation=ids[first],
                           export_dir=exports, theme="[bold]none[/]",
                           notifications=True) as (app, pilot):
        screen = app.main
        await wait_for(pilot, lambda: screen.model and screen.model.snapshots and
                       f"attached: {HOSTILE_DEVICE}" in screen.bar.plain and
                       len(screen.conversation_list.conversations) == len(HOSTILE_TITLES),
                       "the conversation and the list")
        await pilot.pause()
        # A toast quoting the theme named in the config.
        assert any("Unknown theme '[bold]none[/]'" in text for text in toasts(app)), toasts(app)
        app.clear_notifications()  # it covers part of the transcript
        await wait_for(pilot, lambda: not toasts(app), "the toast to go")
        shown = screen_text(app)
        for title in HOSTILE_TITLES:  # the conversation list
            assert title in shown, title
        assert f"agenttui — {first}" in shown  # the header
        assert f"attached: {HOSTILE_DEVICE}" in shown  # the ownership bar
        assert f"you · {HOSTILE_DEVICE}" in shown and NEEDLE in shown  # the transcript

        # A toast quoting a path.
        await pilot.press("ctrl+s")
        exported = await wait_for(pilot, lambda: list(exports.glob("*.md")), "the export")
        await wait_for(pilot, lambda: any(f"Exported to {exported[0]}" in text
                                          for text in toasts(app)), "the export toast")
        assert app.is_running


async def test_search_palette_and_rename_show_text_as_typed(
        daemon: Daemon, hostile: Device, agenttui_dirs: Path) -> None:
    ids = await conversations_with_hostile_titles(daemon, hostile)
    async with running_tui(daemon.url, hostile, agenttui_dirs,
                           conversation=ids[HOSTILE_TITLES[1]]) as (app, pilot):
        screen = app.main
        await wait_for(pilot, lambda: screen.model and screen.model.snapshots and
                       len(screen.conversation_list.conversations) == len(HOSTILE_TITLES),
                       "the conversation and the list")

        await search_for(app, pilot, "needle")
        await pilot.pause()
        assert f"{HOSTILE_TITLES[0]} · user: {NEEDLE}" in screen_text(app)
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is screen, "search to close")

        await pilot.press("ctrl+p")
        await pilot.press(*"open")
        await wait_for(pilot, lambda: "Open: [link=http://x]y[/link]" in screen_text(app),
                       "the palette's hits")
        for title in HOSTILE_TITLES:
            assert f"Open: {title}" in screen_text(app), title
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is screen, "the palette to close")

        renamed = "[italic]renamed[/] [/]"
        await pilot.press("f2")
        await wait_for(pilot, lambda: isinstance(app.screen, TextPrompt), "the rename prompt")
        app.screen.query_one(Input).value = renamed
        await pilot.press("enter")
        await wait_for(pilot, lambda: renamed in [c.title for c in
                                                  screen.conversation_list.conversations],
                       "the new title in the list")
        await pilot.pause()
        shown = screen_text(app)
        assert f"agenttui — {renamed}" in shown and shown.count(renamed) == 2  # header, list
        assert app.is_running


# What an OS error says, then what a proxy or a DNS name may put in one: all of it markup-like.
REFUSED = "[Errno 111] Connection refused by [b]gw[/b] [@click=app.quit]q[/]"


class _Refused(httpx.AsyncBaseTransport):
    """Every request fails as a refused connection does, with brackets in its text."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(REFUSED, request=request)


async def test_an_app_toast_quoting_an_os_error_shows_its_brackets(
        desk: Device, agenttui_dirs: Path) -> None:
    async with running_tui("http://127.0.0.1:9", desk, agenttui_dirs, transport=_Refused(),
                           notifications=True) as (app, pilot):
        app.action_pair_device()
        shown = await wait_for(pilot, lambda: [t for t in toasts(app)
                                               if "Could not get a pairing code" in t],
                               "the pairing error's toast")
        assert f"ConnectError: {REFUSED}" in shown[0], shown
        assert app.is_running
