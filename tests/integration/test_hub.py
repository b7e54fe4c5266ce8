"""The hub's local hints: a process hears its own commits at once, and the NOTIFY that tells
the fleet is not taken, when it comes back, for news a second time; anyone else's notification
on the same channel and payload still gets through.
"""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from agentd import hub as hubmod
from agentd.hub import Hub, Subscription
from agentd.notifier import Notifier
from agentd.queue import notify_batch
from agentd.vocabulary import Channel
from tests.integration.helpers import DEFAULT_TIMEOUT_S, listening
from tests.support.daemon import poll_until
from tests.support.factories import enqueue, new_conversation, new_tenant


async def heard(sub: Subscription, within: float = DEFAULT_TIMEOUT_S) -> set[str]:
    return await sub.wait(within)


async def notify_from_elsewhere(pool: asyncpg.Pool, channel: Channel, payload: str) -> None:
    await pool.execute("SELECT pg_notify($1, $2)", str(channel), payload)


async def test_a_local_hint_wakes_at_once_and_its_own_notify_is_dropped_when_it_returns(
        pool: asyncpg.Pool, hub: Hub, dsn: str) -> None:
    notifier = Notifier(pool, local=hub)
    async with hub.subscribe(Channel.RUN_EVENT, "run-1") as sub, \
            listening(dsn, str(Channel.RUN_EVENT)) as fleet:
        notifier.notify(Channel.RUN_EVENT, "run-1")  # not sent yet: the notifier is idle
        assert sub.drain() == {"run-1"}, "the local subscriber hears it before any NOTIFY"
        notifier.start()
        try:
            assert await fleet.next() == "run-1"  # the fleet hears it by NOTIFY
            await poll_until(lambda: hub.echoes == 1, DEFAULT_TIMEOUT_S,
                             interval=0.005, what="the echo to come back and be dropped")
            assert sub.drain() == set(), "woken twice for one commit"
            # Another process's notification with the same channel and payload is news.
            await notify_from_elsewhere(pool, Channel.RUN_EVENT, "run-1")
            assert await heard(sub) == {"run-1"}
            assert hub.echoes == 1
        finally:
            await notifier.close()


class FailsOnce:
    """A pool whose first hint statement fails before reaching the server (nothing sent)."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self.failed = False

    async def fetchval(self, *args: object) -> object:
        if not self.failed:
            self.failed = True
            raise ConnectionResetError("the connection broke")
        return await self.pool.fetchval(*args)


async def test_a_batch_that_failed_awaits_no_echo_so_another_process_news_gets_through(
        pool: asyncpg.Pool, hub: Hub) -> None:
    """Its NOTIFY never went out, so no echo of it will come back: another process's NOTIFY on
    the same channel and payload is news (it was taken for the echo, and dropped, until the
    awaited echo expired)."""
    failing = FailsOnce(pool)
    notifier = Notifier(failing, local=hub)  # type: ignore[arg-type]
    async with hub.subscribe(Channel.CONVERSATION, "c") as sub:
        notifier.notify(Channel.CONVERSATION, "c")
        assert sub.drain() == {"c"}
        notifier.start()
        try:
            await poll_until(lambda: failing.failed, DEFAULT_TIMEOUT_S, interval=0.005,
                             what="the hint statement to fail")
            await notify_from_elsewhere(pool, Channel.CONVERSATION, "c")
            assert await heard(sub) == {"c"}, "a failed batch's awaited echo swallowed news"
            assert hub.echoes == 0
        finally:
            await notifier.close()


async def test_hints_in_one_batch_wait_for_one_echo_and_each_wakes_the_subscriber(
        pool: asyncpg.Pool, hub: Hub) -> None:
    """Two commits before the notifier sends: two local wakes (a subscriber may have read in
    between), one NOTIFY (a batch carries each pair once), so one echo to drop, not two."""
    notifier = Notifier(pool, local=hub)
    async with hub.subscribe(Channel.CONVERSATION, "c") as sub:
        notifier.notify(Channel.CONVERSATION, "c")
        assert sub.drain() == {"c"}
        notifier.notify(Channel.CONVERSATION, "c")
        assert sub.drain() == {"c"}
        notifier.start()
        try:
            await poll_until(lambda: hub.echoes == 1, DEFAULT_TIMEOUT_S,
                             interval=0.005, what="the batch's one echo")
            await notify_from_elsewhere(pool, Channel.CONVERSATION, "c")
            assert await heard(sub) == {"c"}, "a second awaited echo swallowed real news"
        finally:
            await notifier.close()


async def test_an_echo_awaited_before_its_statement_is_dropped_even_when_it_comes_first(
        pool: asyncpg.Pool, hub: Hub) -> None:
    """A NOTIFY sent inside the committing transaction (an enqueue's) can come back before the
    statement's answer is read: awaited beforehand (expect_echo), it is still dropped. One
    forgotten because its statement failed lets another process's news through."""
    async with hub.subscribe(Channel.CONVERSATION, "c") as sub:
        hub.expect_echo(Channel.CONVERSATION, "c")
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_notify($1, 'c')", str(Channel.CONVERSATION))
        await poll_until(lambda: hub.echoes == 1, DEFAULT_TIMEOUT_S, interval=0.005,
                         what="the committed NOTIFY to come back and be dropped")
        assert sub.drain() == set(), "the echo woke the subscriber"
        hub.hint_locally(Channel.CONVERSATION, "c", echo=False)  # the sender's own wake
        assert sub.drain() == {"c"}

        forget = hub.expect_echo(Channel.CONVERSATION, "c")
        with pytest.raises(asyncpg.DivisionByZeroError):
            async with pool.acquire() as conn, conn.transaction():
                await conn.execute("SELECT pg_notify($1, 'c')", str(Channel.CONVERSATION))
                await conn.execute("SELECT 1 / 0")
        forget()  # rolled back: no echo will come
        await notify_from_elsewhere(pool, Channel.CONVERSATION, "c")
        assert await heard(sub) == {"c"}, "a forgotten echo swallowed another process's news"
        assert hub.echoes == 1


async def test_an_echo_that_never_comes_stops_being_awaited(
        pool: asyncpg.Pool, hub: Hub, monkeypatch: pytest.MonkeyPatch) -> None:
    """A NOTIFY that was lost (its statement failed) must not swallow another process's news
    for long: the awaited echo expires."""
    monkeypatch.setattr(hubmod, "ECHO_WINDOW_S", 0.05)
    async with hub.subscribe(Channel.RUN_ENQUEUED, "c") as sub:
        hub.hint_locally(Channel.RUN_ENQUEUED, "c", echo=True)  # no NOTIFY will follow
        assert sub.drain() == {"c"}
        loop = asyncio.get_running_loop()
        expired_at = loop.time() + 0.05
        await poll_until(lambda: loop.time() > expired_at, DEFAULT_TIMEOUT_S,
                         interval=0.01, what="the echo window to pass")
        await notify_from_elsewhere(pool, Channel.RUN_ENQUEUED, "c")
        assert await heard(sub) == {"c"}
        assert hub.echoes == 0


async def test_rows_at_hand_leave_a_subscription_fresh_and_anything_else_makes_it_stale(
        hub: Hub) -> None:
    async with hub.subscribe(Channel.RUN_EVENT, "r") as sub:
        assert sub.clear(), "a new subscription reads the database first"
        hub.hint_locally(Channel.RUN_EVENT, "r", echo=False, rows_at_hand=True)
        assert not sub.clear(), "the rows were handed over: no read needed"
        hub.hint_locally(Channel.RUN_EVENT, "r", echo=False, rows_at_hand=True)
        hub.hint_locally(Channel.RUN_EVENT, "r", echo=False)
        assert sub.clear(), "one hint without its rows: read"
        assert not sub.clear()


async def test_a_dispatchers_wake_goes_out_only_while_its_account_has_a_turn_queued(
        pool: asyncpg.Pool, hub: Hub, dsn: str) -> None:
    """A turn's ending wakes the claim loops (the conversation's next turn may start) only when
    its account has a turn queued, in any of its conversations: otherwise every claim loop of
    the fleet would claim nothing. When it goes out, this process's loop hears it once."""
    tenant = await new_tenant(pool)
    ended = str(tenant.conversation_id)
    async with hub.subscribe(Channel.RUN_ENQUEUED) as loop, \
            listening(dsn, str(Channel.RUN_ENQUEUED)) as fleet:
        notifier = Notifier(pool, local=hub)
        notifier.notify(Channel.RUN_ENQUEUED, ended)
        assert loop.drain() == set(), "woken before the statement decided"
        await notifier.close()  # sends what is pending
        # Notifications reach a listener in commit order: the first one after the notifier's
        # statement is this one only if that statement sent none.
        await notify_from_elsewhere(pool, Channel.RUN_ENQUEUED, "after")
        assert await fleet.next() == "after"
        assert await heard(loop) == {"after"}

        other = await new_conversation(pool, tenant.account_id)
        await enqueue(pool, tenant.account_id, other)  # queued in another conversation
        assert await fleet.next() == str(other)  # the enqueue's own wake
        assert await heard(loop) == {str(other)}
        echoes = hub.echoes
        notifier = Notifier(pool, local=hub)
        notifier.notify(Channel.RUN_ENQUEUED, ended)
        await notifier.close()
        assert loop.drain() == {ended}, "this process's claim loop is woken"
        assert await fleet.next() == ended, "and the fleet's"
        await poll_until(lambda: hub.echoes == echoes + 1, DEFAULT_TIMEOUT_S,
                         interval=0.005, what="its echo to come back and be dropped")
        assert loop.drain() == set(), "woken twice for one ending"


class ClaimLoopStub:
    """A claim loop as the notifier sees it: whether it claims, and the wakes owed to it."""

    def __init__(self) -> None:
        self.claiming = True
        self.owed = 0

    def claims(self) -> bool:
        return self.claiming

    def owe_wake(self, committed_by: float, wakes: int) -> None:
        self.owed += 1


async def test_while_this_process_claims_an_endings_wake_goes_to_its_own_claim_loop_alone(
        pool: asyncpg.Pool, hub: Hub, dsn: str) -> None:
    """The process that ran the ending has that turn's slot back and claims after the ending
    committed: its own claim loop takes whatever the ending freed (it is told it owes the
    wake: dispatcher.py hands it on if it cannot claim), and no other process is woken to
    claim nothing. Once it no longer claims (a drain, overload), the fleet is."""
    tenant = await new_tenant(pool)
    ended = str(tenant.conversation_id)
    stub = ClaimLoopStub()
    async with hub.subscribe(Channel.RUN_ENQUEUED) as loop, \
            listening(dsn, str(Channel.RUN_ENQUEUED)) as fleet:
        notifier = Notifier(pool, local=hub, claim_loop=lambda: stub)
        notifier.notify(Channel.RUN_ENQUEUED, ended)
        await notifier.close()
        assert loop.drain() == set(), "nothing queued: nobody is woken"
        assert stub.owed == 0

        other = await new_conversation(pool, tenant.account_id)
        await enqueue(pool, tenant.account_id, other)  # queued in another conversation
        assert await fleet.next() == str(other)  # the enqueue's own wake
        assert await heard(loop) == {str(other)}
        notifier = Notifier(pool, local=hub, claim_loop=lambda: stub)
        notifier.notify(Channel.RUN_ENQUEUED, ended)
        await notifier.close()
        assert loop.drain() == {ended}, "this process's claim loop is woken"
        assert stub.owed == 1, "and told that it owes the wake"
        await notify_from_elsewhere(pool, Channel.RUN_ENQUEUED, "after")
        assert await fleet.next() == "after", "no NOTIFY went to the fleet"
        assert await heard(loop) == {"after"}

        stub.claiming = False
        echoes = hub.echoes
        notifier = Notifier(pool, local=hub, claim_loop=lambda: stub)
        notifier.notify(Channel.RUN_ENQUEUED, ended)
        await notifier.close()
        assert loop.drain() == {ended}
        assert stub.owed == 1, "a wake the fleet heard is owed by nobody"
        assert await fleet.next() == ended, "a process that will not claim wakes the fleet"
        await poll_until(lambda: hub.echoes == echoes + 1, DEFAULT_TIMEOUT_S,
                         interval=0.005, what="its echo to come back and be dropped")
        assert loop.drain() == set(), "woken twice for one ending"


async def test_the_wake_check_runs_once_per_hint(pool: asyncpg.Pool) -> None:
    """The statement's subquery is kept whole: the account check runs once for each wake, not
    once for each place the statement uses its answer (it ran twice per wake before)."""
    tenant = await new_tenant(pool)
    conversations = [tenant.conversation_id, *[
        await new_conversation(pool, tenant.account_id) for _ in range(2)]]
    await enqueue(pool, tenant.account_id, conversations[0])
    hints = [(Channel.RUN_ENQUEUED, str(c)) for c in conversations]
    async with pool.acquire() as conn:
        transaction = conn.transaction()
        await transaction.start()
        try:
            await conn.execute("SET LOCAL track_functions = 'pl'")
            assert await notify_batch(conn, hints) == hints
            calls = await conn.fetchval(
                "SELECT pg_stat_get_xact_function_calls('account_has_queued_turn'::regproc)")
        finally:
            await transaction.rollback()  # nothing is sent
    assert calls == len(hints), f"{calls} checks for {len(hints)} wakes"
