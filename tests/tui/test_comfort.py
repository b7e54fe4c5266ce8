"""Keys with ids (remapped from config), F1 help, the command palette, the newline key, and the
comfort actions against a live daemon: copy, export, search, rename, new conversation."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from textual.binding import Binding
from textual.widgets import Input, OptionList, TextArea

from agentd.providers.demo import expected_answer
from agentd.vocabulary import RunStatus
from agenttui.app import AgentTUI
from agenttui.locations import clipboard_file
from agenttui.screens import main as main_screen
from agenttui.screens.help import HelpScreen
from agenttui.screens.lifecycle import LifecycleScreen
from agenttui.screens.main import MainScreen, last_code_block
from agenttui.widgets.composer import Composer
from agenttui.widgets.conversation_list import MORE
from tests.support.daemon import Daemon
from tests.support.factories import Device
from tests.tui.helpers import client_for, running_tui, search_for, wait_for

NOWHERE = "http://127.0.0.1:9"  # nothing listens there: the app keeps retrying


def test_every_binding_has_a_unique_id_and_none_shadows_the_composers_keys() -> None:
    bindings = [*MainScreen.BINDINGS, *LifecycleScreen.BINDINGS, *Composer.BINDINGS,
                *AgentTUI.BINDINGS]
    assert all(isinstance(b, Binding) and b.id for b in bindings)
    ids = [b.id for b in bindings if isinstance(b, Binding)]
    assert len(ids) == len(set(ids))
    editing = {key for b in TextArea.BINDINGS if isinstance(b, Binding)
               for key in b.key.split(",")}
    screen_keys = {key for b in [*MainScreen.BINDINGS, *LifecycleScreen.BINDINGS]
                   if isinstance(b, Binding) for key in b.key.split(",")}
    assert not screen_keys & editing, screen_keys & editing
    assert {"stop", "send", "newline", "help", "copy_answer", "copy_code", "search", "export",
            "new_conversation", "rename_conversation", "quit", "choose_model", "fork",
            "retry", "edit", "cancel_queued", "select_previous", "select_next"} <= set(ids)


def test_last_code_block_takes_the_last_fence() -> None:
    text = "intro\n```python\nprint(1)\n```\nthen\n~~~\nls -l\n~~~\nend"
    assert last_code_block(text) == "ls -l\n"
    assert last_code_block("no code here") is None


async def test_keys_remap_from_config_and_f1_shows_the_mapping(desk: Device,
                                                               agenttui_dirs: Path) -> None:
    async with running_tui(NOWHERE, desk, agenttui_dirs, keys={"stop": "f8"},
                           theme="nord") as (app, pilot):
        screen = app.main
        assert app.theme == "nord"
        await wait_for(pilot, lambda: "cannot reach" in screen.bar.plain, "the retry notice")
        active = {key: b.binding.action for key, b in app.active_bindings.items()}
        assert active.get("f8") == "stop" and active.get("escape") != "stop"
        await pilot.press("f8")
        await wait_for(pilot, lambda: "No conversation is open." in screen.notices,
                       "the remapped stop key to act")

        await pilot.press("a", "ctrl+j", "b")
        assert screen.composer.text == "a\nb"
        await pilot.press("enter")  # no daemon: the message must not be lost
        await wait_for(pilot, lambda: any(n.startswith("Not connected") for n in screen.notices),
                       "the send to be refused")
        assert screen.composer.text == "a\nb"

        await pilot.press("f1")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), "the help screen")
        assert "| `f8` | Stop | `stop` |" in app.screen.query_one("Markdown").source
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is screen, "help to close")

        titles = {c.title for c in app.get_system_commands(app.screen)}
        assert {"New conversation", "Rename conversation", "Stop", "Copy last answer",
                "Copy last code block", "Search conversations", "Export as Markdown",
                "Help"} <= titles


async def test_a_remapped_send_key_sends_and_enter_can_become_the_newline(
        desk: Device, agenttui_dirs: Path) -> None:
    async with running_tui(NOWHERE, desk, agenttui_dirs,
                           keys={"send": "f5", "newline": "enter"}) as (app, pilot):
        screen = app.main
        await pilot.press("a", "enter", "b")
        assert screen.composer.text == "a\nb"
        await pilot.press("f5")  # no daemon: refused, and the text stays
        await wait_for(pilot, lambda: any(n.startswith("Not connected") for n in screen.notices),
                       "the send to be tried")
        assert screen.composer.text == "a\nb"


async def test_text_put_back_keeps_its_order_and_what_was_typed(desk: Device,
                                                                agenttui_dirs: Path) -> None:
    async with running_tui(NOWHERE, desk, agenttui_dirs) as (app, _pilot):
        composer = app.main.composer
        composer.text = "look"
        for text in ("ok", "then\nthis", "ok"):  # the second "ok" is already there
            composer.put_back(text)
        assert composer.text == "ok\n\nthen\nthis\n\nlook"
        composer.text = "edited"
        composer.put_back("after an edit")
        assert composer.text == "after an edit\n\nedited"
        # A send that failed always comes back, also when its text is a paragraph of another
        # text there (it was dropped as if already here, though only its words were).
        composer.text = ""
        composer.put_back("Run the migration.\n\nthanks", unless_here=False)
        composer.put_back("thanks", unless_here=False)
        assert composer.text == "Run the migration.\n\nthanks\n\nthanks"


async def test_copy_export_search_rename_and_new(daemon: Daemon, desk: Device,
                                                 agenttui_dirs: Path, tmp_path: Path) -> None:
    answers = {}
    async with client_for(daemon, desk) as api:
        for title, prompt in (("Alpha notes", "alpha question"), ("Beta notes", "beta question")):
            conversation = await api.create_conversation(title)
            run = await api.create_run(conversation.id, prompt,
                                       params={"tokens": 12, "delay_ms": 0})
            assert (await api.wait_run(run.run_id, wait_s=60)).status == RunStatus.COMPLETED
            answers[title] = (conversation.id, expected_answer("demo", prompt, 12))
        gamma = (await api.create_conversation("Gamma plans")).id  # no message yet
    alpha, alpha_answer = answers["Alpha notes"]
    beta, beta_answer = answers["Beta notes"]
    exports = tmp_path / "exports"
    async with running_tui(daemon.url, desk, agenttui_dirs, conversation=alpha,
                           export_dir=exports) as (app, pilot):
        screen = app.main

        def shows(conversation_id: str, answer: str) -> bool:
            model = screen.model
            return bool(model and model.conversation_id == conversation_id and
                        model.last_answer() == answer and model.turn_list()[-1].finished)

        await wait_for(pilot, lambda: shows(alpha, alpha_answer), "the alpha conversation")

        await pilot.press("ctrl+o")
        assert app.clipboard == alpha_answer
        assert clipboard_file().read_text() == alpha_answer

        await pilot.press("ctrl+s")
        exported = await wait_for(pilot, lambda: list(exports.glob("*.md")), "the export file")
        text = exported[0].read_text()
        assert exported[0].name.startswith("alpha-notes-")
        assert text.startswith("# Alpha notes") and alpha_answer in text
        # Private, whatever the umask (it was 0644 by default, in a directory often shared).
        assert stat.S_IMODE(exported[0].stat().st_mode) == 0o600

        # A conversation with no message yet is found by its title, and opens.
        search = await search_for(app, pilot, "gamma")
        assert [(hit.conversation_id, hit.message_id) for hit in search.hits] == [(gamma, None)]
        search.query_one(OptionList).focus()
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.model is not None and
                       screen.model.conversation_id == gamma, "the empty conversation to open")

        search = await search_for(app, pilot, "beta")
        assert {hit.conversation_id for hit in search.hits} == {beta}
        search.query_one(OptionList).focus()
        await pilot.press("enter")
        await wait_for(pilot, lambda: shows(beta, beta_answer), "the hit's conversation to open")

        await pilot.press("f2")
        await wait_for(pilot, lambda: app.screen is not screen, "the rename prompt")
        prompt_input = app.screen.query_one(Input)
        assert prompt_input.value == "Beta notes"
        prompt_input.value = "Beta, renamed"
        await pilot.press("enter")
        await wait_for(pilot, lambda: "Beta, renamed" in
                       [c.title for c in screen.conversation_list.conversations], "the new title")
        async with client_for(daemon, desk) as api:
            assert (await api.get_conversation(beta)).conversation.title == "Beta, renamed"

        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: screen.model.conversation_id not in (alpha, beta, gamma)
                       and len(screen.conversation_list.conversations) == 4,
                       "a new empty conversation")
        assert screen.model.turn_list() == []


async def test_an_unknown_theme_falls_back_to_the_default(desk: Device,
                                                          agenttui_dirs: Path) -> None:
    async with running_tui(NOWHERE, desk, agenttui_dirs, theme="no-such-theme") as (app, pilot):
        await wait_for(pilot, lambda: "cannot reach" in app.main.bar.plain, "the retry notice")
        assert app.theme == "agenttui"


async def test_the_list_shows_older_conversations_a_page_at_a_time(
        daemon: Daemon, desk: Device, agenttui_dirs: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Past its size the list ends with "… older conversations", which shows a page more and
    keeps it at every refresh. Before, only the newest 100 could be reached from the list."""
    monkeypatch.setattr(main_screen, "LIST_SIZE", 2)
    async with client_for(daemon, desk) as api:
        made = [(await api.create_conversation(f"c{n}")).id for n in range(5)]
    newest_first = list(reversed(made))
    async with running_tui(daemon.url, desk, agenttui_dirs,
                           conversation=newest_first[0]) as (app, pilot):
        listing = app.main.conversation_list

        def listed() -> tuple[list[str], bool]:
            return [c.id for c in listing.conversations], listing.more

        await wait_for(pilot, lambda: listed() == (newest_first[:2], True), "the first page")
        assert listing.get_option_at_index(2).id == MORE
        for shown, more in ((newest_first[:4], True), (newest_first, False)):
            first_new = len(listing.conversations)
            app.main.action_focus_list()
            # Focus moves once the app handles it: an Enter pressed before went to the composer.
            await wait_for(pilot, lambda: app.focused is listing, "the list focused")
            listing.highlighted = listing.option_count - 1
            await pilot.press("enter")
            await wait_for(pilot, lambda shown=shown, more=more: listed() == (shown, more),
                           f"{len(shown)} conversations listed")
            assert listing.highlighted == first_new  # where the list grew
        assert listing.option_count == 5  # no entry for more once all are shown
        app.main._refresh_list_quietly()  # a refresh keeps what was shown
        await pilot.pause()
        await wait_for(pilot, lambda: listed() == (newest_first, False), "the list kept")
