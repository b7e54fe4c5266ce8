"""Pair another device from a logged-in TUI: the palette entry, the line it shows, and that the
line's code really attaches a new device; and how the status line shows the link's security."""

from __future__ import annotations

import stat
from pathlib import Path

from textual.widgets import Static

from agenttui.locations import clipboard_file
from agenttui.screens.pairing import PairingScreen
from agenttui.widgets.ownership_bar import link_text
from tests.support.daemon import Daemon
from tests.support.factories import Device
from tests.tui.helpers import running_tui, wait_for


async def test_the_palette_pairs_another_device(daemon: Daemon, desk: Device,
                                                agenttui_dirs: Path) -> None:
    async with running_tui(daemon.url, desk, agenttui_dirs) as (app, pilot):
        assert "Pair another device" in {c.title for c in app.get_system_commands(app.screen)}
        await pilot.press("ctrl+p")
        await pilot.press(*"Pair another")
        await wait_for(pilot, lambda: "Pair another device" in str(
            app.screen.query("OptionList").first().get_option_at_index(0).prompt)
            if app.screen.query("OptionList") else False, "the palette to offer pairing")
        await pilot.press("enter")
        screen = await wait_for(pilot, lambda: app.screen if isinstance(
            app.screen, PairingScreen) else None, "the pairing screen")
        line = str(screen.query_one("#pairing-command", Static).render())
        assert line.startswith(f"agenttui login {daemon.url} --code ")
        assert "plain HTTP" in " ".join(str(label.render()) for label in screen.query("Label"))
        await pilot.press("c")
        await wait_for(pilot, lambda: clipboard_file().exists()
                       and clipboard_file().read_text() == line, "the line on the clipboard")
        # The one-time code is in that file: readable by this user only.
        assert stat.S_IMODE(clipboard_file().stat().st_mode) == 0o600
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, PairingScreen), "it to close")

    code = line.split("--code ")[1].split()[0]
    async with daemon.client() as anonymous:
        paired = await anonymous.post("/v1/pair", json={"code": code, "device": "tablet"})
    assert paired.status_code == 201, paired.text
    assert paired.json()["account"] == "team"


async def test_without_the_server_the_palette_entry_says_why(desk: Device,
                                                             agenttui_dirs: Path) -> None:
    async with running_tui("http://127.0.0.1:9", desk, agenttui_dirs) as (app, pilot):
        app.action_pair_device()
        await wait_for(pilot, lambda: any("Could not get a pairing code" in str(n.message)
                                          for n in app._notifications), "the notice")


def test_the_status_line_names_the_links_protection() -> None:
    pin = "SHA256:uNiVztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s"
    assert link_text("https://desk.lan:8740", pin) == (
        "🔒 encrypted · pinned SHA256:uNiVztks…", "green")
    assert link_text("https://desk.lan:8740", None) == ("🔒 encrypted", "green")
    assert link_text("http://127.0.0.1:8740", None) is None  # this machine: nothing to say
    assert link_text("http://desk.lan:8740", None) == ("⚠ not encrypted", "bold red")
