"""Tails: a run's journal after a cursor, and a conversation's feed of all its runs (streams
are tables with cursors: docs/architecture.md).

A tail subscribes before it reads, borrows a pooled connection only per read (an idle stream
costs a hub subscription, not a connection), and synthesizes `complete` for a terminal run whose
journal lacks one. Any process can serve any tail: everything comes from the database.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import asyncpg

from agentd.hub import RECONNECTED, Hub, Subscription
from agentd.queue import Event, read_events, run_status
from agentd.shared_reads import SharedReads
from agentd.vocabulary import Channel, EventType, RunStatus

PAGE = 500
NIL_UUID = UUID(int=0)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class BadCursor(ValueError):
    pass


def poll_interval(hub: Hub, keepalive_s: float) -> float:
    """How long a tail trusts NOTIFY before re-reading rows anyway."""
    return min(keepalive_s, 5.0 if hub.connected else 1.0)


async def _ending(pool: asyncpg.Pool, run_id: UUID,
                  after_seq: int) -> tuple[bool, Event | None]:
    """Is a reader at `after_seq` done with this run? -> (done, a `complete` to send it first).

    Only a terminal run ends. Its journaled `complete` is its last event: a reader whose cursor
    is that event has seen the ending and gets nothing more (never a second `complete`); a
    reader before it gets it from the next read. A terminal run whose journal has none (a
    finalize died midway) gets one synthesized from the row.
    """
    found = await run_status(pool, run_id)
    if found is None:
        # Deleted with its conversation: nothing more will ever be journaled. The reader gets
        # an ending that says so, instead of waiting forever on a run that no longer exists.
        return True, Event(after_seq + 1, EventType.COMPLETE,
                           {"status": str(RunStatus.CANCELLED),
                            "error": "the conversation was deleted", "message_id": None,
                            "deleted": True, "synthesized": True}, datetime.now(UTC))
    if not found.status.terminal:
        return False, None
    # Re-read from the reader's own last event: a `complete` committed with the status flip
    # is visible now.
    tail = await read_events(pool, run_id, after_seq=max(after_seq - 1, 0), limit=PAGE)
    journaled = next((e for e in tail if e.type == EventType.COMPLETE), None)
    if journaled is not None:
        return journaled.seq <= after_seq, None
    return True, Event(after_seq + 1, EventType.COMPLETE,
                       {"status": str(found.status), "error": found.error,
                        "error_code": found.error_code, "message_id": None,
                        "synthesized": True}, datetime.now(UTC))


async def run_tail(pool: asyncpg.Pool, hub: Hub, run_id: UUID, after_seq: int, *,
                   keepalive_s: float,
                   reads: SharedReads | None = None) -> AsyncIterator[Event | None]:
    """Yield the run's events after `after_seq` until `complete`; None means "send keepalive".

    `reads`: the process's shared reads, so that tails of one run woken together read once.
    """
    reads = reads or SharedReads(pool)
    cursor = after_seq
    loop = asyncio.get_running_loop()
    last_sent = loop.time()
    async with hub.subscribe(Channel.RUN_EVENT, str(run_id)) as sub:  # BEFORE reading
        quiet_checks = 0
        polled = True  # the first read, and every one after a poll, is the database's
        while True:
            # Rows this process wrote are at hand unless a hint since the last read came from
            # elsewhere (shared_reads.py).
            stale = sub.clear() or polled
            held = None if stale else reads.held_after(run_id, cursor)
            events = held if held is not None else await reads.events(run_id, cursor, PAGE)
            for event in events:
                cursor = event.seq
                yield event
                if event.type == EventType.COMPLETE:
                    return
            if events:
                last_sent = loop.time()
                quiet_checks = 1  # the journal is moving: no need to check the row
                if len(events) == PAGE:
                    continue  # more may be waiting behind a full page
                # A short page is everything committed so far; anything later sends a hint
                # that the inbox (cleared before the read) keeps, so no second read is needed.
            # Checked when the journal is quiet: on a poll, and on a wake that brought nothing
            # (a deletion wakes the tails of its runs and journals nothing).
            if not events or quiet_checks == 0 or not hub.connected:
                ended, synthesized = await _ending(pool, run_id, cursor)
                if synthesized is not None:
                    yield synthesized
                if ended:
                    return
            woke = await sub.wait(poll_interval(hub, keepalive_s))
            polled = not woke
            quiet_checks = 0 if (not woke or RECONNECTED in woke) else quiet_checks + 1
            if loop.time() - last_sent >= keepalive_s:
                last_sent = loop.time()
                yield None


@dataclass
class FeedCursor:
    """Where a conversation feed is: the newest run it knows, and its position in open runs."""

    watermark: tuple[datetime, UUID] = (EPOCH, NIL_UUID)
    open: dict[UUID, int] = field(default_factory=dict)

    def encode(self) -> str:
        raw = json.dumps({"w": [self.watermark[0].isoformat(), str(self.watermark[1])],
                          "o": {str(k): v for k, v in self.open.items()}},
                         separators=(",", ":"))
        return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str) -> FeedCursor:
        try:
            raw = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
            stamp = datetime.fromisoformat(raw["w"][0])
            cursor = cls((stamp, UUID(raw["w"][1])),
                         {UUID(k): v for k, v in raw["o"].items()})
        except (ValueError, KeyError, TypeError, IndexError, binascii.Error,
                UnicodeDecodeError, AttributeError, RecursionError):  # JSON nested too deep
            raise BadCursor("not a cursor this server issued") from None
        # Positions are the seqs this server wrote: whole numbers, never a float such as
        # Infinity (which JSON parsing here accepts) or a bool.
        if stamp.tzinfo is None or len(cursor.open) > 10_000 or any(
                type(v) is not int or v < 0 for v in cursor.open.values()):
            raise BadCursor("not a cursor this server issued")
        return cursor


@dataclass(frozen=True, slots=True)
class FeedItem:
    kind: str  # "event" | "run_state" | "lease" | "presence" | "conversation" | "deleted"
    #            | "keepalive"
    cursor: str
    run_id: UUID | None = None
    event: Event | None = None
    data: Any = None


@dataclass(frozen=True, slots=True)
class Recheck:
    """A feed's re-read of its conversation, JSON-ready: the conversation frame, the lease
    (None: nobody owns it) and the devices attached."""

    conversation: Any
    lease: Any
    attached: Any


async def conversation_feed(pool: asyncpg.Pool, hub: Hub, conversation_id: UUID,
                            cursor: FeedCursor, *, keepalive_s: float,
                            recheck: Callable[[], Awaitable[Recheck | None]],
                            meta_seen: Any, on_idle: Any = None,
                            reads: SharedReads | None = None) -> AsyncIterator[FeedItem]:
    """Every run's events in run order, plus lease, presence and conversation changes, after
    `cursor`; ends with a `deleted` item once the conversation is gone.

    `recheck()` reads the conversation, its lease and its attached devices in one round trip,
    as JSON-ready values (None when the conversation no longer exists); an item is yielded for
    each that changed (`meta_seen`: the conversation the client already has, from its
    snapshot). `on_idle()` runs on each quiet poll (presence renewal). `reads`: the process's
    shared reads.
    """
    reads = reads or SharedReads(pool)
    loop = asyncio.get_running_loop()
    last_sent = loop.time()
    lease_seen: Any = object()
    presence_seen: Any = object()
    flagged: set[UUID] = set()  # open runs whose stop request this feed has announced
    # The re-read of the conversation runs beside the journal, not in front of it: a turn's
    # first delta, committed while the re-read its run_started asked for is under way, goes
    # out at once instead of waiting for it (a round trip of first-token latency).
    checking: asyncio.Future[Recheck | None] | None = None
    check_again = False  # asked for while one was under way, which may have read too early
    try:
        async with hub.watch() as sub:
            sub.listen(Channel.CONVERSATION, str(conversation_id))
            for run_id in cursor.open:
                sub.listen(Channel.RUN_EVENT, str(run_id))
            stale_meta = True
            polled = True  # the first pass, and every one after a poll, reads the database
            read_rows = True
            while True:
                progressed = False
                if read_rows:
                    stale = sub.clear() or polled or stale_meta
                    polled = False
                    # Woken only by rows this process wrote for runs the feed follows: they
                    # are at hand (shared_reads.py), no list of runs or journal to read.
                    held = None if stale else _held_events(reads, cursor)
                    runs = [] if held is not None else await reads.runs(
                        conversation_id, cursor.watermark, list(cursor.open))
                    if held is None:
                        # The cursor comes from the client: a run it names that is not one of
                        # this conversation's (another account's, or gone) is dropped before
                        # anything is handed out from the rows this process holds for it. The
                        # first pass always reads, so no such run outlives it.
                        _drop_strangers(sub, cursor, {row["id"] for row in runs})
                    for run_id, event in held or ():
                        cursor.open[run_id] = event.seq
                        progressed = True
                        yield FeedItem("event", cursor.encode(), run_id, event)
                    for row in runs:
                        run_id = row["id"]
                        if (row["created_at"], run_id) > cursor.watermark:
                            cursor.watermark = (row["created_at"], run_id)
                            cursor.open.setdefault(run_id, 0)
                            sub.listen(Channel.RUN_EVENT, str(run_id))
                        if run_id not in cursor.open:
                            continue
                        if row["cancel_requested"] and run_id not in flagged:
                            # Stop is a state: show it on every device now, not when it ends.
                            flagged.add(run_id)
                            progressed = True
                            yield FeedItem("run_state", cursor.encode(), run_id, data={
                                "run_id": str(run_id), "status": row["status"],
                                "cancel_requested": True})
                        async for item in _drain_run(pool, reads, cursor, run_id,
                                                     row["status"]):
                            progressed = True
                            if item.event is not None and item.event.type in (
                                    EventType.RUN_STARTED, EventType.COMPLETE):
                                stale_meta = True
                            yield item
                        if run_id not in cursor.open:
                            sub.unlisten(Channel.RUN_EVENT, str(run_id))
                read_rows = True
                if stale_meta:
                    stale_meta = False
                    if checking is None:
                        checking = asyncio.ensure_future(recheck())
                    else:
                        check_again = True
                if checking is not None and checking.done():
                    now = checking.result()
                    checking = None
                    if check_again:
                        check_again, stale_meta = False, True
                    if now is None:
                        yield FeedItem("deleted", cursor.encode(),
                                       data={"conversation_id": str(conversation_id)})
                        return
                    if now.conversation != meta_seen:
                        meta_seen = now.conversation
                        progressed = True
                        yield FeedItem("conversation", cursor.encode(), data=now.conversation)
                    if now.lease != lease_seen:
                        lease_seen = now.lease
                        progressed = True
                        yield FeedItem("lease", cursor.encode(), data=now.lease)
                    if now.attached != presence_seen:
                        presence_seen = now.attached
                        progressed = True
                        yield FeedItem("presence", cursor.encode(), data=now.attached)
                if progressed:
                    last_sent = loop.time()
                if stale_meta:
                    continue
                # Whatever was committed after the read began sent a hint, which the inbox
                # (cleared before it) keeps: the wait returns at once for it. With none, there
                # is nothing to read again, and a delta this process writes next is handed out
                # from its rows, not after a read of the database begun for nothing.
                woke = await sub.wait(poll_interval(hub, keepalive_s), until=checking)
                if not woke and checking is not None and checking.done():
                    read_rows = False  # only the re-read came back: hand out what it found
                    continue
                polled = not woke
                stale_meta = not woke or RECONNECTED in woke or str(conversation_id) in woke
                if not woke and on_idle is not None:
                    await on_idle()
                if loop.time() - last_sent >= keepalive_s:
                    last_sent = loop.time()
                    yield FeedItem("keepalive", cursor.encode())
    finally:
        if checking is not None and not checking.done():
            checking.cancel()
        elif checking is not None and not checking.cancelled():
            checking.exception()  # retrieved: the feed ended for another reason first


def _drop_strangers(sub: Subscription, cursor: FeedCursor, found: set[UUID]) -> None:
    """Stop following the open runs the conversation's read did not return."""
    for run_id in [r for r in cursor.open if r not in found]:
        del cursor.open[run_id]
        sub.unlisten(Channel.RUN_EVENT, str(run_id))


def _held_events(reads: SharedReads, cursor: FeedCursor) -> list[tuple[UUID, Event]] | None:
    """The rows after the cursor of every run the feed follows, when this process holds them
    all (None: read the database)."""
    found: list[tuple[UUID, Event]] = []
    for run_id, seq in cursor.open.items():
        held = reads.held_after(run_id, seq)
        if held is None:
            return None
        found.extend((run_id, event) for event in held)
    return found


async def _drain_run(pool: asyncpg.Pool, reads: SharedReads, cursor: FeedCursor, run_id: UUID,
                     status: str) -> AsyncIterator[FeedItem]:
    while True:
        events = await reads.events(run_id, cursor.open[run_id], PAGE)
        for event in events:
            cursor.open[run_id] = event.seq
            if event.type == EventType.COMPLETE:
                del cursor.open[run_id]
                yield FeedItem("event", cursor.encode(), run_id, event)
                return
            yield FeedItem("event", cursor.encode(), run_id, event)
        if len(events) < PAGE:
            break
    if RunStatus(status).terminal:
        ended, synthesized = await _ending(pool, run_id, cursor.open[run_id])
        if ended:
            del cursor.open[run_id]
        if synthesized is not None:
            yield FeedItem("event", cursor.encode(), run_id, synthesized)
