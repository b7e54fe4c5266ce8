"""SVG snapshots of the main screen states: idle, streaming, queued, cancelled, reconnecting.

Each state is reached for real (live daemon, demo model); the event stream is then held (the
connection stays open, frames stop) so nothing moves, and the only values that differ from run
to run — the worker id and the clock the lease countdown reads — are frozen before the capture.
Set SNAPSHOT_UPDATE=1 to rewrite tests/tui/snapshots/ after reviewing a change.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from agentd.providers.demo import expected_answer
from agentd.vocabulary import MessageStatus, RunStatus
from agenttui.conversation import Changes
from tests.support.daemon import Daemon
from tests.support.factories import Device
from tests.tui.helpers import Valve, assert_snapshot, client_for, running_tui, wait_for

UPDATE = os.environ.get("SNAPSHOT_UPDATE") == "1"
FROZEN_WORKER = "agentd-host:4242:c0ffee"
FROZEN_NOW = datetime(2030, 1, 1, tzinfo=UTC)
WAIT_S = 60.0
SETTLE_S = 10.0  # the screen settles within a few refreshes; this is only a bound


async def freeze(app: Any, pilot: Any) -> None:
    """Pin what differs between runs (worker id, lease countdown clock, cursor blink)."""
    screen = app.main
    model = screen.model
    for turn in model.turns.values():
        if turn.worker_id:
            turn.worker_id = FROZEN_WORKER
    if model.lease is not None:
        model.lease = replace(model.lease, worker_id=FROZEN_WORKER)
    expires = model.owner()[3]
    now = expires - timedelta(seconds=24) if expires is not None else FROZEN_NOW
    app.clock = lambda: now
    screen.composer.cursor_blink = False
    await screen.render_changes(model, Changes(turns=set(model.order), bar=True))
    # Until the screen stops changing: a re-render (a turn's answer, the layout that follows it)
    # can take more than one refresh to settle, and a snapshot taken in between differs by a row.
    deadline = time.monotonic() + SETTLE_S
    shot = None
    while time.monotonic() < deadline:
        await pilot.pause()
        previous, shot = shot, app.export_screenshot()
        if shot == previous:
            return
    raise AssertionError(f"the screen kept changing for {SETTLE_S:g} s")


def turns(app: Any) -> list[Any]:
    return app.main.model.turn_list() if app.main.model else []


async def test_snapshots_idle_then_reconnecting(daemon: Daemon, desk: Device,
                                                agenttui_dirs: Path, tmp_path: Path) -> None:
    prompt = "what does a lease guarantee?"
    async with client_for(daemon, desk) as api:
        conversation = await api.create_conversation("Leases")
        run = await api.create_run(conversation.id, prompt, params={"tokens": 45, "delay_ms": 0})
        assert (await api.wait_run(run.run_id, wait_s=WAIT_S)).status == RunStatus.COMPLETED
    valve = Valve()
    async with running_tui(daemon.url, desk, agenttui_dirs, transport=valve,
                           conversation=conversation.id) as (app, pilot):
        await wait_for(pilot, lambda: turns(app) and turns(app)[-1].finished and
                       app.main.bar.plain.startswith("○ idle") and "● live" in app.main.bar.plain
                       and "attached: desk" in app.main.bar.plain, "the idle conversation")
        assert app.main.transcript.views[run.run_id].answer.md.source == \
            expected_answer("demo", prompt, 45)
        valve.hold()
        await freeze(app, pilot)
        assert_snapshot(app, "idle", tmp_path, UPDATE)

        valve.down()  # the daemon's host vanishes: new connections hang
        valve.cut()  # and the open one dies
        await wait_for(pilot, lambda: "reconnecting (attempt 1)" in app.main.bar.plain,
                       "the bar to show reconnecting")
        await freeze(app, pilot)
        assert_snapshot(app, "reconnecting", tmp_path, UPDATE)

        valve.release()
        valve.up()
        await wait_for(pilot, lambda: "● live · resumed" in app.main.bar.plain,
                       "the stream to resume")


async def test_snapshot_streaming(daemon: Daemon, desk: Device, agenttui_dirs: Path,
                                  tmp_path: Path) -> None:
    prompt = "stream a few words"
    first_word = expected_answer("demo", prompt, 8).split()[0]
    async with client_for(daemon, desk) as api:
        conversation = await api.create_conversation("Streaming")
    valve = Valve()
    async with running_tui(daemon.url, desk, agenttui_dirs, transport=valve,
                           conversation=conversation.id,
                           params={"tokens": 8, "delay_ms": 400}) as (app, pilot):
        await wait_for(pilot, lambda: app.main.model and app.main.model.snapshots and
                       "attached: desk" in app.main.bar.plain, "the empty conversation")
        valve.hold_after("content_delta")  # freeze right after the first words arrive
        app.main.composer.text = prompt
        await pilot.press("enter")

        def first_word_shown() -> bool:
            items = turns(app)
            if not items or items[-1].text != first_word:
                return False
            answer = app.main.transcript.views[items[-1].key].answer
            return answer.md.source == first_word and not valve.flowing.is_set()

        await wait_for(pilot, first_word_shown, "the first word to stream in")
        assert turns(app)[-1].running
        await freeze(app, pilot)
        assert_snapshot(app, "streaming", tmp_path, UPDATE)
        valve.release()


async def test_snapshots_queued_then_cancelled(daemon: Daemon, desk: Device,
                                               agenttui_dirs: Path, tmp_path: Path) -> None:
    async with client_for(daemon, desk) as api:
        conversation = await api.create_conversation("Queue")
    valve = Valve()
    # A first turn that waits a minute for its first token, and a second queued behind it.
    async with running_tui(daemon.url, desk, agenttui_dirs, transport=valve,
                           conversation=conversation.id,
                           params={"tokens": 5, "delay_ms": 60_000}) as (app, pilot):
        screen = app.main
        await wait_for(pilot, lambda: screen.model and screen.model.snapshots and
                       "attached: desk" in screen.bar.plain, "the empty conversation")
        screen.composer.text = "think about this for a while"
        await pilot.press("enter")
        await wait_for(pilot, lambda: turns(app) and turns(app)[0].running and
                       screen.model.lease is not None, "the first turn to run")
        screen.composer.text = "and then answer this"
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(turns(app)) == 2 and turns(app)[1].queued and
                       "1 queued" in screen.bar.plain, "the second turn to queue")
        valve.hold()
        await freeze(app, pilot)
        assert_snapshot(app, "queued", tmp_path, UPDATE)

        valve.release()
        await pilot.press("escape")
        await wait_for(pilot, lambda: turns(app)[0].status == RunStatus.CANCELLED and
                       turns(app)[1].question_status == MessageStatus.DRAFT and
                       screen.composer.text == "and then answer this" and
                       screen.bar.plain.startswith("○ idle"), "the stop to land")
        valve.hold()
        await freeze(app, pilot)
        assert_snapshot(app, "cancelled", tmp_path, UPDATE)
