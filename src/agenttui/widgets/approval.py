"""The tool-approval panel: a pending call shown on every attached device, then who decided.

Everything here is the server's word (approval_requested / approval_decided from the feed); the
arguments are shown literally, as JSON with control and format characters escaped, never as
markup. The keys that answer live on the screen (MainScreen's approval bindings).
"""

from __future__ import annotations

import json
import time
import unicodedata
from collections.abc import Callable
from typing import Any

from rich.text import Text
from textual.widgets import Static

from agenttui.conversation import Approval

MAX_ARGUMENT_LINES = 12
# A call must have been on screen this long before a key answers it. The daemon asks about a
# step's calls one after another: when one is decided elsewhere (or times out) the next shows
# at once, and a key pressed for the first would otherwise approve one nobody read.
MIN_SHOWN_S = 0.5


def literal_json(value: Any) -> str:
    """Pretty JSON with every control or format character (escapes, bidi overrides) spelled
    as `\\uXXXX`, so what a device shows is exactly what the tool would receive."""
    text = json.dumps(value, ensure_ascii=False, indent=2, sort_keys=True, default=str)
    return "".join(
        ch if ch == "\n" or unicodedata.category(ch) not in ("Cc", "Cf", "Zl", "Zp")
        else f"\\u{ord(ch):04x}" for ch in text)


def approval_text(approvals: list[Approval], approve_key: str, deny_key: str) -> Text:
    pending = [a for a in approvals if a.pending]
    text = Text()
    if pending:
        first = pending[0]
        text.append("⏸ Tool approval needed", style="bold yellow")
        text.append(f" · asked from {first.asked_by or 'a device'}", style="yellow")
        if len(pending) > 1:
            text.append(f" · {len(pending) - 1} more after this one", style="dim")
        text.append("\n")
        text.append(first.tool, style="bold")
        text.append("\n")
        lines = literal_json(first.arguments).splitlines()
        if len(lines) > MAX_ARGUMENT_LINES:
            lines = [*lines[:MAX_ARGUMENT_LINES - 1], f"… ({len(lines)} lines in all)"]
        text.append("\n".join(lines))
        text.append("\n")
        text.append(f"{approve_key} approve · {deny_key} deny", style="bold")
        return text
    decided = approvals[-1]
    mark, style = ("✓", "green") if decided.decision == "approve" else ("✗", "red")
    text.append(f"{mark} {decided.tool}: {decided.outcome()}", style=style)
    return text


class ApprovalPanel(Static):
    """Hidden unless the running turn has an approval; shows the first pending one."""

    DEFAULT_CSS = """
    ApprovalPanel {
        display: none;
        height: auto;
        max-height: 18;
        padding: 0 1;
        border: round $warning;
    }
    ApprovalPanel.-shown { display: block; }
    ApprovalPanel.-decided { border: round $success; }
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.current: Approval | None = None  # the one the keys answer
        self.clock: Callable[[], float] = time.monotonic
        self._shown: tuple[str, str] | None = None  # (run, call) of `current`, and since when
        self._shown_at = 0.0

    def show_approvals(self, approvals: list[Approval], approve_key: str,
                       deny_key: str) -> None:
        self.current = next((a for a in approvals if a.pending), None)
        shown = (self.current.run_id, self.current.call_id) if self.current else None
        if shown != self._shown:
            self._shown, self._shown_at = shown, self.clock()
        self.set_class(bool(approvals), "-shown")
        self.set_class(bool(approvals) and self.current is None, "-decided")
        if approvals:
            self.update(approval_text(approvals, approve_key, deny_key))

    def just_shown(self) -> bool:
        """Whether `current` came on screen less than MIN_SHOWN_S ago (too soon to answer)."""
        return self.current is not None and self.clock() - self._shown_at < MIN_SHOWN_S
