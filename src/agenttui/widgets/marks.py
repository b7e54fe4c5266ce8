"""How a conversation's life cycle shows on screen: token counts under an answer, the model and
totals on the bar, the note on an exchange a retry or an edit replaced. Text only, no widgets.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text

from agenttui.conversation import ConversationModel, Turn


def usage_text(usage: dict[str, Any] | None) -> str:
    """`12 tokens out · 40 in`, or "" when the provider reported none."""
    if not usage:
        return ""
    out, given = int(usage.get("output_tokens") or 0), int(usage.get("input_tokens") or 0)
    if not out and not given:
        return ""
    return f"{out:,} tokens out · {given:,} in"


def answer_usage(turn: Turn) -> str:
    """The line under a finished answer: its tokens, and the model that wrote it."""
    if not turn.finished:
        return ""
    parts = [usage_text(turn.usage), turn.model or ""]
    return " · ".join(part for part in parts if part)


def model_label(model: ConversationModel, default_model: str | None) -> str:
    """The conversation's model, or the daemon's default it falls back to."""
    if model.model_name:
        return model.model_name
    return f"{default_model} (default)" if default_model else "the default model"


def facts_line(model: ConversationModel, default_model: str | None) -> Text:
    """`model demo (default) · 52 tokens`: on the bar, under ownership and presence."""
    line = Text()
    line.append("model ", style="dim")
    line.append(model_label(model, default_model))
    total = int(model.usage.get("input_tokens") or 0) + int(model.usage.get("output_tokens")
                                                            or 0)
    if total:
        line.append(f" · {total:,} tokens", style="dim")
    if model.archived_at is not None:
        line.append(" · archived", style="yellow")
    return line


SUPERSEDED_NOTE = "superseded — a retry or an edit replaced this exchange"
