"""Time to first token at a streaming client, and stop latency, through the HTTP API.

First token: a client attached to the conversation's SSE feed (as agenttui is) POSTs a run and
times the arrival of the run's first `content_delta`, minus the demo provider's own delay before
its first token (`delay_ms`). A second series opens the run's own SSE stream right after the
POST instead. Stop: while a long run streams, the client POSTs /stop and times the arrival of
`complete` (status cancelled) on the feed. Both are client-clock intervals; the breakdowns use
the database clock (offset to the client clock measured once with clock_timestamp()).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import time
from collections.abc import AsyncIterator
from typing import Any
from uuid import UUID

import aiohttp
import asyncpg

from harness import (
    SseEvent,
    base_parser,
    bench_database,
    client_session,
    clock_offset,
    daemon_settings,
    daemons,
    emit,
    figure,
    machine_info,
    make_account,
    make_conversations,
    open_pool,
    params_of,
    percentiles,
    post_json,
    progress,
    sse_stream,
)

TARGET_FIRST_TOKEN_MS = 5.0
TARGET_FIRST_TOKEN_P99_MS = 10.0
TARGET_STOP_MS = 50.0


class Feed:
    """A conversation's SSE feed read by a background task, each frame stamped on arrival."""

    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        self._http = http
        self._url = url
        self.events: asyncio.Queue[SseEvent] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def _read(self, resp: aiohttp.ClientResponse) -> None:
        async for event in sse_stream(resp):
            self.events.put_nowait(event)

    @contextlib.asynccontextmanager
    async def open(self) -> AsyncIterator[Feed]:
        async with self._http.get(self._url) as resp:
            if resp.status != 200:
                raise RuntimeError(f"GET {self._url}: {resp.status} {await resp.text()}")
            self._task = asyncio.create_task(self._read(resp))
            try:
                yield self
            finally:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                    await self._task

    async def next(self, predicate: Any, within_s: float = 30.0) -> SseEvent:
        async with asyncio.timeout(within_s):
            while True:
                event = await self.events.get()
                if predicate(event):
                    return event


def _is(event_type: str, run_id: str | None = None) -> Any:
    def match(event: SseEvent) -> bool:
        return event.event == event_type and (run_id is None or
                                              event.data.get("run_id") == run_id)
    return match


async def _stamps(pool: asyncpg.Pool, run_id: str) -> dict[str, float]:
    """Database-clock times (epoch seconds) of a run's milestones."""
    row = await pool.fetchrow(
        """SELECT r.created_at, r.started_at,
                  (SELECT min(created_at) FROM run_event WHERE run_id = r.id
                     AND type = 'run_started') AS run_started,
                  (SELECT min(created_at) FROM run_event WHERE run_id = r.id
                     AND type = 'content_delta') AS first_delta,
                  (SELECT min(created_at) FROM run_event WHERE run_id = r.id
                     AND type = 'cancel_requested') AS cancel_requested,
                  (SELECT min(created_at) FROM run_event WHERE run_id = r.id
                     AND type = 'complete') AS complete
           FROM agent_run r WHERE r.id = $1::uuid""", UUID(run_id))
    return {k: v.timestamp() for k, v in dict(row).items() if v is not None}


def _ms(seconds: float) -> float:
    return seconds * 1000


async def first_token_series(mode: str, http: aiohttp.ClientSession,
                             posts: aiohttp.ClientSession, pool: asyncpg.Pool, url: str,
                             conversations: list[UUID], tokens: int, delay_ms: int,
                             offset: float) -> dict[str, Any]:
    delay = delay_ms / 1000
    totals, parts = [], {"post_to_enqueued": [], "enqueued_to_claimed": [],
                         "claimed_to_run_started": [], "run_started_to_first_delta_journaled":
                         [], "journaled_to_client": []}
    for i, conversation in enumerate(conversations):
        body = {"content": f"first token {mode} {i}",
                "params": {"tokens": tokens, "delay_ms": delay_ms}}
        runs_url = f"{url}/v1/conversations/{conversation}/runs"
        if mode == "conversation_feed":
            async with Feed(http, f"{url}/v1/conversations/{conversation}/events").open() as feed:
                await feed.next(_is("presence"))  # attached and idle
                await asyncio.sleep(random.uniform(0.02, 0.1))
                posted, posted_wall = time.monotonic(), time.time()
                run_id = (await post_json(posts, runs_url, body))["run_id"]
                first = await feed.next(_is("content_delta", run_id))
                await feed.next(_is("complete", run_id))
        else:
            await asyncio.sleep(random.uniform(0.02, 0.1))
            posted, posted_wall = time.monotonic(), time.time()
            run_id = (await post_json(posts, runs_url, body))["run_id"]
            async with http.get(f"{url}/v1/runs/{run_id}/events") as resp:
                stream = sse_stream(resp)
                first = await anext(e async for e in stream if e.event == "content_delta")
                async for event in stream:
                    if event.event == "complete":
                        break
        totals.append(_ms(first.received_mono - posted - delay))
        s = await _stamps(pool, run_id)
        parts["post_to_enqueued"].append(_ms(s["created_at"] - (posted_wall + offset)))
        parts["enqueued_to_claimed"].append(_ms(s["started_at"] - s["created_at"]))
        parts["claimed_to_run_started"].append(_ms(s["run_started"] - s["started_at"]))
        parts["run_started_to_first_delta_journaled"].append(
            _ms(s["first_delta"] - s["run_started"] - delay))
        parts["journaled_to_client"].append(_ms(first.received + offset - s["first_delta"]))
    return {"post_to_first_delta_minus_delay_ms": percentiles(totals),
            # In sample order: the first few after the daemon's start show its warm-up.
            "samples_ms": [round(t, 2) for t in totals],
            "breakdown_p50_ms": {k: percentiles(v)["p50"] for k, v in parts.items()},
            "breakdown_ms": {k: percentiles(v) for k, v in parts.items()}}


async def stop_series(http: aiohttp.ClientSession, posts: aiohttp.ClientSession,
                      pool: asyncpg.Pool, url: str, conversations: list[UUID], delay_ms: int,
                      offset: float) -> dict[str, Any]:
    totals, statuses = [], {}
    parts: dict[str, list[float]] = {"post_to_cancel_journaled": [],
                                     "cancel_journaled_to_complete_journaled": [],
                                     "complete_journaled_to_client": []}
    # Long enough never to end on its own before the stop (about five minutes), short enough
    # for the demo provider's cap, which keeps a demo turn inside the default turn deadline.
    long_tokens = 300_000 // max(delay_ms, 1)
    for i, conversation in enumerate(conversations):
        async with Feed(http, f"{url}/v1/conversations/{conversation}/events").open() as feed:
            await feed.next(_is("presence"))
            run_id = (await post_json(posts, f"{url}/v1/conversations/{conversation}/runs", {
                "content": f"stop {i}", "params": {"tokens": long_tokens,
                                                   "delay_ms": delay_ms}}))["run_id"]
            await feed.next(_is("content_delta", run_id))
            # Land the stop at a random point of the flush clock and of the heartbeat cycle.
            await asyncio.sleep(random.uniform(0.05, 0.6))
            asked, asked_wall = time.monotonic(), time.time()
            await post_json(posts, f"{url}/v1/conversations/{conversation}/stop")
            complete = await feed.next(_is("complete", run_id))
        totals.append(_ms(complete.received_mono - asked))
        status = complete.data.get("status")
        statuses[status] = statuses.get(status, 0) + 1
        s = await _stamps(pool, run_id)
        if "cancel_requested" in s:
            parts["post_to_cancel_journaled"].append(
                _ms(s["cancel_requested"] - (asked_wall + offset)))
            parts["cancel_journaled_to_complete_journaled"].append(
                _ms(s["complete"] - s["cancel_requested"]))
        parts["complete_journaled_to_client"].append(
            _ms(complete.received + offset - s["complete"]))
    return {"stop_to_complete_ms": percentiles(totals), "statuses": statuses,
            "breakdown_p50_ms": {k: percentiles(v)["p50"] for k, v in parts.items()},
            "breakdown_ms": {k: percentiles(v) for k, v in parts.items()}}


async def main() -> int:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=100,
                        help="first-token samples per series (default 100)")
    parser.add_argument("--stop-samples", type=int, default=60)
    parser.add_argument("--tokens", type=int, default=3)
    parser.add_argument("--delay-ms", type=int, default=0,
                        help="the demo provider's pause before each token, subtracted from the "
                             "figures (default 0: the target is set for a model with no delay)")
    parser.add_argument("--stop-delay-ms", type=int, default=20,
                        help="token pace of the long runs the stop series stops (default 20)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.quick:
        args.samples, args.stop_samples = min(args.samples, 15), min(args.stop_samples, 10)
    random.seed(args.seed)
    started = time.monotonic()
    async with bench_database(args, "first") as database:
        machine = await machine_info(database)
        pool = await open_pool(database.dsn)
        try:
            token, account_id = await make_account(pool)
            total = 2 * args.samples + args.stop_samples
            convs = await make_conversations(pool, account_id, total, "first token")
            feed_convs = convs[:args.samples]
            run_convs = convs[args.samples:2 * args.samples]
            stop_convs = convs[2 * args.samples:]
            # POSTs go over a connection kept for them, as an attached client's do (agenttui
            # keeps one for KEEPALIVE_S): in one session, each sample's feed took the POST's
            # idle connection, so every POST paid a new TCP connection.
            async with daemons(database, 1, **daemon_settings(args)) as (daemon,), \
                    client_session(token) as http, client_session(token) as posts:
                offset = await clock_offset(database.dsn)
                progress(f"first token via the conversation feed: {args.samples} samples")
                feed = await first_token_series("conversation_feed", http, posts, pool,
                                                daemon.url, feed_convs, args.tokens,
                                                args.delay_ms, offset)
                progress(f"first token via the run stream: {args.samples} samples")
                run = await first_token_series("run_stream", http, posts, pool, daemon.url,
                                               run_convs, args.tokens, args.delay_ms, offset)
                progress(f"stop latency: {args.stop_samples} samples")
                stop = await stop_series(http, posts, pool, daemon.url, stop_convs,
                                         args.stop_delay_ms, offset)
        finally:
            await pool.close()
    ft = feed["post_to_first_delta_minus_delay_ms"]
    st = stop["stop_to_complete_ms"]
    emit({
        "benchmark": "first_token", "params": params_of(args), "machine": machine,
        "results": {"clock_offset_ms": round(offset * 1000, 3),
                    "first_token_conversation_feed": feed, "first_token_run_stream": run,
                    "stop": stop},
        "summary": [
            figure("POST → first delta at feed client − delay, p50", ft.get("p50"), "ms",
                   target=f"≤ {TARGET_FIRST_TOKEN_MS:g} ms",
                   met=ft.get("p50") is not None and ft["p50"] <= TARGET_FIRST_TOKEN_MS),
            figure("POST → first delta at feed client − delay, p99", ft.get("p99"), "ms",
                   target=f"≤ {TARGET_FIRST_TOKEN_P99_MS:g} ms",
                   met=ft.get("p99") is not None and ft["p99"] <= TARGET_FIRST_TOKEN_P99_MS),
            figure("POST → first delta on run stream − delay, p50",
                   run["post_to_first_delta_minus_delay_ms"].get("p50"), "ms"),
            figure("stop → complete(cancelled) at client, p50", st.get("p50"), "ms",
                   target=f"≤ {TARGET_STOP_MS:g} ms",
                   met=st.get("p50") is not None and st["p50"] <= TARGET_STOP_MS
                   and set(stop["statuses"]) == {"cancelled"}),
            figure("stop → complete(cancelled) at client, p99", st.get("p99"), "ms"),
        ],
        "seconds": round(time.monotonic() - started, 1),
    })
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
