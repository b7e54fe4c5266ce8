"""`agenttui ask` on a terminal never passes the model's control characters through (a model must
not clear the screen, retitle the window or hide the cursor); `--raw` and pipes get every byte."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agenttui.ask import without_controls
from tests.providers.fake_servers import FakeServer, openai_text, sse
from tests.providers.test_daemon import daemon_env
from tests.support.daemon import SpawnDaemon
from tests.support.factories import Device
from tests.terminal.agenttui import agenttui_command, agenttui_env
from tests.terminal.conftest import OpenAgentTUI
from tests.tui.conftest import READY_TIMEOUT_S
from tests.tui.helpers import client_for

pytestmark = pytest.mark.terminal

# Clear the screen, set the window title, colour, a C1 CSI, a bell, a CR that would overwrite
# the line, DEL; around them text, a tab and newlines that must stay.
PIECES = ("plain ", "\x1b[2J\x1b[H", "\x1b]0;pwned\x07", "red\x1b[31m text\x1b[0m",
          " c1\u009b2J", " tab\there\r\nnext line\x7f\n", "done é ✓")
ANSWER = "".join(PIECES)
PRINTABLE = "plain [2J[H]0;pwnedred[31m text[0m c12J tab\there\nnext line\ndone é ✓"


def test_without_controls_keeps_text_newlines_and_tabs() -> None:
    assert without_controls(ANSWER) == PRINTABLE
    assert without_controls("a\u0085b\u00a0c\x00") == "ab\u00a0c"  # C1 NEL, NUL go; NBSP stays


async def test_ask_strips_control_characters_on_a_terminal_only(
        spawn_daemon: SpawnDaemon, fake: FakeServer, desk: Device,
        open_agenttui: OpenAgentTUI, tmp_path: Path) -> None:
    fake.script(sse(openai_text(*PIECES)))
    daemon = spawn_daemon(env=daemon_env(fake))
    await daemon.wait_ready(timeout=READY_TIMEOUT_S)
    async with client_for(daemon, desk) as api:
        conversation = (await api.create_conversation("controls")).id
    ask = ("ask", "--conversation", conversation, "--model", "openai:fake", "--no-tools")

    terminal = open_agenttui(daemon.url, desk, *ask, "show me")
    assert await terminal.wait_exit() == 0, terminal.output
    # The terminal turns each \n into \r\n; ask ends the answer with a newline on a terminal.
    assert terminal.output.decode() == (PRINTABLE + "\n").replace("\n", "\r\n")
    assert "pwned" not in terminal.screen.title

    raw = open_agenttui(daemon.url, desk, *ask, "--raw", "show me raw")
    assert await raw.wait_exit() == 0, raw.output
    assert raw.output.decode() == (ANSWER + "\n").replace("\n", "\r\n")
    assert raw.screen.title == "pwned"  # the terminal did act on them

    # Not subprocess.run: the fake provider answers from this test's event loop.
    piped = await asyncio.create_subprocess_exec(
        *agenttui_command(), *ask, "show me piped", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL,
        env=agenttui_env(tmp_path / "piped", daemon.url, desk))
    stdout, stderr = await asyncio.wait_for(piped.communicate(), 120)
    assert piped.returncode == 0, stderr.decode()
    assert stdout.decode() == ANSWER  # a pipe or a file gets the text as it came
