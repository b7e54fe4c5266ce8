"""The TUI benchmark's driver: the real agenttui app, headless under Textual's Pilot, against a
live daemon. Run by bench/tui.py in its own process (so RSS is the TUI's alone); prints ONE JSON
object on stdout.

  open      app start → the last answer of the conversation drawn (fresh app each round)
  echo      a key sent → the composer holds it and the next screen refresh has run, while a
            turn streams into that conversation at `--tokens-per-s`
  pageup    PageUp sent → the transcript moved (at the top: once older turns are mounted, an
            older page fetched if need be) and the next refresh has run; between PageUps the
            driver waits until background mounting settled (a reader reading the page)
  memory    (--mode memory) RSS after paging up through the conversation until all of its
            messages are loaded, turn by turn as a reader scrolling up would
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from textual import events

from agenttui.app import make_app
from agenttui.client import AgentClient
from agenttui.drafts import DraftLedger
from agenttui.screens.main import MainScreen
from agenttui.settings import Settings
from agenttui.widgets.composer import Composer
from agenttui.widgets.transcript import Transcript

SIZE = (120, 40)
WAIT_S = 30.0


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def log(message: str) -> None:
    print(f"[driver] {message}", file=sys.stderr, flush=True)


def shows(app: Any, text: str) -> bool:
    """Whether the screen as last composed shows `text` on one of its lines."""
    return any(text in strip.text for strip in app.screen._compositor.render_strips())


async def next_refresh(app: Any) -> float:
    """Until the app has refreshed the screen once more (what a user would then see); returns
    when (perf_counter) that refresh was done — work the app starts after it is not counted."""
    done: asyncio.Future[float] = asyncio.get_running_loop().create_future()
    app.call_after_refresh(lambda: done.done() or done.set_result(time.perf_counter()))
    return await asyncio.wait_for(done, WAIT_S)


async def until(predicate: Any, what: str, within: float = WAIT_S, step: float = 0.0) -> None:
    deadline = time.perf_counter() + within
    while not predicate():
        if time.perf_counter() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(step)


def percentiles(values: list[float]) -> dict[str, Any]:
    data = sorted(values)
    if not data:
        return {"n": 0}

    def rank(p: float) -> float:
        return data[max(0, -(-len(data) * p // 100) - 1)]

    return {"n": len(data), "min": round(data[0], 2), "p50": round(rank(50), 2),
            "p90": round(rank(90), 2), "p99": round(rank(99), 2), "max": round(data[-1], 2),
            "mean": round(statistics.fmean(data), 2)}


def app_for(args: argparse.Namespace, client: AgentClient, conversation: str,
            state: Path, **settings: Any) -> Any:
    ledger = DraftLedger(state / "drafts.json")
    return make_app(Settings(url=args.url, token=args.token, device="bench",
                             conversation=conversation, **settings), client, drafts=ledger)


async def measure_open(args: argparse.Namespace, state: Path) -> list[float]:
    times = []
    for round_ in range(args.open_rounds):
        async with AgentClient(args.url, args.token, trust_env=False) as client:
            app = app_for(args, client, args.conversation, state)
            started = time.perf_counter()
            async with app.run_test(size=SIZE) as pilot:
                del pilot
                await until(lambda a=app: shows(a, args.last_line), "the last answer",
                            step=0.005)
                times.append((time.perf_counter() - started) * 1000)
            log(f"open round {round_ + 1}: {times[-1]:.0f} ms")
    return times


async def measure_echo_and_pageup(args: argparse.Namespace,
                                  state: Path) -> tuple[list[float], list[float], int]:
    delay_ms = round(1000 / args.tokens_per_s)
    async with AgentClient(args.url, args.token, trust_env=False) as client:
        app = app_for(args, client, args.conversation, state,
                      params={"tokens": args.stream_tokens, "delay_ms": delay_ms})
        async with app.run_test(size=SIZE) as pilot:
            await until(lambda: shows(app, args.last_line), "the last answer", step=0.01)
            screen = app.screen
            assert isinstance(screen, MainScreen)
            composer = screen.query_one(Composer)
            await pilot.press(*"stream please", "enter")
            model = screen.model
            assert model is not None
            await until(lambda: model.running_turn is not None and model.running_turn.text,
                        "the turn streaming", within=60, step=0.01)
            running = model.running_turn
            log("streaming; typing")
            echo = []
            for i in range(args.keys):
                char = "abcdefghijklmnopqrstuvwxyz"[i % 26]
                expected = composer.text + char
                sent = time.perf_counter()
                app._driver.send_message(events.Key(char, char))  # as a terminal delivers it
                await until(lambda e=expected: composer.text == e, "the echo", step=0)
                echo.append((await next_refresh(app) - sent) * 1000)
                await asyncio.sleep(args.key_interval_ms / 1000)
            still = running is not None and running.running
            log(f"echo done (turn still streaming: {still}); stopping it")
            composer.clear()
            await pilot.press("escape")
            await until(lambda: model.running_turn is None, "the stop", within=60, step=0.01)

            transcript = screen.query_one(Transcript)
            pageup = []
            for _ in range(args.pageups):
                await until(lambda: not transcript.paging, "paging to settle", step=0.005)
                await next_refresh(app)  # the reader reads the page before the next PageUp
                before = (transcript.scroll_y, len(model.order), transcript.start)
                sent = time.perf_counter()
                app._driver.send_message(events.Key("pageup", None))
                # At the very top the page moves only once older turns are in: wait for them.
                await until(lambda b=before: (transcript.scroll_y, len(model.order),
                                              transcript.start) != b, "PageUp to act", step=0)
                pageup.append((await next_refresh(app) - sent) * 1000)
                if pageup[-1] > 100:
                    after = (transcript.scroll_y, len(model.order), transcript.start)
                    log(f"slow PageUp {pageup[-1]:.0f} ms: (scroll_y, turns loaded, first "
                        f"mounted) {before} -> {after}")
            widgets = len(list(app.screen.walk_children()))
            return echo, pageup, widgets if still else -widgets


async def measure_memory(args: argparse.Namespace, state: Path) -> dict[str, Any]:
    async with AgentClient(args.url, args.token, trust_env=False) as client:
        app = app_for(args, client, args.conversation, state)
        async with app.run_test(size=SIZE) as pilot:
            del pilot
            await until(lambda: shows(app, args.last_line), "the last answer", step=0.01)
            screen = app.screen
            assert isinstance(screen, MainScreen)
            transcript = screen.query_one(Transcript)
            model = screen.model
            assert model is not None
            samples = []
            steps = 0
            while transcript.start > 0 or model.has_more:
                transcript.scroll_home(animate=False, immediate=True)  # as a reader would
                await transcript.page_older()
                await next_refresh(app)
                steps += 1
                if steps % 100 == 0:
                    messages = sum(1 + bool(t.text) for t in model.turn_list())
                    samples.append({"messages": messages, "rss_mib": round(rss_mib(), 1),
                                    "widgets": len(list(app.screen.walk_children()))})
                    log(f"memory: {samples[-1]}")
            messages = sum(1 + bool(t.text) for t in model.turn_list())
            return {"messages_loaded": messages, "steps": steps,
                    "rss_mib": round(rss_mib(), 1), "peak_rss_mib": round(hwm_mib(), 1),
                    "turn_views_mounted": len(transcript.views),
                    "widgets": len(list(app.screen.walk_children())), "samples": samples}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--conversation", required=True)
    parser.add_argument("--last-line", required=True)
    parser.add_argument("--mode", choices=("latency", "memory"), default="latency")
    parser.add_argument("--open-rounds", type=int, default=5)
    parser.add_argument("--keys", type=int, default=300)
    parser.add_argument("--key-interval-ms", type=float, default=30)
    parser.add_argument("--tokens-per-s", type=float, default=50)
    parser.add_argument("--stream-tokens", type=int, default=3000)
    parser.add_argument("--pageups", type=int, default=150)
    args = parser.parse_args()
    args.token = os.environ["AGENTTUI_TOKEN"]  # a device token is never on a command line
    with tempfile.TemporaryDirectory(prefix="agenttui-bench-") as tmp:
        state = Path(tmp)
        result: dict[str, Any] = {}
        if args.mode == "memory":  # a process of its own: its RSS is one TUI's alone
            result["memory"] = await measure_memory(args, state)
        else:
            result["open_ms"] = percentiles(await measure_open(args, state))
            echo, pageup, widgets = await measure_echo_and_pageup(args, state)
            result["echo_ms"] = percentiles(echo)
            result["echo_while_streaming"] = widgets > 0
            result["pageup_ms"] = percentiles(pageup)
            result["widgets_after_pageups"] = abs(widgets)
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
