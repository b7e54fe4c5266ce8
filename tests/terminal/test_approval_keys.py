"""Answering a tool call from the real binary on a terminal: a terminal sends Alt+A as Esc then
"a", so Esc (Stop) and a letter arriving in one read, as a fast typist or an SSH link delivers
them, must never approve a tool call. Only the approve and deny keys answer it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.daemon import SpawnDaemon
from tests.support.factories import Device
from tests.terminal.agenttui import composer_text
from tests.terminal.conftest import OpenAgentTUI
from tests.terminal.test_agenttui import new_conversation, ready
from tests.tui.conftest import READY_TIMEOUT_S
from tests.tui.helpers import client_for

pytestmark = pytest.mark.terminal

CALCULATOR = {"tool": "calculator", "tool_args": {"expression": "6 * 7"}, "tokens": 3,
              "delay_ms": 0}


async def test_esc_and_a_letter_in_one_read_do_not_approve_a_waiting_tool_call(
        spawn_daemon: SpawnDaemon, desk: Device, open_agenttui: OpenAgentTUI,
        tmp_path: Path) -> None:
    config = tmp_path / "agentd.toml"
    config.write_text('[tools]\ncalculator = "ask"\n', "utf-8")
    daemon = spawn_daemon(args=["--config", str(config)])
    await daemon.wait_ready(timeout=READY_TIMEOUT_S)
    conversation_id = await new_conversation(daemon, desk, "approvals")
    terminal = open_agenttui(daemon.url, desk, conversation=conversation_id, params=CALCULATOR)
    await ready(terminal, desk)
    terminal.write_raw("compute\r")
    await terminal.wait_for_text("^t approve · ^r deny")  # the prompt, with its keys

    terminal.write_raw("\x1ba")  # Esc and "a" in one write: exactly what Alt+A sends
    # Keys are handled in the order they arrive: once these show, the burst was handled.
    await terminal.type("zz")
    await terminal.wait_for(lambda s: (composer_text(s) or "").endswith("zz"),
                            what="the keys after the burst in the composer")
    assert "approved by" not in terminal.screen_text()

    terminal.press("ctrl+r")  # deny: the one answer this device gives
    await terminal.wait_for_text("denied by desk")
    async with client_for(daemon, desk) as api:
        state = await api.get_conversation(conversation_id)
        run_id = state.messages[0].run_id or ""
        approvals = (await api._json("GET", f"/v1/runs/{run_id}/approvals"))["approvals"]
    assert [(a["decision"], a["device"]) for a in approvals] == [("deny", "desk")]
