"""agenttui on a terminal: its command, its environment, and reading its screen's parts.

The screen helpers read what a user reads (the composer box, the footer), not the app's state.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.factories import Device
from tests.terminal.driver import terminal_env

PLACEHOLDER = "Message — Enter sends · Ctrl+J new line"  # an empty composer shows it
COMPOSER_TOP, COMPOSER_BOTTOM, COMPOSER_LEFT = "▔", "▁", "▊"
SIDEBAR_EDGE = "▎"


def agenttui_command() -> list[str]:
    """The installed `agenttui` console script, beside this interpreter (the venv's)."""
    script = Path(sys.executable).with_name("agenttui")
    found = str(script) if script.exists() else shutil.which("agenttui")
    if found is None:
        pytest.fail("the agenttui command is not installed: pip install -e '.[test]'")
    return [found]


def agenttui_env(home: Path, url: str, device: Device, **settings: Any) -> dict[str, str]:
    """agenttui's environment: this device on `url`, private directories under `home`,
    `settings` as AGENTTUI_* variables (dicts as JSON), a known TERM and locale."""
    env = {"AGENTTUI_URL": url, "AGENTTUI_TOKEN": device.token, "AGENTTUI_DEVICE": device.name}
    for name in ("config", "cache", "state"):
        path = home / name
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        env[f"AGENTTUI_{name.upper()}_DIR"] = str(path)
    for key, value in settings.items():
        env[f"AGENTTUI_{key.upper()}"] = json.dumps(value) if isinstance(value, dict) \
            else str(value)
    return terminal_env(**env)


def composer_text(screen: str) -> str | None:
    """The text inside the composer box (the last one on the screen), lines joined with \\n;
    None when no composer is drawn."""
    lines = screen.splitlines()
    tops = [i for i, line in enumerate(lines) if COMPOSER_TOP * 8 in line]
    if not tops:
        return None
    inside = []
    for line in lines[tops[-1] + 1:]:
        if COMPOSER_BOTTOM * 8 in line:
            return "\n".join(inside)
        inside.append(line.partition(COMPOSER_LEFT)[2].rstrip().removesuffix("▎").strip())
    return None


def composer_empty(screen: str) -> bool:
    return composer_text(screen) == PLACEHOLDER


def shows(screen: str, text: str) -> bool:
    """Is `text` on the screen, its words in order, however the transcript wrapped it?"""
    column = [line.partition(SIDEBAR_EDGE)[2] or line for line in screen.splitlines()]
    return " ".join(text.split()) in " ".join(" ".join(column).split())
