"""The Textual app: global keys (each with an id, remappable under [keys]), F1 help, command
palette entries for the main actions, the theme. Built by `make_app`, for the CLI and the tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from functools import partial
from typing import Any, ClassVar

from textual import events
from textual.app import App, SystemCommand
from textual.binding import Binding, BindingType
from textual.command import DiscoveryHit, Hit, Hits, Matcher, Provider
from textual.content import Content
from textual.filter import LineFilter
from textual.screen import Screen
from textual.theme import Theme

from agenttui.client import AgentClient, ApiError, describe
from agenttui.drafts import DraftLedger
from agenttui.escape_keys import esc_then_character
from agenttui.idle_gc import IdleCollector
from agenttui.no_controls import DropControls
from agenttui.screens.help import HelpScreen
from agenttui.screens.lifecycle import LifecycleScreen
from agenttui.screens.main import MainScreen
from agenttui.screens.pairing import PairingScreen
from agenttui.settings import DEFAULT_THEME, Settings
from agenttui.widgets.composer import Composer
from agenttui.widgets.conversation_list import conversation_label

# The key bindings the command palette lists, by binding id, with their title there (the
# palette's help line is the binding's tooltip, its command the binding's action): one
# definition of each action, whether reached by its key or by the palette.
PALETTE_TITLES = {
    "new_conversation": "New conversation", "rename_conversation": "Rename conversation",
    "stop": "Stop", "copy_answer": "Copy last answer", "copy_code": "Copy last code block",
    "search": "Search conversations", "export": "Export as Markdown",
    "toggle_sidebar": "Toggle conversation list", "choose_model": "Choose model",
    "fork": "Fork", "retry": "Retry", "edit": "Edit and resend",
    "cancel_queued": "Cancel queued turn",
}
SCREEN_BINDINGS = (MainScreen.BINDINGS, LifecycleScreen.BINDINGS)

AGENTTUI_THEME = Theme(
    name=DEFAULT_THEME, primary="#5fafd7", secondary="#87afaf", accent="#ffaf5f",
    warning="#ffaf5f", error="#ff5f5f", success="#87d787", foreground="#d0d0d0",
    background="#1c1c1c", surface="#262626", panel="#303030", dark=True)


def literal_highlight(matcher: Matcher, text: str) -> Content:
    """`text` as typed, its matched letters highlighted. (`Matcher.highlight` would parse a
    title such as `[bold]x` as markup, or raise on `[/]`.)"""
    content = Content(text)
    score, offsets = matcher.fuzzy_search.match(matcher.query, text)
    if score:
        for offset in offsets:
            if not text[offset].isspace():
                content = content.stylize(matcher.match_style, offset, offset + 1)
    return content


class ConversationCommands(Provider):
    """Palette entries to switch to any conversation by title (shown literally)."""

    async def search(self, query: str) -> Hits:
        app = self.app
        assert isinstance(app, AgentTUI)
        matcher = self.matcher(query)
        for conversation in app.main.conversation_list.conversations:
            label = f"Open: {conversation_label(conversation)}"
            score = matcher.match(label)
            if score > 0:
                yield Hit(score, literal_highlight(matcher, label),
                          partial(app.main.action_open, conversation.id), text=label,
                          help="switch to this conversation")

    async def discover(self) -> Hits:
        app = self.app
        assert isinstance(app, AgentTUI)
        for conversation in app.main.conversation_list.conversations[:10]:
            label = f"Open: {conversation_label(conversation)}"
            yield DiscoveryHit(Content(label), partial(app.main.action_open, conversation.id),
                               text=label, help="switch to this conversation")


class AgentTUI(App[None]):
    TITLE = "agenttui"
    COMMANDS = App.COMMANDS | {ConversationCommands}
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+q", "quit", "Quit", id="quit", priority=True),
        Binding("f1", "help", "Help", id="help"),
    ]

    def __init__(self, settings: Settings, client: AgentClient, *, close_client: bool = False,
                 clock: Callable[[], datetime] | None = None,
                 drafts: DraftLedger | None = None) -> None:
        super().__init__()
        self.settings = settings
        self.client = client
        self.clock = clock
        self.drafts = drafts or DraftLedger()
        self._close_client = close_client
        self.idle_gc = IdleCollector()
        self.register_theme(AGENTTUI_THEME)
        if settings.keys:
            self.set_keymap(settings.keys)
        # Every key a binding claims, as mapped now, whether or not its action is enabled at
        # the moment (an Alt key remapped to approve must not turn into Esc with no call).
        # The user's own map too: it may give an Alt key to a dialog's binding.
        self._bound_keys = frozenset(
            key.strip() for keys in [*(row[0] for row in self.key_table()),
                                     *settings.keys.values()]
            for key in keys.split(","))
        self._drop_controls = DropControls()

    def get_line_filters(self) -> Sequence[LineFilter]:
        """Textual's own filters, then no control character from the daemon's text reaches the
        terminal (agenttui.no_controls)."""
        return [*super().get_line_filters(), self._drop_controls]

    def server_now(self) -> datetime:
        """The daemon's clock as this client knows it (or a fixed clock, for snapshots)."""
        return self.clock() if self.clock is not None else self.client.server_now()

    @property
    def main(self) -> MainScreen:
        screen = self.get_screen("main")
        assert isinstance(screen, MainScreen)
        return screen

    def on_mount(self) -> None:
        theme = self.settings.theme
        if theme in self.available_themes:
            self.theme = theme
        else:
            self.theme = DEFAULT_THEME
            self.notify(f"Unknown theme {theme!r}; using {DEFAULT_THEME}. Themes: "
                        f"{', '.join(sorted(self.available_themes))}", severity="warning",
                        markup=False)
        self.install_screen(MainScreen(), "main")
        self.push_screen("main")
        self.idle_gc.start()
        self.set_interval(0.25, self.idle_gc.tick)

    async def on_event(self, event: events.Event) -> None:
        if isinstance(event, events.Key):
            self.idle_gc.touch()
            split = None if event.is_forwarded else esc_then_character(event,
                                                                        self._bound_keys)
            if split is not None:
                # Both go their usual way, in order, before the keys that came after them in
                # the same burst (already queued behind this one).
                for key in split:
                    await super().on_event(key)
                return
        await super().on_event(event)

    async def action_quit(self) -> None:
        # Drafts handed back and still in the composer stay offered for the next start.
        self.main.settle_drafts()
        await super().action_quit()

    async def on_unmount(self) -> None:
        self.idle_gc.stop()
        if self._close_client:
            await self.client.aclose()

    def key_table(self) -> list[tuple[str, str, str]]:
        """(keys, description, binding id) of every remappable binding, as mapped now."""
        keymap = self.settings.keys  # what __init__ gave set_keymap
        rows = []
        for bindings in (MainScreen.BINDINGS, LifecycleScreen.BINDINGS, Composer.BINDINGS,
                         AgentTUI.BINDINGS):
            for binding in bindings:
                assert isinstance(binding, Binding) and binding.id
                keys = keymap.get(binding.id, binding.key)
                rows.append((keys, binding.description or binding.action, binding.id))
        rows.append((self.COMMAND_PALETTE_BINDING, "command palette", "—"))
        return rows

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.key_table()))

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        main = self.main
        bindings = {b.id: b for group in SCREEN_BINDINGS for b in group
                    if isinstance(b, Binding)}
        for binding_id, title in PALETTE_TITLES.items():
            binding = bindings[binding_id]
            yield SystemCommand(title, binding.tooltip, partial(main.run_action, binding.action))
        archived = main.model is not None and main.model.archived_at is not None
        yield SystemCommand("Restore conversation" if archived else "Archive conversation",
                            "Back into the list" if archived else
                            "Hide it from the list (reversible)",
                            partial(main.action_archive, not archived))
        yield SystemCommand("Show conversations" if main.showing_archived else
                            "Show archived conversations", "Switch the list",
                            main.action_toggle_archived)
        yield SystemCommand("Delete conversation", "For every device, after you confirm",
                            main.action_delete)
        yield SystemCommand("Help", "Keys and how devices share a conversation",
                            self.action_help)
        yield SystemCommand("Pair another device",
                            "A one-time code and the line to run on the other machine",
                            self.action_pair_device)

    def action_pair_device(self) -> None:
        self.run_worker(self._pair_device(), group="pairing", exit_on_error=False)

    async def _pair_device(self) -> None:
        try:
            pairing = await self.client.create_pairing()
        except ApiError as exc:
            # Literal: an error quotes the OS ("[Errno 111] …"), which is not markup.
            self.notify(f"Could not get a pairing code: {describe(exc)}", severity="error",
                        markup=False)
            return
        await self.push_screen(PairingScreen(pairing))


def make_app(settings: Settings, client: AgentClient, *, close_client: bool = False,
             clock: Callable[[], datetime] | None = None,
             drafts: DraftLedger | None = None) -> AgentTUI:
    """The app for these settings, talking through `client` (closed on exit if asked)."""
    return AgentTUI(settings, client, close_client=close_client, clock=clock, drafts=drafts)
