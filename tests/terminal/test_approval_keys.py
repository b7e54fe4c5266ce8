"""Answering a tool call from the real binary on a terminal: a terminal sends Alt+A as Esc then
"a", so Esc (Stop) and a letter arriving in one read, as a fast typist or an SSH link delivers
them, must never approve a tool call. They are read as what was typed: Esc stops the turn, and
the letter goes to the composer. Only the approve and deny keys answer a call."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.daemon import Daemon, SpawnDaemon, poll_until
from tests.support.factories import Device
from tests.terminal.agenttui import composer_text
from tests.terminal.conftest import OpenAgentTUI
from tests.terminal.driver import Terminal
from tests.terminal.test_agenttui import new_conversation, ready
from tests.tui.conftest import READY_TIMEOUT_S
from tests.tui.helpers import client_for

pytestmark = pytest.mark.terminal

CALCULATOR = {"tool": "calculator", "tool_args": {"expression": "6 * 7"}, "tokens": 3,
              "delay_ms": 0}


async def test_esc_and_a_letter_in_one_read_stop_the_turn_and_type_the_letter(
        spawn_daemon: SpawnDaemon, desk: Device, open_agenttui: OpenAgentTUI,
        tmp_path: Path) -> None:
    daemon, conversation_id, terminal = await _waiting_call(spawn_daemon, desk, open_agenttui,
                                                            tmp_path)
    terminal.write_raw("\x1ba")  # Esc and "a" in one write: exactly what Alt+A sends
    # Keys are handled in the order they arrive: once these show, the burst was handled.
    await terminal.type("zz")
    await terminal.wait_for(lambda s: (composer_text(s) or "").endswith("zz"),
                            what="the keys after the burst in the composer")
    assert composer_text(terminal.screen_text()) == "azz"  # the burst's letter, once
    async with client_for(daemon, desk) as api:
        async def stopped() -> str | None:
            state = await api.get_conversation(conversation_id)
            run_id = state.messages[0].run_id or ""
            run = await api._json("GET", f"/v1/runs/{run_id}")
            return run_id if run["status"] == "cancelled" else None

        run_id = await poll_until(stopped, 15, what="the turn stopped by the burst's Esc")
        approvals = (await api._json("GET", f"/v1/runs/{run_id}/approvals"))["approvals"]
    assert all(a["decision"] != "approve" for a in approvals), approvals
    assert "approved by" not in terminal.screen_text()


async def test_only_the_deny_key_answers_a_waiting_call(
        spawn_daemon: SpawnDaemon, desk: Device, open_agenttui: OpenAgentTUI,
        tmp_path: Path) -> None:
    daemon, conversation_id, terminal = await _waiting_call(spawn_daemon, desk, open_agenttui,
                                                            tmp_path)
    # Deny, the one answer this device gives. A call just shown is not answered yet (it may
    # have replaced the one the key was meant for): pressed again, as a person told so would.
    async def denied() -> bool:
        if "denied by desk" in terminal.screen_text():
            return True
        terminal.press("ctrl+r")
        return False

    await poll_until(denied, 15, interval=0.25, what="the call denied by desk")
    async with client_for(daemon, desk) as api:
        state = await api.get_conversation(conversation_id)
        run_id = state.messages[0].run_id or ""
        approvals = (await api._json("GET", f"/v1/runs/{run_id}/approvals"))["approvals"]
    assert [(a["decision"], a["device"]) for a in approvals] == [("deny", "desk")]


async def _waiting_call(spawn_daemon: SpawnDaemon, desk: Device, open_agenttui: OpenAgentTUI,
                        tmp_path: Path) -> tuple[Daemon, str, Terminal]:
    """A daemon whose calculator asks first, and agenttui showing a call that waits."""
    config = tmp_path / "agentd.toml"
    config.write_text('[tools]\ncalculator = "ask"\n', "utf-8")
    daemon = spawn_daemon(args=["--config", str(config)])
    await daemon.wait_ready(timeout=READY_TIMEOUT_S)
    conversation_id = await new_conversation(daemon, desk, "approvals")
    terminal = open_agenttui(daemon.url, desk, conversation=conversation_id, params=CALCULATOR)
    await ready(terminal, desk)
    terminal.write_raw("compute\r")
    await terminal.wait_for_text("^t approve · ^r deny")  # the prompt, with its keys
    return daemon, conversation_id, terminal
