"""agenttui on a long conversation: the real app, headless under Textual's Pilot, against a live
daemon holding a generated conversation (tests/support/long_conversation.py writes the turns
straight into the database, as the daemon stores them).

Figures (bench/tui_driver.py measures them in a process of its own, so RSS is the TUI's):
- open a `--turns`-turn (2 × turns messages) conversation → its last answer drawn (fresh app
  per round; the budget holds for the slowest round);
- keystroke → echo (in the composer, and the next screen refresh) p99 while a turn streams into
  that conversation at 50 tokens/s;
- PageUp → the transcript scrolled a page (mounting older turns, fetching older pages) p99;
- RSS of a TUI that paged through a `--memory-turns`-turn conversation until every message was
  loaded.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from harness import (
    base_parser,
    bench_database,
    daemon_settings,
    daemons,
    emit,
    figure,
    machine_info,
    make_account,
    make_conversations,
    open_pool,
    params_of,
    progress,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests/support is shared by the tests and this benchmark

from tests.support.long_conversation import last_line, write_long_conversation  # noqa: E402

TARGET_OPEN_MS = 1000.0
TARGET_ECHO_MS = 50.0
TARGET_PAGEUP_MS = 100.0
TARGET_RSS_MIB = 150.0
DRIVER = Path(__file__).resolve().parent / "tui_driver.py"


async def conversation(pool: Any, account_id: uuid.UUID, turns: int, title: str) -> str:
    device_id = await pool.fetchval("SELECT id FROM device WHERE account_id = $1 LIMIT 1",
                                    account_id)
    (conversation_id,) = await make_conversations(pool, account_id, 1, title)
    await write_long_conversation(pool, account_id=account_id, device_id=device_id,
                                  conversation_id=conversation_id, turns=turns)
    return str(conversation_id)


def drive(url: str, token: str, conversation_id: str, turns: int, *flags: str) -> dict[str, Any]:
    command = [sys.executable, str(DRIVER), "--url", url, "--conversation",
               conversation_id, "--last-line", last_line(turns), *flags]
    # The token goes by the environment, as agenttui's does: never on a command line.
    proc = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False,
                          env={**os.environ, "AGENTTUI_TOKEN": token})
    if proc.returncode != 0:
        raise SystemExit(f"the driver failed with exit code {proc.returncode}")
    return json.loads(proc.stdout)


async def main() -> None:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=1000,
                        help="turns of the conversation opened (2 messages each)")
    parser.add_argument("--memory-turns", type=int, default=5000,
                        help="turns of the conversation paged through for the memory figure")
    parser.add_argument("--open-rounds", type=int, default=5)
    parser.add_argument("--keys", type=int, default=300)
    parser.add_argument("--pageups", type=int, default=150)
    args = parser.parse_args()
    if args.quick:
        args.turns, args.memory_turns, args.open_rounds = 200, 500, 2
        args.keys, args.pageups = 60, 30
    async with bench_database(args, "tui") as database:
        machine = await machine_info(database)
        async with daemons(database, 1, **daemon_settings(args)) as (daemon,):
            pool = await open_pool(database.dsn)
            try:
                token, account_id = await make_account(pool, device="bench-tui")
                progress(f"writing a {args.turns}-turn and a {args.memory_turns}-turn "
                         f"conversation")
                long = await conversation(pool, account_id, args.turns, "long")
                longer = await conversation(pool, account_id, args.memory_turns, "longer")
            finally:
                await pool.close()
            progress("driving the TUI: open, echo while streaming, PageUp")
            latency = await asyncio.to_thread(
                drive, daemon.url, token, long, args.turns, "--open-rounds",
                str(args.open_rounds), "--keys", str(args.keys), "--pageups",
                str(args.pageups))
            progress("driving the TUI: paging through every message")
            memory = (await asyncio.to_thread(
                drive, daemon.url, token, longer, args.memory_turns, "--mode",
                "memory"))["memory"]
    opened, echo, pageup = latency["open_ms"], latency["echo_ms"], latency["pageup_ms"]
    emit({
        "benchmark": "tui", "params": params_of(args), "machine": machine,
        "results": {**latency, "memory": memory},
        "summary": [
            figure(f"open {2 * args.turns} messages → last answer drawn, slowest of "
                   f"{opened['n']}", opened["max"], "ms", target=f"≤ {TARGET_OPEN_MS:g} ms",
                   met=opened["max"] <= TARGET_OPEN_MS),
            figure("keystroke → echo while a turn streams at 50 tokens/s, p99", echo["p99"],
                   "ms", target=f"≤ {TARGET_ECHO_MS:g} ms",
                   met=echo["p99"] <= TARGET_ECHO_MS and latency["echo_while_streaming"]),
            figure("PageUp → page drawn (older turns and pages loaded as needed), p99",
                   pageup["p99"], "ms", target=f"≤ {TARGET_PAGEUP_MS:g} ms",
                   met=pageup["p99"] <= TARGET_PAGEUP_MS),
            figure(f"TUI RSS after loading {memory['messages_loaded']} messages by paging",
                   memory["rss_mib"], "MiB", target=f"≤ {TARGET_RSS_MIB:g} MB",
                   met=memory["rss_mib"] * 1.048576 <= TARGET_RSS_MIB),
        ],
    })


if __name__ == "__main__":
    asyncio.run(main())
