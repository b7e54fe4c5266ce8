"""GET /v1/runs/{id}/wait holds a request open for minutes, as a stream does: revoking the device
ends it as it ends the device's streams, with a 401 `device_revoked` and nothing of the run.
"""

from __future__ import annotations

import asyncio
import time

import asyncpg
import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import started_api
from tests.api.helpers import SLOW, assert_error, start_run, wait_run
from tests.support.daemon import poll_until
from tests.support.factories import create_conversation, new_device

KEEPALIVE_S = 2.0
BOUND_S = KEEPALIVE_S + 3.0  # a revocation reaches waits as it reaches streams: one keepalive
WAIT_TIMEOUT_S = 25  # what the revoked device asks to wait: far longer than the bound


async def hub_subscribers(client: httpx.AsyncClient) -> float:
    """This process's in-process subscriptions (a wait on a run holds one)."""
    response = await client.get("/metrics")
    assert response.status_code == 200, response.text
    for family in text_string_to_metric_families(response.text):
        if family.name == "agentd_hub_subscribers":
            return family.samples[0].value
    raise AssertionError("no agentd_hub_subscribers in /metrics")


async def test_a_device_revoked_while_waiting_on_a_run_gets_401_and_no_run(
        spawn_daemon, pool: asyncpg.Pool) -> None:
    async with started_api(spawn_daemon, pool, keepalive_s=KEEPALIVE_S) as api:
        phone = await new_device(pool, "alice", "phone")
        conversation = await create_conversation(api.a)
        run = await start_run(api.a, conversation, "a long answer", SLOW)
        run_id = run["run_id"]
        await wait_run(api.a, run_id, ("running",))
        before = await hub_subscribers(api.a)
        async with phone.client(api.daemon) as on_phone:
            waiting = asyncio.create_task(on_phone.get(
                f"/v1/runs/{run_id}/wait", params={"timeout": str(WAIT_TIMEOUT_S)}))

            async def wait_is_subscribed() -> bool:
                # Past authentication and waiting on the run's events: the wait is under way.
                assert not waiting.done(), waiting.result().text
                return await hub_subscribers(api.a) > before

            await poll_until(wait_is_subscribed, 30, what="the phone's wait to be under way")
            revoked_at = time.monotonic()
            answer = await api.a.delete(f"/v1/devices/{phone.device_id}")
            assert answer.status_code == 200, answer.text
            try:
                response = await asyncio.wait_for(waiting, BOUND_S)
            except TimeoutError:
                raise AssertionError(f"the revoked device's wait went on past {BOUND_S} s") \
                    from None
            elapsed = time.monotonic() - revoked_at
        assert elapsed <= BOUND_S, elapsed
        error = assert_error(response, 401, "device_revoked")
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
        assert set(error) == {"code", "message"}, error
        assert run_id not in response.text and conversation not in response.text
        # The revocation ended the wait, not the run: stopping it is what stop is for.
        still = (await api.a.get(f"/v1/runs/{run_id}")).json()
        assert still["status"] == "running" and not still["cancel_requested"], still
        # The other device's own wait on the same run is untouched by the revocation.
        other = await api.a.get(f"/v1/runs/{run_id}/wait", params={"timeout": "0"})
        assert other.status_code == 200 and other.json()["id"] == run_id, other.text
        await api.a.post(f"/v1/runs/{run_id}/cancel")
