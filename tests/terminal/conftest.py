"""Terminal tests: the real `agenttui` binary on a pseudo-terminal against live `agentd serve`
daemons, read through a screen model (see driver.py).

Every agenttui gets private config/cache/state directories and its settings through AGENTTUI_*
variables; TERM and the locale are set for it, never taken from the machine running the tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest

from tests.providers.conftest import fake
from tests.support.factories import Device
from tests.terminal.agenttui import agenttui_command, agenttui_env
from tests.terminal.driver import Terminal
from tests.tui.conftest import agenttui_dirs, daemon, desk, laptop

__all__ = ["agenttui_dirs", "daemon", "desk", "fake", "laptop"]

SIZE = (100, 30)


class OpenAgentTUI(Protocol):
    def __call__(self, url: str, device: Device, *args: str,
                 size: tuple[int, int] = ..., record_screens: bool = ...,
                 **settings: Any) -> Terminal: ...


@pytest.fixture
def open_agenttui(tmp_path: Path) -> Iterator[OpenAgentTUI]:
    """`open_agenttui(daemon.url, desk, conversation=id, params={...})` -> a running agenttui
    on its own terminal; `args` go on its command line. All are closed when the test ends."""
    terminals: list[Terminal] = []

    def open_(url: str, device: Device, *args: str, size: tuple[int, int] = SIZE,
              record_screens: bool = False, **settings: Any) -> Terminal:
        home = tmp_path / f"agenttui-{len(terminals) + 1}-{device.name}"
        terminal = Terminal([*agenttui_command(), *args],
                            env=agenttui_env(home, url, device, **settings), cwd=tmp_path,
                            size=size, record_screens=record_screens)
        terminals.append(terminal)
        return terminal

    try:
        yield open_
    finally:
        for terminal in terminals:
            terminal.close()
