"""The ownership bar: who owns the conversation, until when, who is watching, and the link.

Everything on it is the server's word (snapshot, journal, lease and presence frames); the lease
countdown is the only thing computed here, against the daemon's clock as the client knows it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

from rich.text import Text
from textual.widgets import Static

from agenttui.client import ConnectionState, ConnectionStatus
from agenttui.conversation import ConversationModel
from agenttui.widgets.marks import facts_line

STATE_ICONS = {"idle": "○", "running": "●", "cancelling": "⊘"}


def connection_text(status: ConnectionStatus) -> tuple[str, str]:
    """(text, style) for the connection part of the bar."""
    state = status.state
    if state == ConnectionState.LIVE:
        return "● live", "green"
    if state == ConnectionState.RESUMED:
        seq = f" from seq {status.resumed_seq}" if status.resumed_seq is not None else ""
        return f"● live · resumed{seq}", "green"
    if state == ConnectionState.RECONNECTING:
        return f"⟳ reconnecting (attempt {status.attempt})", "yellow"
    if state == ConnectionState.CLOSED:
        return f"✗ disconnected: {status.error or 'refused'}", "red"
    return "◌ connecting…", "yellow"


def lease_left(expires_at: datetime | None, now: datetime) -> str | None:
    if expires_at is None:
        return None
    seconds = (expires_at - now).total_seconds()
    if seconds <= 0:
        return "lease expired"
    return f"lease {math.ceil(seconds)} s"


def ownership_line(model: ConversationModel, now: datetime) -> Text:
    """`● running · asked from laptop · executing on host:pid:x · lease 24 s`."""
    state = model.state
    icon = STATE_ICONS.get(state, "◔")
    style = {"idle": "dim", "running": "bold green", "cancelling": "bold yellow"}.get(
        state, "bold yellow")
    line = Text()
    line.append(f"{icon} {state}", style=style)
    running = model.running_turn
    if running is not None:
        queued = len(model.queued_turns)
        if queued:
            line.append(f" · {queued} queued", style="yellow")
        _run_id, device, worker, expires = model.owner()
        who = device or "another device"
        if model.owner_is_me():
            who = f"{who} (you)"
        line.append(" · asked from ")
        line.append(who, style="bold")
        if worker:
            line.append(" · executing on ")
            line.append(worker, style="bold")
        left = lease_left(expires, now)
        if left:
            line.append(f" · {left}", style="red" if left == "lease expired" else "")
    return line


def link_text(url: str, pinned: str | None) -> tuple[str, str] | None:
    """How the link to the daemon is protected; None for plain HTTP on loopback (nothing to say)."""
    if url.startswith("https://"):
        if pinned:
            return f"🔒 encrypted · pinned {pinned[:15]}…", "green"
        return "🔒 encrypted", "green"
    host = urlsplit(url).hostname or ""
    if host in ("127.0.0.1", "::1", "localhost"):
        return None
    return "⚠ not encrypted", "bold red"


def presence_line(model: ConversationModel, link: tuple[str, str] | None = None) -> Text:
    line = Text()
    names = [a.device for a in model.attached]
    line.append("attached: ", style="dim")
    line.append(", ".join(names) if names else "—")
    text, style = connection_text(model.connection)
    line.append("  ·  ", style="dim")
    line.append(text, style=style)
    if link is not None:
        line.append("  ·  ", style="dim")
        line.append(link[0], style=link[1])
    return line


class OwnershipBar(Static):
    DEFAULT_CSS = """
    OwnershipBar { height: auto; min-height: 2; padding: 0 1; background: $panel; }
    """

    def __init__(self, clock: Callable[[], datetime], **kwargs: Any) -> None:
        super().__init__("", markup=False, **kwargs)
        self.clock = clock
        self.default_model: str | None = None  # the daemon's, for conversations without one
        self.model: ConversationModel | None = None
        self.message: str = ""
        self.plain = ""
        self.link: tuple[str, str] | None = None

    def on_mount(self) -> None:
        client = getattr(self.app, "client", None)
        if client is not None:
            self.link = link_text(client.url, client.pinned)
        self.set_interval(1.0, self.redraw)  # the lease countdown

    def show(self, model: ConversationModel | None, message: str = "") -> None:
        self.model = model
        self.message = message
        self.redraw()

    def redraw(self) -> None:
        if self.model is None:
            text = Text(self.message or "○ no conversation open", style="dim")
        else:
            text = ownership_line(self.model, self.clock())
            text.append("\n")
            text.append_text(presence_line(self.model, self.link))
            text.append("  ·  ", style="dim")
            text.append_text(facts_line(self.model, self.default_model))
            if self.message:
                text.append(f"\n{self.message}", style="dim")
        if text.plain != self.plain:
            self.plain = text.plain
            self.update(text)
