"""Fair and bounded over HTTP: a full queue is a 429 with Retry-After that writes nothing, a
model outside the account's allowlist a 403 naming it, a failed run a stable code with a message
fit for clients, and the metrics an operator alerts on, parsed by prometheus-client itself."""

from __future__ import annotations

from typing import Any

import asyncpg
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentd.accounts import LimitChange, set_account_limits
from agentd.failures import CLIENT_MESSAGES
from agentd.vocabulary import RunErrorCode
from tests.api.conftest import Api, started_api
from tests.api.helpers import SLOW, assert_error, assert_run, db_state, start_run, wait_run
from tests.support.daemon import poll_until
from tests.support.factories import create_conversation
from tests.support.sse import read_sse


@pytest.mark.parametrize("claim_on_enqueue", [True, False],
                         ids=["with a claim beside the enqueue", "without"])
async def test_over_the_queued_limit_is_429_with_retry_after_and_nothing_written(
        spawn_daemon, pool: asyncpg.Pool, claim_on_enqueue: bool):
    async with started_api(spawn_daemon, pool, claim_on_enqueue=claim_on_enqueue) as api:
        await _over_the_queued_limit(api)


async def _over_the_queued_limit(api: Api) -> None:
    await set_account_limits(api.pool, "alice", LimitChange(change_queued=True, max_queued=2))
    busy = await create_conversation(api.a)
    first = await start_run(api.a, busy, "runs", SLOW)
    await wait_run(api.a, first["run_id"], ("running",))
    queued = [await start_run(api.a, busy, f"waits {n}") for n in range(2)]
    other = await create_conversation(api.a)
    before = await db_state(api.pool)
    refused = await api.a.post(f"/v1/conversations/{other}/runs",
                               json={"content": "one too many"},
                               headers={"Idempotency-Key": "too-many"})
    error = assert_error(refused, 429, "queue_full")
    assert int(refused.headers["Retry-After"]) >= 1
    assert error["max_queued"] == 2 and "2 turns queued" in error["message"]
    assert await db_state(api.pool) == before  # nothing written, not even the key
    # Another account is not affected by alice's limit.
    stranger = await create_conversation(api.b)
    await start_run(api.b, stranger, "bob is fine")
    # The earlier turns are untouched and the conversation moves on once room is made.
    for run in queued:
        assert (await api.a.get(f"/v1/runs/{run['run_id']}")).json()["status"] == "queued"
    assert (await api.a.post(f"/v1/runs/{queued[-1]['run_id']}/cancel")).status_code == 202
    again = await api.a.post(f"/v1/conversations/{other}/runs", json={"content": "now"})
    assert again.status_code == 202, again.text
    metrics = await scrape(api.a)
    assert metrics['agentd_throttled_total{reason="queue_full"}'] == 1
    await api.a.post(f"/v1/conversations/{busy}/stop")


async def test_a_model_outside_the_allowlist_is_403_naming_it(api: Api):
    await set_account_limits(api.pool, "alice",
                             LimitChange(change_models=True, models=("openai:*",)))
    conversation = await create_conversation(api.a)
    before = await db_state(api.pool)
    refused = await api.a.post(f"/v1/conversations/{conversation}/runs",
                               json={"content": "hi", "model": "demo"})
    error = assert_error(refused, 403, "model_not_allowed")
    assert error["model"] == "demo" and "'demo'" in error["message"]
    assert "openai:*" in error["message"]
    assert await db_state(api.pool) == before
    # Nor can a conversation be set to it, which would make every post naming no model a 403
    # (both were accepted before).
    created = await api.a.post("/v1/conversations", json={"title": "t", "model": "demo"})
    assert assert_error(created, 403, "model_not_allowed")["model"] == "demo"
    patched = await api.a.patch(f"/v1/conversations/{conversation}", json={"model": "demo"})
    assert assert_error(patched, 403, "model_not_allowed")["model"] == "demo"
    assert await db_state(api.pool) == before
    cleared = await api.a.patch(f"/v1/conversations/{conversation}", json={"model": None})
    assert cleared.status_code == 200, cleared.text
    # Its offer says so too; bob, with no patterns, sees the operator's offer alone.
    mine = {m["name"]: m for m in (await api.a.get("/v1/models")).json()["models"]}
    theirs = {m["name"]: m for m in (await api.b.get("/v1/models")).json()["models"]}
    assert (mine["demo"]["usable"], mine["demo"]["reason"]) == (False, "not allowed for "
                                                                       "this account")
    assert (theirs["demo"]["usable"], theirs["demo"]["reason"]) == (True, None)
    await set_account_limits(api.pool, "alice",
                             LimitChange(change_models=True, models=("demo", "local:*")))
    allowed = await api.a.post(f"/v1/conversations/{conversation}/runs",
                               json={"content": "hi", "model": "demo",
                                     "params": {"tokens": 2, "delay_ms": 0}})
    assert allowed.status_code == 202, allowed.text


async def test_a_demo_turn_that_could_not_fit_the_deadline_is_refused_at_enqueue(api: Api):
    conversation = await create_conversation(api.a)
    refused = await api.a.post(f"/v1/conversations/{conversation}/runs", json={
        "content": "forever", "params": {"tokens": 100_000, "delay_ms": 60_000}})
    error = assert_error(refused, 422, "invalid_params")
    assert "600 s" in error["message"]


async def test_a_failed_run_shows_a_stable_code_and_a_message_without_internals(api: Api):
    conversation = await create_conversation(api.a)
    run = await start_run(api.a, conversation, "fail midway",
                          {"tokens": 20, "delay_ms": 0, "fail": 5})
    ended = await wait_run(api.a, run["run_id"])
    assert_run(ended)
    assert (ended["status"], ended["error_code"], ended["error"]) == (
        "failed", "provider_error", CLIENT_MESSAGES[RunErrorCode.PROVIDER_ERROR])
    frames = await read_sse(api.a, f"/v1/runs/{run['run_id']}/events")
    [complete] = [f for f in frames if f.event == "complete"]
    assert (complete.data["error"], complete.data["error_code"]) == (
        ended["error"], "provider_error")
    # The detail is in the daemon's log, by run id.
    await api.daemon.wait_for_log(f"run_id={run['run_id']}", timeout=10)
    assert "params.fail" in api.daemon.log_text()
    # And what streamed before the failure is kept, as every client saw it.
    state = (await api.a.get(f"/v1/conversations/{conversation}")).json()
    [answer] = [m for m in state["messages"] if m["role"] == "assistant"]
    streamed = "".join(f.data["delta"] for f in frames if f.event == "content_delta")
    assert (answer["status"], answer["content"]) == ("failed", streamed)
    assert complete.data["message_id"] == answer["id"]


async def test_the_metrics_an_operator_alerts_on_parse_with_prometheus_client(api: Api):
    conversation = await create_conversation(api.a)
    done = await start_run(api.a, conversation, "quick", {"tokens": 5, "delay_ms": 10})
    await wait_run(api.a, done["run_id"])
    await read_sse(api.a, f"/v1/runs/{done['run_id']}/events")
    running = await start_run(api.a, conversation, "long", {"tokens": 300, "delay_ms": 200})
    await wait_run(api.a, running["run_id"], ("running",))
    # A client follows it live: its deltas are timed from journal write to send.
    await read_sse(api.a, f"/v1/runs/{running['run_id']}/events",
                   stop_after=lambda e: e.event == "content_delta" and e.data["seq"] > 5)
    await start_run(api.a, conversation, "queued behind")

    async def counted() -> dict[str, float] | None:
        now = await scrape(api.a)
        return now if now.get("agentd_time_to_first_token_seconds_count", 0) >= 2 else None

    metrics = await poll_until(counted, 30, what="two first tokens counted")
    families = await families_of(api.a)
    expected = {
        "agentd_enqueue_to_start_seconds": "histogram",
        "agentd_time_to_first_token_seconds": "histogram",
        "agentd_run_duration_seconds": "histogram",
        "agentd_stream_delta_lag_seconds": "histogram",
        "agentd_claim_batch_size": "histogram",
        "agentd_event_loop_lag_seconds": "histogram",
        "agentd_pool_wait_seconds": "histogram",
        "agentd_claimed": "counter", "agentd_reaped": "counter",
        "agentd_fenced_writes": "counter", "agentd_cancels": "counter",
        "agentd_deadline_failures": "counter", "agentd_throttled": "counter",
        "agentd_queue_depth": "gauge", "agentd_account_runs": "gauge",
        "agentd_account_limit": "gauge", "agentd_attached_devices": "gauge",
        "agentd_streams_open": "gauge", "agentd_hub_connected": "gauge",
    }
    assert {name: families[name] for name in expected} == expected
    assert metrics['agentd_queue_depth{state="queued"}'] == 1
    assert metrics['agentd_queue_depth{state="running"}'] == 1
    assert metrics['agentd_account_runs{account="alice",state="running"}'] == 1
    assert metrics['agentd_account_limit{account="alice",limit="max_running"}'] == 16
    assert metrics['agentd_run_duration_seconds_count{status="completed"}'] >= 1
    assert metrics["agentd_enqueue_to_start_seconds_count"] >= 2
    assert metrics["agentd_stream_delta_lag_seconds_count"] >= 1
    assert metrics["agentd_claim_batch_size_count"] >= 2
    stopped = await api.a.post(f"/v1/conversations/{conversation}/stop")
    assert stopped.status_code == 202
    assert (await scrape(api.a))["agentd_cancels_total"] == 2  # one flagged, one queued


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    """Every sample as `name{label="value",…}` -> value (labels sorted), via the library."""
    response = await client.get("/metrics")
    assert response.status_code == 200
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


async def families_of(client: httpx.AsyncClient) -> dict[str, Any]:
    response = await client.get("/metrics")
    return {f.name: f.type for f in text_string_to_metric_families(response.text)}


async def test_models_on_offer_follow_the_operator_and_the_account(spawn_daemon, pool):
    async with started_api(spawn_daemon, pool, demo_enabled="false") as api:
        listed = (await api.a.get("/v1/models")).json()["models"]
        assert "demo" not in {m["name"] for m in listed}  # switched off: not on offer
        conversation = await create_conversation(api.a)
        refused = await api.a.post(f"/v1/conversations/{conversation}/runs",
                                   json={"content": "hi", "model": "demo"})
        error = assert_error(refused, 422, "model_unavailable")
        assert "switched off" in error["message"]
