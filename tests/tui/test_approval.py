"""The tool-approval prompt through Pilot on two devices of one account, against a live daemon
whose calculator asks for approval: both show the prompt, one approves, both show who did."""

from __future__ import annotations

from pathlib import Path

from textual.binding import Binding

from agentd.vocabulary import RunStatus
from agenttui.screens.main import MainScreen
from agenttui.widgets.approval import MIN_SHOWN_S
from tests.support.daemon import SpawnDaemon
from tests.support.factories import Device
from tests.tui.conftest import READY_TIMEOUT_S
from tests.tui.helpers import client_for, running_tui, wait_for


def panel_text(app) -> str:
    panel = app.main.approval_panel
    return str(panel.render()) if panel.has_class("-shown") else ""


def footer_keys(app) -> set[str]:
    return {b.binding.id for b in app.main.active_bindings.values()
            if app.main.check_action(b.binding.action, ()) and b.binding.id}


async def test_both_devices_prompt_one_approves_and_both_show_who(
        spawn_daemon: SpawnDaemon, desk: Device, laptop: Device, agenttui_dirs: Path,
        tmp_path: Path) -> None:
    config = tmp_path / "agentd.toml"
    config.write_text('[tools]\ncalculator = "ask"\n', "utf-8")
    daemon = spawn_daemon(args=["--config", str(config)])
    await daemon.wait_ready(timeout=READY_TIMEOUT_S)
    async with client_for(daemon, desk) as api:
        conversation = await api.create_conversation("approvals")
    # After the approval the answer streams for a few seconds: long enough to see the outcome.
    params = {"tool": "calculator", "tool_args": {"expression": "6 * 7\x1b[31m"},
              "tokens": 30, "delay_ms": 150}
    async with running_tui(daemon.url, desk, agenttui_dirs, conversation=conversation.id,
                           params=params) as (mine, my_pilot), \
            running_tui(daemon.url, laptop, agenttui_dirs,
                        conversation=conversation.id) as (theirs, their_pilot):
        await wait_for(my_pilot, lambda: mine.main.model and mine.main.model.snapshots, "attach")
        await wait_for(their_pilot, lambda: theirs.main.model and theirs.main.model.snapshots,
                       "attach")
        assert "approve_tool" not in footer_keys(mine)  # nothing to answer yet
        clock = [0.0]  # the laptop's panel's clock: the call appears at 0
        theirs.main.approval_panel.clock = lambda: clock[0]
        mine.main.composer.text = "compute"
        await my_pilot.press("enter")
        for app, pilot in ((mine, my_pilot), (theirs, their_pilot)):
            await wait_for(pilot, lambda app=app: "Tool approval needed" in panel_text(app),
                           "the prompt on every device")
            text = panel_text(app)
            assert "asked from desk" in text and "calculator" in text, text
            # The arguments literally, the escape character spelled out, never interpreted.
            assert '"expression": "6 * 7\\u001b[31m"' in text, text
            assert {"approve_tool", "deny_tool"} <= footer_keys(app)
        # A key pressed as the call appears does not answer it: it may have been meant for a
        # call this one just replaced (decided elsewhere, or timed out).
        await their_pilot.press("ctrl+t")
        await their_pilot.pause()
        assert "has just appeared" in " ".join(str(n.message) for n in theirs._notifications)
        assert theirs.main.approval_panel.current is not None
        clock[0] = MIN_SHOWN_S
        await their_pilot.press("ctrl+t")  # the laptop approves the desk's call
        for app, pilot in ((mine, my_pilot), (theirs, their_pilot)):
            await wait_for(pilot, lambda app=app: "approved by laptop" in panel_text(app),
                           "every device to show who decided")
            assert "approve_tool" not in footer_keys(app)
        for app, pilot in ((mine, my_pilot), (theirs, their_pilot)):
            await wait_for(pilot, lambda app=app: app.main.model.turn_list()[-1].status ==
                           RunStatus.COMPLETED, "the turn to complete")
            await pilot.pause()
            assert panel_text(app) == ""  # the turn ended: nothing left to answer
            step = next(iter(app.main.model.turn_list()[-1].tools.values()))
            assert "approved by laptop" in step.summary()


def test_no_key_that_answers_a_tool_call_begins_with_esc() -> None:
    # A terminal sends Alt+<key> as Esc then <key>: Esc (Stop) and a letter typed quickly after
    # it, or read together over SSH, must not be able to approve or deny a tool call.
    keys = [key.strip() for b in MainScreen.BINDINGS if isinstance(b, Binding)
            and b.id in ("approve_tool", "deny_tool") for key in b.key.split(",")]
    assert len(keys) >= 2
    assert not [k for k in keys if k.startswith(("alt+", "meta+", "escape"))], keys
