"""A long conversation (1,000 turns written straight into the database) through the real app:
it opens on its newest turns with a bounded number of widgets, PageUp mounts older turns and
then fetches older pages from the API, a search hit far back loads the page around it, and a
streaming answer grows in its own view while the rest stays mounted as it was."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import asyncpg
from textual.widgets import OptionList

from agenttui.screens.main import MainScreen
from agenttui.widgets.transcript import WINDOW_TURNS, Transcript
from tests.support.daemon import Daemon
from tests.support.factories import Device
from tests.support.long_conversation import last_line, write_long_conversation
from tests.tui.helpers import client_for, running_tui, screen_text, search_for, wait_for

TURNS = 1000


async def _long(daemon: Daemon, pool: asyncpg.Pool, device: Device, turns: int = TURNS,
                **written: Any) -> str:
    async with client_for(daemon, device) as client:
        me = await client.me()
        created = await client.create_conversation("long")
    await write_long_conversation(pool, account_id=uuid.UUID(me.account_id),
                                  device_id=uuid.UUID(device.device_id),
                                  conversation_id=uuid.UUID(created.id), turns=turns, **written)
    return created.id


def _transcript(app) -> Transcript:
    return app.screen.query_one(Transcript)


async def test_opens_on_the_newest_turns_and_pages_older_ones_in(daemon: Daemon, pool, desk,
                                                                  agenttui_dirs: Path):
    conversation_id = await _long(daemon, pool, desk)
    async with running_tui(daemon.url, desk, agenttui_dirs,
                           conversation=conversation_id) as (app, pilot):
        await wait_for(pilot, lambda: last_line(TURNS) in screen_text(app),
                       "the last answer on screen")
        screen = app.screen
        assert isinstance(screen, MainScreen)
        transcript = _transcript(app)
        model = screen.model
        assert model is not None and model.has_more, "the snapshot is the newest page only"
        assert len(model.order) < TURNS
        assert 0 < len(transcript.views) <= WINDOW_TURNS
        loaded = len(model.order)

        # PageUp, again and again: older turns mount, then older pages come from the API.
        def earlier_page_loaded() -> bool:
            return len(model.order) > loaded

        for _ in range(400):
            await pilot.press("pageup")
            await pilot.pause()
            if earlier_page_loaded():
                break
        assert earlier_page_loaded(), "PageUp never fetched an older page"
        await wait_for(pilot, lambda: not transcript.paging, "paging to settle")
        assert len(transcript.views) <= WINDOW_TURNS, "far-off turns are unmounted"
        assert transcript.start > 0 or transcript.newer.display

        # Back to the newest answer.
        await pilot.press("ctrl+end")
        await wait_for(pilot, lambda: last_line(TURNS) in screen_text(app),
                       "the last answer again")


async def test_a_search_hit_far_back_loads_the_page_around_it(daemon: Daemon, pool, desk,
                                                              agenttui_dirs: Path):
    conversation_id = await _long(daemon, pool, desk)
    async with running_tui(daemon.url, desk, agenttui_dirs,
                           conversation=conversation_id) as (app, pilot):
        await wait_for(pilot, lambda: last_line(TURNS) in screen_text(app),
                       "the last answer on screen")
        model = app.screen.model
        assert model is not None and "End of answer 7." not in {
            t.text.splitlines()[-1] for t in model.turn_list() if t.text}
        search = await search_for(app, pilot, "End of answer 7.")
        hits = search.hits
        index = next(i for i, hit in enumerate(hits) if hit.content.endswith("answer 7."))
        results = search.query_one("#results", OptionList)
        results.focus()
        results.highlighted = index
        await pilot.press("enter")
        await wait_for(pilot, lambda: last_line(7) in screen_text(app),
                       "answer 7 on screen after the jump")
        transcript = _transcript(app)
        assert len(transcript.views) <= WINDOW_TURNS
        assert not transcript.following, "the newest turns are below, unmounted"


async def test_a_streaming_answer_grows_in_its_own_view(daemon: Daemon, pool, desk,
                                                        agenttui_dirs: Path):
    conversation_id = await _long(daemon, pool, desk, turns=200)
    async with running_tui(daemon.url, desk, agenttui_dirs, conversation=conversation_id,
                           params={"tokens": 400, "delay_ms": 20}) as (app, pilot):
        await wait_for(pilot, lambda: last_line(200) in screen_text(app),
                       "the last answer on screen")
        transcript = _transcript(app)
        before = dict(transcript.views)
        await pilot.press(*"tail please", "enter")
        model = app.screen.model
        await wait_for(pilot, lambda: model.asked_here, "the turn created")
        (run_id,) = model.asked_here
        await wait_for(pilot, lambda: run_id in transcript.views
                       and transcript.views[run_id].answer.streaming, "its answer streaming")
        view = transcript.views[run_id]
        turn = model.turns[run_id]
        await wait_for(pilot, lambda: turn.finished, "the turn to finish")
        await wait_for(pilot, lambda: view.answer.shown_text == turn.text and turn.text,
                       "the whole answer shown")
        assert transcript.views.get(run_id) is view, "one view for the whole stream"
        kept = [key for key, old in before.items() if transcript.views.get(key) is old]
        assert kept, "the turns already on screen were not re-created"
        assert len(transcript.views) <= WINDOW_TURNS


async def test_short_turns_on_a_tall_terminal_keep_the_newest_in_view_and_fill_the_screen(
        daemon: Daemon, pool, desk, agenttui_dirs: Path):
    # One-line answers on a 100-line terminal: WINDOW_TURNS such turns are shorter than the
    # screen and its margin. Trimming back to WINDOW_TURNS after each page mounted above (what
    # filling the screen does) would unmount the newest turns, the ones on screen, and never
    # fill it.
    conversation_id = await _long(daemon, pool, desk, answer_of=lambda n: f"Short {n}.")
    async with running_tui(daemon.url, desk, agenttui_dirs, conversation=conversation_id,
                           size=(110, 100)) as (app, pilot):
        newest = f"Short {TURNS}."
        await wait_for(pilot, lambda: newest in screen_text(app), "the last answer on screen")
        transcript = _transcript(app)
        model = app.screen.model
        assert model is not None
        await wait_for(pilot, lambda: transcript.virtual_size.height
                       >= 2 * transcript.size.height and not transcript.paging,
                       "the screen and a margin above it filled")
        assert transcript.following and newest in screen_text(app), "the newest stay in view"
        assert len(transcript.views) > WINDOW_TURNS, "short turns keep more than the usual window"

        # PageUp reads older pages; what stays mounted is bounded by what fills the screen.
        loaded = len(model.order)
        for _ in range(200):
            await pilot.press("pageup")
            await pilot.pause()
            if len(model.order) > loaded:
                break
        assert len(model.order) > loaded, "PageUp never fetched an older page"
        await wait_for(pilot, lambda: not transcript.paging, "paging to settle")
        assert len(transcript.views) < len(model.order), "far-off turns are unmounted"


async def test_the_newest_turns_show_even_when_filling_the_screen_fails(
        daemon: Daemon, pool, desk, agenttui_dirs: Path, monkeypatch) -> None:
    # The turns stay hidden while older ones are mounted above them to fill the screen
    # (Transcript._veil); a fill that breaks off must still show what is mounted.
    def breaks(self: Transcript, view: Any, before: int) -> None:
        raise RuntimeError("the page mounted above could not be put in place")

    monkeypatch.setattr(Transcript, "_keep_in_place", breaks)
    conversation_id = await _long(daemon, pool, desk, answer_of=lambda n: f"Short {n}.")
    async with running_tui(daemon.url, desk, agenttui_dirs, conversation=conversation_id,
                           size=(110, 100)) as (app, pilot):
        await wait_for(pilot, lambda: f"Short {TURNS}." in screen_text(app),
                       "the newest turn on screen")
        transcript = _transcript(app)
        assert not transcript.has_class("-veiled")
        assert transcript.virtual_size.height < 2 * transcript.size.height  # it broke off
