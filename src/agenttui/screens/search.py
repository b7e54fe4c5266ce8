"""Search across every conversation of the account; pick a hit to open its conversation at
that message (the page around it is loaded)."""

from __future__ import annotations

from typing import ClassVar

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList
from textual.widgets.option_list import Option

from agenttui.client import AgentClient, ApiError, describe
from agenttui.models import SearchHit

SNIPPET = 70


def snippet(hit: SearchHit, query: str) -> str:
    """A short piece of the message around the first match."""
    text = " ".join(hit.content.split())
    at = text.lower().find(query.lower())
    start = max(0, at - SNIPPET // 3) if at >= 0 else 0
    piece = text[start: start + SNIPPET]
    return ("…" if start else "") + piece + ("…" if start + SNIPPET < len(text) else "")


class SearchScreen(ModalScreen[SearchHit | None]):
    DEFAULT_CSS = """
    SearchScreen { align: center middle; }
    SearchScreen > Vertical { width: 90%; height: 80%; padding: 1 2; background: $panel;
                              border: tall $accent; }
    SearchScreen OptionList { height: 1fr; }
    SearchScreen .search-status { color: $text-muted; height: 1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Close", id="search.close")]

    def __init__(self, client: AgentClient) -> None:
        super().__init__()
        self.client = client
        self.hits: list[SearchHit] = []

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("Search all conversations (Enter to search, ↓ to pick a result)")
            yield Input(placeholder="words to find", id="query")
            # Hits quote conversations and errors quote the server: both shown literally.
            yield Label("", classes="search-status", id="search-status", markup=False)
            yield OptionList(id="results", markup=False)

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.value.strip():
            self.search(event.value.strip())

    @work(exclusive=True, group="search", exit_on_error=False)
    async def search(self, query: str) -> None:
        status = self.query_one("#search-status", Label)
        status.update("searching…")
        try:
            self.hits = await self.client.search(query)
        except ApiError as exc:
            status.update(f"search failed: {describe(exc)}")
            return
        results = self.query_one("#results", OptionList)
        results.clear_options()
        results.add_options([
            Option(f"{hit.title or 'Untitled'} · {hit.role}: {snippet(hit, query)}"
                   if hit.role else f"{hit.title or 'Untitled'} · (no messages yet)",
                   id=str(index)) for index, hit in enumerate(self.hits)])
        status.update(f"{len(self.hits)} result{'s' if len(self.hits) != 1 else ''}")
        if self.hits:
            results.highlighted = 0

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        index = int(event.option.id or 0)
        self.dismiss(self.hits[index])

    def action_cancel(self) -> None:
        self.dismiss(None)
