"""A database link that dies without a word (no reset, no error: a NAT or firewall that drops
an idle flow, a peer that vanished) under the heartbeat's connection: the turns it keeps go on."""

from __future__ import annotations

from agentd.vocabulary import RunStatus
from tests.process.helpers import wait_streaming
from tests.support.daemon import ADMIT_ANY_LOAD, SpawnDaemon, poll_until
from tests.support.factories import enqueue_demo, new_account, new_conversation
from tests.support.journal import run_row, wait_status
from tests.support.lost_answers import relayed

LEASE_S = 9.0
BEAT_S = 3.0


async def test_a_heartbeat_over_a_silent_link_is_retried_before_the_leases_lapse(
        spawn_daemon: SpawnDaemon, pool, dsn: str) -> None:
    """A beat sent over a silent link waited a whole lease for its answer, so the retry came
    after the leases had lapsed: the daemon's own reaper failed its live turn `lease_expired`
    while everything else worked. A beat now gives up after half a lease, and its retry on a
    new connection lands in time."""
    async with relayed(spawn_daemon, dsn, lease_ttl_s=LEASE_S, heartbeat_s=BEAT_S,
                       reap_grace_s=0, reap_interval_s=0.5, **ADMIT_ANY_LOAD) as (relay, daemon):
        account = await new_account(pool)
        conversation = await new_conversation(pool, account)
        # Streams for about three leases: every beat of its life must land.
        turn = await enqueue_demo(pool, account, conversation, "silent link",
                                  tokens=270, delay_ms=100)
        await wait_streaming(pool, turn.run_id, timeout=15)
        beats = await pool.fetchval("SELECT lease_expires_at FROM agent_run WHERE id = $1",
                                    turn.run_id)
        assert relay.stall(b"agentd-heartbeat") == 1, "the heartbeat's one connection"

        async def renewed_again() -> bool:
            row = await run_row(pool, turn.run_id)
            return row["status"] != RunStatus.RUNNING or row["lease_expires_at"] > beats

        await poll_until(renewed_again, LEASE_S * 2, what="a beat after the link went quiet")
        done = await wait_status(pool, turn.run_id, ("completed", "failed"), timeout=60)
        assert done["status"] == RunStatus.COMPLETED, (done["error_code"], done["error"])
        assert "heartbeat failed" in daemon.log_text()
