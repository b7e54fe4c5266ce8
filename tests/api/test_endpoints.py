"""API v1 endpoint by endpoint against a real daemon: the documented success shapes, 401 for
missing/garbage/revoked tokens, 404 (and no side effect) for another account's ids, 4xx JSON for
bad input, and never a 5xx or a text/plain error.
"""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

import httpx
import schemathesis
from prometheus_client.parser import text_string_to_metric_families

from agentd.accounts import create_device_token, revoke_device
from agentd.api.bodies import MAX_BODY_BYTES, max_body_bytes
from agentd.runtime import Runtime, build_app
from agentd.settings import Settings
from tests.api.conftest import Api, started_api
from tests.api.helpers import (
    FAST,
    SLOW,
    WAIT_S,
    assert_error,
    assert_json,
    assert_message,
    assert_run,
    assert_time,
    assert_uuid,
    db_state,
    fetch,
    start_run,
    wait_run,
)
from tests.support.daemon import poll_until
from tests.support.factories import create_conversation
from tests.support.sse import iter_sse, read_sse

METHODS = ("get", "post", "put", "patch", "delete")
BODY_OVER = max_body_bytes(Settings()) + 1  # one byte more than the body cap
# Operations whose success case a test below asserts; a new endpoint must join this list.
SUCCESS_TESTED = {
    ("GET", "/v1/me"), ("POST", "/v1/conversations"), ("GET", "/v1/conversations"),
    ("GET", "/v1/conversations/{id}"), ("PATCH", "/v1/conversations/{id}"),
    ("GET", "/v1/conversations/{id}/export"), ("GET", "/v1/search"),
    ("POST", "/v1/conversations/{id}/runs"), ("POST", "/v1/conversations/{id}/stop"),
    ("GET", "/v1/conversations/{id}/events"), ("GET", "/v1/runs/{id}"),
    ("GET", "/v1/runs/{id}/wait"), ("POST", "/v1/runs/{id}/cancel"),
    ("GET", "/v1/runs/{id}/events"), ("GET", "/healthz"), ("GET", "/readyz"),
    ("GET", "/metrics"), ("GET", "/openapi.json"),
    # tests/api/test_devices.py
    ("POST", "/v1/pairings"), ("POST", "/v1/pair"), ("GET", "/v1/devices"),
    ("DELETE", "/v1/devices/{id}"),
    # Their success needs a tool call waiting for approval: tests/tools/test_approvals.py.
    ("GET", "/v1/runs/{id}/approvals"), ("POST", "/v1/runs/{id}/approvals/{call_id}"),
    # tests/api/test_lifecycle.py
    ("DELETE", "/v1/conversations/{id}"), ("POST", "/v1/conversations/{id}/fork"),
    ("GET", "/v1/models"),
    # tests/api/test_paging.py
    ("GET", "/v1/conversations/{id}/messages"),
}
# The one /v1 call a pairing code authorizes instead of a bearer token.
UNAUTHENTICATED = {("POST", "/v1/pair")}
NEEDS_PENDING_APPROVAL = {("POST", "/v1/runs/{id}/approvals/{call_id}")}


async def spec_operations(client: httpx.AsyncClient) -> set[tuple[str, str]]:
    spec = (await client.get("/openapi.json")).json()
    return {(method.upper(), path) for path, item in spec["paths"].items()
            for method in item if method in METHODS}


def valid_request(method: str, path: str, message_id: str | None = None) -> dict[str, Any]:
    """A well-formed request for an operation (bodies and queries a real client would send);
    `message_id` is the message a fork starts from."""
    if (method, path) == ("POST", "/v1/conversations"):
        return {"json": {"title": "from the table"}}
    if (method, path) == ("PATCH", "/v1/conversations/{id}"):
        return {"json": {"title": "renamed by the table"}}
    if (method, path) == ("POST", "/v1/conversations/{id}/runs"):
        return {"json": {"content": "table turn", "params": FAST, "on_busy": "interrupt"},
                "headers": {"Idempotency-Key": f"table-{uuid.uuid4()}"}}
    if (method, path) == ("GET", "/v1/runs/{id}/wait"):
        return {"params": {"timeout": "0"}}
    if (method, path) == ("GET", "/v1/search"):
        return {"params": {"q": "secret"}}
    if (method, path) == ("POST", "/v1/runs/{id}/approvals/{call_id}"):
        return {"json": {"decision": "approve"}}
    if (method, path) == ("POST", "/v1/conversations/{id}/fork"):
        return {"json": {"message_id": message_id or str(uuid.uuid4())}}
    return {}


def last_if_delete(operation: tuple[str, str]) -> tuple[bool, str, str]:
    """Sort key running DELETE last: after it, the conversation is gone for the others."""
    return (operation[0] == "DELETE", *operation)


def fill(path: str, conversation_id: str, run_id: str, device_id: str | None = None) -> str:
    if path.startswith("/v1/devices/"):
        return path.replace("{id}", device_id or conversation_id)
    path = path.replace("{call_id}", "call_from_the_table")
    return path.replace("{id}", run_id if path.startswith("/v1/runs/") else conversation_id)


# -- the document ---------------------------------------------------------------------------


async def test_openapi_is_valid_3_2_and_documents_exactly_the_routes_served(api: Api):
    response = await api.a.get("/openapi.json")
    assert response.status_code == 200
    spec = assert_json(response)
    assert spec["openapi"] == "3.2.0"  # 3.2: `itemSchema` describes each event of a stream
    schemathesis.openapi.from_dict(spec).validate()  # the OpenAPI 3.2 meta-schema

    runtime = Runtime(Settings(), pool=None, hub=None, worker_id="spec", providers=None)
    served = {(route.method, route.resource.canonical)
              for route in build_app(runtime).router.routes() if route.method != "HEAD"}
    documented = {(method, path) for method, path in await spec_operations(api.a)}
    assert served == documented, (f"served, not documented: {served - documented}; "
                                  f"documented, not served: {documented - served}")
    assert documented == SUCCESS_TESTED, f"without a success test: {documented - SUCCESS_TESTED}"
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            if method not in METHODS:
                continue
            if path.startswith("/v1/"):
                assert "401" in operation["responses"], f"{method} {path} lacks its 401"
            if (method.upper(), path) in UNAUTHENTICATED:
                assert operation["security"] == [], f"{method} {path} needs no bearer"
            if "{id}" in path:
                assert "404" in operation["responses"], f"{method} {path} lacks its 404"


async def test_health_readiness_and_prometheus_metrics(api: Api):
    health = await api.a.get("/healthz")
    assert health.status_code == 200
    assert assert_json(health) == {"status": "ok", "worker_id": api.daemon.worker_id}

    ready = await api.a.get("/readyz")
    assert ready.status_code == 200
    body = assert_json(ready)
    assert body["status"] == "ready" and body["database"] is True and body["hub"] is True
    assert body["draining"] is False

    conversation = await create_conversation(api.a)
    running = await start_run(api.a, conversation, "long", SLOW)
    await wait_run(api.a, running["run_id"], ("running",))
    await start_run(api.a, conversation, "behind it")  # queued behind the conversation's lease
    metrics = await read_metrics(api.a)
    assert metrics["agentd_runs_running"] == 1 and metrics["agentd_runs_queued"] == 1, metrics
    assert metrics["agentd_hub_connected"] == 1 and metrics["agentd_claimed_total"] >= 1
    assert metrics["agentd_in_flight"] == 1

    assert (await api.a.post(f"/v1/conversations/{conversation}/stop")).status_code == 202

    async def drained() -> dict[str, float] | None:
        now = await read_metrics(api.a)
        idle = now["agentd_runs_running"] == 0 and now["agentd_runs_queued"] == 0
        return now if idle else None

    await poll_until(drained, WAIT_S, interval=0.05, what="the queue gauges to reach 0")


async def read_metrics(client: httpx.AsyncClient) -> dict[str, float]:
    """Scrape /metrics and parse it with prometheus-client's own parser: sample name (with its
    labels, `name{k="v"}`) -> value. Every family has its HELP text."""
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain"), response.headers
    samples: dict[str, float] = {}
    families = list(text_string_to_metric_families(response.text))
    for family in families:
        assert family.documentation, f"{family.name} has no HELP"
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    types = {f.name: f.type for f in families}
    assert types["agentd_event_loop_lag_seconds"] == "histogram", types
    assert types["agentd_pool_wait_seconds"] == "histogram", types
    for name in ("agentd_runs_queued", "agentd_runs_running", "agentd_leases_expired",
                 "agentd_in_flight", "agentd_claimed_total", "agentd_hub_connected",
                 "agentd_heartbeats_total", "agentd_event_loop_lag_seconds_count"):
        assert name in samples, f"{name} missing from /metrics"
    return samples


# -- success shapes ---------------------------------------------------------------------------


async def test_conversation_endpoints_answer_their_documented_shapes(api: Api):
    me = await api.a.get("/v1/me")
    assert me.status_code == 200
    who = assert_json(me)
    assert who["account"] == "alice" and who["device"] == "laptop"
    assert assert_uuid(who["device_id"]) == api.device_a
    assert_uuid(who["account_id"])

    created = await api.a.post("/v1/conversations", json={"title": "  first  "})
    assert created.status_code == 201
    conversation = assert_json(created)
    assert set(conversation) == {"id", "title", "model", "archived_at", "created_at",
                                 "updated_at"}
    assert conversation["model"] is None and conversation["archived_at"] is None
    conversation_id = str(assert_uuid(conversation["id"]))
    assert conversation["title"] == "first"
    assert_time(conversation["created_at"])
    assert_time(conversation["updated_at"])
    assert created.headers["Location"] == f"/v1/conversations/{conversation_id}"
    untitled = await api.a.post("/v1/conversations")  # the body is optional
    assert untitled.status_code == 201 and untitled.json()["title"] == ""

    listed = await api.a.get("/v1/conversations", params={"limit": 10})
    assert listed.status_code == 200
    items = assert_json(listed)["conversations"]
    assert {item["id"] for item in items} == {conversation_id, untitled.json()["id"]}
    first_only = await api.a.get("/v1/conversations", params={"limit": 1})
    assert len(first_only.json()["conversations"]) == 1
    assert (await api.b.get("/v1/conversations")).json() == {"conversations": [], "next": None}

    renamed = await api.a.patch(f"/v1/conversations/{conversation_id}",
                                json={"title": "second"})
    assert renamed.status_code == 200
    assert assert_json(renamed)["title"] == "second"

    turn = await start_run(api.a, conversation_id, "a secret question")
    await wait_run(api.a, turn["run_id"])
    state = await api.a.get(f"/v1/conversations/{conversation_id}")
    assert state.status_code == 200
    body = assert_json(state)
    assert {"id", "title", "messages", "runs", "lease", "attached"} <= set(body), body
    assert body["id"] == conversation_id and body["title"] == "second"
    assert body["runs"] == [] and body["lease"] is None and body["attached"] == []
    assert [m["role"] for m in body["messages"]] == ["user", "assistant"]
    for message in body["messages"]:
        assert_message(message)
        assert message["run_id"] == turn["run_id"] and message["status"] == "complete"
    assert body["messages"][0]["content"] == "a secret question"

    export = await api.a.get(f"/v1/conversations/{conversation_id}/export")
    assert export.status_code == 200
    assert export.headers["content-type"].startswith("text/markdown")
    assert export.text.startswith("# second") and "a secret question" in export.text

    found = await api.a.get("/v1/search", params={"q": "secret"})
    assert found.status_code == 200
    results = assert_json(found)["results"]
    assert [r["message_id"] for r in results] == [body["messages"][0]["id"]]
    assert results[0]["conversation_id"] == conversation_id
    assert (results[0]["content"], results[0]["truncated"]) == ("a secret question", False)
    assert_time(results[0]["created_at"])
    assert (await api.b.get("/v1/search", params={"q": "secret"})).json() == {"results": []}
    # A conversation with no message yet is found by its title (it never was before).
    empty = assert_json(await api.a.post("/v1/conversations", json={"title": "Quarterly plan"}))
    [hit] = assert_json(await api.a.get("/v1/search", params={"q": "quarterly"}))["results"]
    assert (hit["conversation_id"], hit["message_id"], hit["role"], hit["content"]) == (
        empty["id"], None, None, "")
    assert_time(hit["created_at"])


async def test_run_endpoints_answer_their_documented_shapes(api: Api):
    conversation_id = await create_conversation(api.a)
    response = await api.a.post(f"/v1/conversations/{conversation_id}/runs",
                                json={"content": "hello", "params": {"tokens": 5,
                                                                     "delay_ms": 0}})
    assert response.status_code == 202
    created = assert_json(response)
    assert set(created) == {"run_id", "status", "conversation_id"}, created
    run_id = str(assert_uuid(created["run_id"]))
    # An idle daemon claims the turn in the enqueue's own commit: it answers "running" then.
    assert created["conversation_id"] == conversation_id
    assert created["status"] in ("queued", "running")
    assert response.headers["Location"] == f"/v1/runs/{run_id}"

    got = await api.a.get(f"/v1/runs/{run_id}")
    assert got.status_code == 200
    assert_run(assert_json(got))

    waited = await api.a.get(f"/v1/runs/{run_id}/wait", params={"timeout": "30"})
    assert waited.status_code == 200
    run = assert_json(waited)
    assert_run(run)
    assert run["status"] == "completed" and run["error"] is None
    assert run["id"] == run_id and run["conversation_id"] == conversation_id
    assert run["worker_id"] == api.daemon.worker_id and run["device_id"] == str(api.device_a)
    assert run["model"] == "demo" and run["usage"]["output_tokens"] == 5
    assert_time(run["started_at"])
    assert_time(run["finished_at"])
    assert run["lease_expires_at"] is None  # only a running run shows its lease

    events = await read_sse(api.a, f"/v1/runs/{run_id}/events")
    assert [e.id for e in events] == [str(n) for n in range(1, len(events) + 1)]
    for event in events:
        assert event.data["type"] == event.event and event.data["seq"] == int(event.id)
    assert events[0].event == "user_message" and events[-1].event == "complete"
    assert {"run_queued", "run_started", "content_delta"} <= {e.event for e in events}
    complete = events[-1].data
    assert complete["status"] == "completed" and complete["error"] is None
    answer = "".join(e.data["delta"] for e in events if e.event == "content_delta")
    state = (await api.a.get(f"/v1/conversations/{conversation_id}")).json()
    assistant = state["messages"][-1]
    assert assistant["id"] == complete["message_id"] and assistant["content"] == answer
    assert len(answer.split()) == 5

    middle = len(events) // 2
    resumed = await read_sse(api.a, f"/v1/runs/{run_id}/events", params={"from": middle})
    assert [e.id for e in resumed] == [e.id for e in events[middle:]]
    by_header = await read_sse(api.a, f"/v1/runs/{run_id}/events",
                               headers={"Last-Event-ID": str(middle)})
    assert [e.id for e in by_header] == [e.id for e in events[middle:]]
    # A client reconnecting as EventSource does: the URL it opened (from=0) and the id it last
    # read. The header is the later position: the events before it are not sent again.
    reconnected = await read_sse(api.a, f"/v1/runs/{run_id}/events", params={"from": 0},
                                 headers={"Last-Event-ID": str(middle)})
    assert [e.id for e in reconnected] == [e.id for e in events[middle:]]

    quick = await api.a.get(f"/v1/runs/{run_id}/wait", params={"timeout": "0"})
    assert quick.status_code == 200 and quick.json()["status"] == "completed"


async def test_a_feed_reconnecting_with_last_event_id_resumes_from_it(api: Api):
    """EventSource reconnects to the URL it opened, ?cursor= and all, with the id it read last
    in Last-Event-ID: that later position wins (the query's older cursor replayed events)."""
    conversation_id = await create_conversation(api.a)
    path = f"/v1/conversations/{conversation_id}/events"
    async with api.a.stream("GET", path) as stream:
        snapshot = await anext(iter_sse(stream))
    # The query's cursor is refused on its own (400 invalid_cursor): the header is read.
    async with api.a.stream("GET", path, params={"cursor": "not-a-cursor"},
                            headers={"Last-Event-ID": snapshot.id}) as resumed:
        assert resumed.status_code == 200
        assert (await anext(iter_sse(resumed))).event == "snapshot"


async def test_conversation_stream_starts_with_a_snapshot_and_shows_presence(api: Api):
    conversation_id = await create_conversation(api.a)
    path = f"/v1/conversations/{conversation_id}/events"
    async with api.a.stream("GET", path) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        frames = iter_sse(stream)
        snapshot = await anext(frames)
        assert snapshot.event == "snapshot" and snapshot.id
        state = snapshot.data["conversation"]
        assert {"id", "title", "messages", "runs", "lease", "attached"} <= set(state)
        assert state["id"] == conversation_id

        async def attached() -> list[Any] | None:
            body = (await api.a.get(f"/v1/conversations/{conversation_id}")).json()
            return body["attached"] or None

        shown = await poll_until(attached, WAIT_S, what="the streaming device to be attached")
        assert [a["device"] for a in shown] == ["laptop"]
        assert shown[0]["device_id"] == str(api.device_a)
        assert_time(shown[0]["since"])

        turn = await start_run(api.a, conversation_id, "streamed")
        seen = []
        async for frame in frames:
            assert frame.id, frame
            if frame.data.get("run_id") == turn["run_id"]:
                seen.append(frame)
                if frame.event == "complete":
                    break
        assert seen[-1].data["status"] == "completed"
        assert "content_delta" in {f.event for f in seen}

    async def detached() -> bool:
        body = (await api.a.get(f"/v1/conversations/{conversation_id}")).json()
        return body["attached"] == []

    await poll_until(detached, WAIT_S, what="the device to detach after its stream closed")


async def test_cancel_and_stop_answer_202_with_drafts(api: Api):
    conversation_id = await create_conversation(api.a)
    running = await start_run(api.a, conversation_id, "long", SLOW)
    await wait_run(api.a, running["run_id"], ("running",))
    queued = await start_run(api.a, conversation_id, "please keep my words")
    behind = await start_run(api.a, conversation_id, "and these")

    state = (await api.a.get(f"/v1/conversations/{conversation_id}")).json()
    assert [r["id"] for r in state["runs"]] == [running["run_id"], queued["run_id"],
                                                behind["run_id"]]
    for run in state["runs"]:
        assert_run(run)
    lease = state["lease"]
    assert lease["run_id"] == running["run_id"] and lease["device"] == "laptop"
    assert lease["worker_id"] == api.daemon.worker_id
    assert_time(lease["expires_at"])

    # Only while queued: the running turn, picked as if it were still queued, is left alone
    # (a client dropping a queued turn that has just started must not stop the answer).
    left = await api.a.post(f"/v1/runs/{running['run_id']}/cancel?only=queued")
    assert left.status_code == 202 and assert_json(left)["flagged"] == []
    assert assert_json(left)["cancelled"] == []
    assert (await api.a.get(f"/v1/runs/{running['run_id']}")).json()["cancel_requested"] \
        is False
    assert_error(await api.a.post(f"/v1/runs/{running['run_id']}/cancel?only=running"), 400,
                 "invalid_query")
    cancelled = await api.a.post(f"/v1/runs/{queued['run_id']}/cancel?only=queued")
    assert cancelled.status_code == 202
    body = assert_json(cancelled)
    assert body["cancelled"] == [queued["run_id"]] and body["flagged"] == []
    [draft] = body["drafts"]
    assert draft["run_id"] == queued["run_id"] and draft["content"] == "please keep my words"
    assert_uuid(draft["message_id"])

    stopped = await api.a.post(f"/v1/conversations/{conversation_id}/stop")
    assert stopped.status_code == 202
    body = assert_json(stopped)
    assert body["cancelled"] == [behind["run_id"]] and body["flagged"] == [running["run_id"]]
    assert [d["content"] for d in body["drafts"]] == ["and these"]
    final = await wait_run(api.a, running["run_id"])
    assert final["status"] == "cancelled"
    events = await read_sse(api.a, f"/v1/runs/{running['run_id']}/events")
    assert events[-1].event == "complete" and events[-1].data["status"] == "cancelled"


# -- 401 --------------------------------------------------------------------------------------


async def test_every_v1_endpoint_answers_401_without_a_valid_token(api: Api):
    conversation_id = await create_conversation(api.a)
    turn = await start_run(api.a, conversation_id, "hello")
    await wait_run(api.a, turn["run_id"])
    revoked, device = await create_device_token(api.pool, account="alice", device="old phone")
    async with api.client(revoked) as client:
        assert (await client.get("/v1/me")).status_code == 200  # valid until revoked
    assert await revoke_device(api.pool, device)
    before = await db_state(api.pool)

    operations = sorted(op for op in await spec_operations(api.a)
                        if op[1].startswith("/v1/") and op not in UNAUTHENTICATED)
    assert len(operations) >= 10, operations
    credentials: dict[str, str | bytes | None] = {
        "no header": None, "empty bearer": "Bearer", "basic": "Basic YTpi",
        "garbage token": "Bearer agd_not-a-token", "oversized": "Bearer " + "x" * 600,
        "undecodable token": b"Bearer agd_\xff\xfe", "revoked token": f"Bearer {revoked}"}
    async with api.client() as anonymous:
        for method, template in operations:
            path = fill(template, conversation_id, turn["run_id"])
            for label, header in credentials.items():
                headers = {"Authorization": header} if header else {}
                kwargs = valid_request(method, template, str(uuid.uuid4()))
                kwargs["headers"] = {**kwargs.get("headers", {}), **headers}
                response = await fetch(anonymous, method, path, **kwargs)
                assert_error(response, 401, "unauthorized")
                assert response.headers["WWW-Authenticate"].startswith("Bearer"), \
                    f"{method} {path} ({label})"
    assert await db_state(api.pool) == before, "an unauthenticated call changed the database"


# -- 404: tenancy ------------------------------------------------------------------------------


async def test_other_accounts_ids_are_404_on_every_endpoint_and_change_nothing(api: Api):
    conversation_id = await create_conversation(api.a, "alice's")
    done = await start_run(api.a, conversation_id, "secret finished turn")
    await wait_run(api.a, done["run_id"])
    answered = (await api.a.get(f"/v1/conversations/{conversation_id}")).json()["messages"][-1]
    running = await start_run(api.a, conversation_id, "secret long turn", SLOW)
    await wait_run(api.a, running["run_id"], ("running",))
    queued = await start_run(api.a, conversation_id, "secret queued turn")
    targets = {"running": running["run_id"], "queued": queued["run_id"],
               "missing": str(uuid.uuid4()), "not a uuid": "not-a-uuid"}
    _, spare = await create_device_token(api.pool, account="alice", device="spare")
    devices = {"running": str(spare), "queued": str(api.device_a),
               "missing": targets["missing"], "not a uuid": "not-a-uuid"}

    operations = sorted(await spec_operations(api.a))
    with_id = [op for op in operations if "{id}" in op[1]]
    assert {path for _, path in with_id} >= {
        "/v1/conversations/{id}", "/v1/conversations/{id}/runs", "/v1/conversations/{id}/stop",
        "/v1/conversations/{id}/events", "/v1/runs/{id}", "/v1/runs/{id}/wait",
        "/v1/runs/{id}/cancel", "/v1/runs/{id}/events"}

    before = await db_state(api.pool)
    tried = 0
    for method, template in with_id:
        for label, run_id in targets.items():
            other_conversation = {"running": conversation_id, "queued": conversation_id,
                                  "missing": targets["missing"], "not a uuid": "not-a-uuid"}
            path = fill(template, other_conversation[label], run_id, devices[label])
            response = await fetch(api.b, method, path,
                                   **valid_request(method, template, answered["id"]))
            assert_error(response, 404, "not_found")
            tried += 1
    assert tried == len(with_id) * len(targets)
    assert await db_state(api.pool) == before, "a stranger's request changed the database"
    assert (await api.b.get("/v1/search", params={"q": "secret"})).json() == {"results": []}
    run = (await api.a.get(f"/v1/runs/{running['run_id']}")).json()
    assert run["status"] == "running" and run["cancel_requested"] is False

    # The same requests with the owner's token succeed: the 404s were about ownership alone.
    for method, template in sorted(with_id, key=last_if_delete):
        path = fill(template, conversation_id, queued["run_id"], str(spare))
        response = await fetch(api.a, method, path,
                               **valid_request(method, template, answered["id"]))
        if (method, template) in NEEDS_PENDING_APPROVAL:
            assert_error(response, 404, "approval_not_found")  # the run is the owner's
            continue
        assert response.status_code < 300, f"{method} {path}: {response.status_code}"


# -- 400 / 413 / 422 / 409 ---------------------------------------------------------------------


def deep(levels: int) -> bytes:
    return b'{"content": ' + b"[" * levels + b"]" * levels + b"}"


def raw(body: bytes) -> dict[str, Any]:
    return {"content": body, "headers": {"Content-Type": "application/json"}}


RUNS = "/v1/conversations/{cid}/runs"
BAD_INPUT: list[tuple[str, str, str, dict[str, Any], int, str | None]] = [
    # (what, method, path, request, status, error code)
    ("malformed JSON", "POST", "/v1/conversations", raw(b'{"title": '), 400, "invalid_json"),
    ("not UTF-8", "POST", "/v1/conversations", raw(b'{"title": "\xff"}'), 400, "invalid_json"),
    ("array body", "POST", "/v1/conversations", {"json": []}, 400, "invalid_body"),
    ("title of wrong type", "POST", "/v1/conversations", {"json": {"title": 5}}, 400,
     "invalid_title"),
    ("title too long", "POST", "/v1/conversations", {"json": {"title": "t" * 501}}, 400,
     "invalid_title"),
    ("unknown field", "POST", "/v1/conversations", {"json": {"name": "x"}}, 400,
     "invalid_body"),
    ("lone surrogate", "POST", "/v1/conversations", raw(b'{"title": "\\ud800"}'), 400,
     "invalid_json"),
    ("NUL in title", "POST", "/v1/conversations", raw(b'{"title": "a\\u0000b"}'), 400, None),
    ("nesting too deep", "POST", "/v1/conversations", raw(deep(100_000)), 400,
     "json_too_deep"),
    ("body over 1 MiB", "POST", "/v1/conversations",
     {"json": {"title": "t" * MAX_BODY_BYTES}}, 413, "payload_too_large"),
    ("rename: body over 1 MiB", "PATCH", "/v1/conversations/{cid}",
     {"json": {"title": "t" * MAX_BODY_BYTES}}, 413, "payload_too_large"),
    ("rename without body", "PATCH", "/v1/conversations/{cid}", {}, 400, "invalid_body"),
    ("rename to null", "PATCH", "/v1/conversations/{cid}", {"json": {"title": None}}, 400,
     "invalid_title"),
    ("limit 0", "GET", "/v1/conversations?limit=0", {}, 400, "invalid_limit"),
    ("limit not a number", "GET", "/v1/conversations?limit=ten", {}, 400, "invalid_limit"),
    ("limit too big", "GET", "/v1/conversations?limit=1001", {}, 400, "invalid_limit"),
    ("search without q", "GET", "/v1/search", {}, 400, "invalid_query"),
    ("search for NUL", "GET", "/v1/search?q=%00", {}, 400, "invalid_query"),
    ("search too long", "GET", "/v1/search?q=" + "q" * 201, {}, 400, "invalid_query"),
    ("run: malformed JSON", "POST", RUNS, raw(b'{"content": "x"'), 400, "invalid_json"),
    ("run: empty body", "POST", RUNS, raw(b""), 400, "invalid_body"),
    ("run: array body", "POST", RUNS, {"json": ["x"]}, 400, "invalid_body"),
    ("run: content of wrong type", "POST", RUNS, {"json": {"content": 5}}, 400,
     "invalid_content"),
    ("run: blank content", "POST", RUNS, {"json": {"content": "  "}}, 400, "invalid_content"),
    ("run: no content", "POST", RUNS, {"json": {"params": FAST}}, 400, "invalid_content"),
    ("run: unknown field", "POST", RUNS, {"json": {"content": "x", "stream": True}}, 400,
     "unknown_field"),
    ("run: unknown provider", "POST", RUNS, {"json": {"content": "x", "model": "nope:gpt"}},
     422, "unknown_model"),
    ("run: provider without model", "POST", RUNS,
     {"json": {"content": "x", "model": "openai"}}, 422, "unknown_model"),
    ("run: model the provider does not offer", "POST", RUNS,
     {"json": {"content": "x", "model": "demo:nonsense"}}, 422, "unknown_model"),
    ("run: model without its API key", "POST", RUNS,
     {"json": {"content": "x", "model": "openai:gpt-4o"}}, 422, "model_unavailable"),
    ("run: model name over 200 characters", "POST", RUNS,
     {"json": {"content": "x", "model": "openai:" + "m" * 194}}, 422, "invalid_model"),
    ("run: blank model", "POST", RUNS, {"json": {"content": "x", "model": " "}}, 422,
     "unknown_model"),
    ("run: model of wrong type", "POST", RUNS, {"json": {"content": "x", "model": 7}}, 400,
     "invalid_model"),
    ("run: retry_of not a message id", "POST", RUNS,
     {"json": {"retry_of": "first", "params": FAST}}, 400, "invalid_retry_of"),
    ("run: retry_of of wrong type", "POST", RUNS, {"json": {"retry_of": 3}}, 400,
     "invalid_retry_of"),
    ("run: retry_of an unknown message", "POST", RUNS,
     {"json": {"retry_of": str(uuid.uuid4())}}, 404, "not_found"),
    ("run: edit to blank content", "POST", RUNS,
     {"json": {"retry_of": "last", "content": " "}}, 400, "invalid_content"),
    ("create: unknown model", "POST", "/v1/conversations", {"json": {"model": "nope:x"}}, 422,
     "unknown_model"),
    ("create: model over 200 characters", "POST", "/v1/conversations",
     {"json": {"model": "m" * 201}}, 422, "invalid_model"),
    ("update: empty object", "PATCH", "/v1/conversations/{cid}", {"json": {}}, 400,
     "invalid_body"),
    ("update: unknown field", "PATCH", "/v1/conversations/{cid}", {"json": {"pinned": True}},
     400, "invalid_body"),
    ("update: archived not a boolean", "PATCH", "/v1/conversations/{cid}",
     {"json": {"archived": "yes"}}, 400, "invalid_archived"),
    ("update: unknown model", "PATCH", "/v1/conversations/{cid}",
     {"json": {"model": "demo:other"}}, 422, "unknown_model"),
    ("update: unusable model", "PATCH", "/v1/conversations/{cid}",
     {"json": {"model": "anthropic:claude-sonnet-4-0"}}, 422, "model_unavailable"),
    ("update: model over 200 characters", "PATCH", "/v1/conversations/{cid}",
     {"json": {"model": "x" * 201}}, 422, "invalid_model"),
    ("update: model of wrong type", "PATCH", "/v1/conversations/{cid}",
     {"json": {"model": ["demo"]}}, 400, "invalid_model"),
    ("list: archived not a boolean", "GET", "/v1/conversations?archived=maybe", {}, 400,
     "invalid_archived"),
    ("fork: no body", "POST", "/v1/conversations/{cid}/fork", {}, 400, "invalid_body"),
    ("fork: no message_id", "POST", "/v1/conversations/{cid}/fork", {"json": {}}, 400,
     "invalid_body"),
    ("fork: extra field", "POST", "/v1/conversations/{cid}/fork",
     {"json": {"message_id": str(uuid.uuid4()), "title": "x"}}, 400, "invalid_body"),
    ("fork: message_id not an id", "POST", "/v1/conversations/{cid}/fork",
     {"json": {"message_id": "the last one"}}, 400, "invalid_message_id"),
    ("fork: unknown message", "POST", "/v1/conversations/{cid}/fork",
     {"json": {"message_id": str(uuid.uuid4())}}, 404, "not_found"),
    ("run: params not an object", "POST", RUNS, {"json": {"content": "x", "params": [1]}}, 400,
     "invalid_params"),
    ("run: bad on_busy", "POST", RUNS, {"json": {"content": "x", "on_busy": "sometimes"}},
     400, "invalid_on_busy"),
    ("run: NaN", "POST", RUNS, raw(b'{"content": "x", "params": {"tokens": NaN}}'), 400,
     "invalid_json"),
    ("run: float overflow", "POST", RUNS, raw(b'{"content": "x", "params": {"t": 1e999}}'),
     400, "invalid_json"),
    ("run: lone surrogate", "POST", RUNS, raw(b'{"content": "\\udc00"}'), 400, "invalid_json"),
    ("run: NUL in content", "POST", RUNS, raw(b'{"content": "a\\u0000"}'), 400, None),
    ("run: NUL in a params key", "POST", RUNS,
     raw(b'{"content": "x", "model": "openai:gpt-4o", "params": {"\\u0000": 1}}'), 400, None),
    ("run: nesting too deep", "POST", RUNS, raw(deep(100_000)), 400, "json_too_deep"),
    ("run: bad Idempotency-Key", "POST", RUNS,
     {"json": {"content": "x", "params": FAST}, "headers": {"Idempotency-Key": "has space"}},
     400, "invalid_idempotency_key"),
    ("run: Idempotency-Key too long", "POST", RUNS,
     {"json": {"content": "x", "params": FAST}, "headers": {"Idempotency-Key": "k" * 201}},
     400, "invalid_idempotency_key"),
    ("run: body over the limit", "POST", RUNS, {"json": {"content": "x" * BODY_OVER}}, 413,
     "payload_too_large"),
    ("run: content over the default max", "POST", RUNS, {"json": {"content": "x" * 100_001}},
     413, "content_too_large"),
    ("demo: negative tokens", "POST", RUNS,
     {"json": {"content": "x", "params": {"tokens": -1}}}, 422, "invalid_params"),
    ("demo: tokens as string", "POST", RUNS,
     {"json": {"content": "x", "params": {"tokens": "3"}}}, 422, "invalid_params"),
    ("demo: tokens as bool", "POST", RUNS,
     {"json": {"content": "x", "params": {"tokens": True}}}, 422, "invalid_params"),
    ("demo: unknown param", "POST", RUNS,
     {"json": {"content": "x", "params": {"temperature": 1}}}, 422, "invalid_params"),
    ("demo: unknown tool", "POST", RUNS,
     {"json": {"content": "x", "params": {"tool": "rm -rf"}}}, 422, "invalid_params"),
    ("demo: fractional fail", "POST", RUNS,
     {"json": {"content": "x", "params": {"fail": 1.5}}}, 422, "invalid_params"),
    ("wait: negative timeout", "GET", "/v1/runs/{rid}/wait?timeout=-1", {}, 400,
     "invalid_timeout"),
    ("wait: timeout not a number", "GET", "/v1/runs/{rid}/wait?timeout=soon", {}, 400,
     "invalid_timeout"),
    ("wait: timeout too long", "GET", "/v1/runs/{rid}/wait?timeout=301", {}, 400,
     "invalid_timeout"),
    ("wait: NaN timeout", "GET", "/v1/runs/{rid}/wait?timeout=nan", {}, 400,
     "invalid_timeout"),
    ("events: negative from", "GET", "/v1/runs/{rid}/events?from=-1", {}, 400,
     "invalid_from"),
    ("events: from not a number", "GET", "/v1/runs/{rid}/events?from=x", {}, 400,
     "invalid_from"),
    ("events: from beyond bigint", "GET", f"/v1/runs/{{rid}}/events?from={2**63}", {}, 400,
     "invalid_from"),
    ("events: bad Last-Event-ID", "GET", "/v1/runs/{rid}/events",
     {"headers": {"Last-Event-ID": "seven"}}, 400, "invalid_last_event_id"),
    ("events: Last-Event-ID beyond bigint", "GET", "/v1/runs/{rid}/events",
     {"headers": {"Last-Event-ID": str(2**70)}}, 400, "invalid_last_event_id"),
    ("feed: garbage cursor", "GET", "/v1/conversations/{cid}/events?cursor=zzz", {}, 400,
     "invalid_cursor"),
    ("feed: garbage Last-Event-ID", "GET", "/v1/conversations/{cid}/events",
     {"headers": {"Last-Event-ID": "e30"}}, 400, "invalid_cursor"),
    ("feed: cursor seq beyond bigint", "GET", "/v1/conversations/{cid}/events",
     {"cursor": {"w": ["2020-01-01T00:00:00+00:00", str(uuid.UUID(int=0))],
                 "o": {"{rid}": 10**30}}}, 400, "invalid_cursor"),
    # json.dumps writes Infinity, which Python's json (and so the cursor's decoding) reads.
    ("feed: cursor seq Infinity", "GET", "/v1/conversations/{cid}/events",
     {"cursor": {"w": ["2020-01-01T00:00:00+00:00", str(uuid.UUID(int=0))],
                 "o": {"{rid}": float("inf")}}}, 400, "invalid_cursor"),
    ("feed: cursor seq fractional", "GET", "/v1/conversations/{cid}/events",
     {"cursor": {"w": ["2020-01-01T00:00:00+00:00", str(uuid.UUID(int=0))],
                 "o": {"{rid}": 1.5}}}, 400, "invalid_cursor"),
    # JSON nested deeper than the decoder recurses: was a 500 with a traceback in the log.
    ("feed: cursor nested too deep", "GET", "/v1/conversations/{cid}/events",
     {"headers": {"Last-Event-ID": base64.urlsafe_b64encode(b"[" * 2000).decode()}}, 400,
     "invalid_cursor"),
    ("feed: cursor time out of range", "GET", "/v1/conversations/{cid}/events",
     {"cursor": {"w": ["0001-01-01T00:00:00+14:00", str(uuid.UUID(int=0))], "o": {}}}, 400,
     "invalid_cursor"),
    ("unknown route", "GET", "/v1/nothing-here", {}, 404, "not_found"),
    ("unknown route outside /v1", "GET", "/nothing-here", {}, 404, "not_found"),
    ("wrong method", "PUT", "/v1/conversations/{cid}", {}, 405, "method_not_allowed"),
]


def encode_cursor(cursor: dict[str, Any], run_id: str) -> str:
    text = json.dumps(cursor).replace("{rid}", run_id)
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


async def test_bad_input_is_a_json_4xx_that_writes_nothing(api: Api):
    conversation_id = await create_conversation(api.a)
    turn = await start_run(api.a, conversation_id, "hello")
    await wait_run(api.a, turn["run_id"])
    spec = (await api.a.get("/openapi.json")).json()
    before = await db_state(api.pool)
    failures = []
    for what, method, template, request, status, code in BAD_INPUT:
        operation = spec["paths"].get(
            template.split("?")[0].replace("{cid}", "{id}").replace("{rid}", "{id}"), {}
        ).get(method.lower())
        if operation is not None and str(status) not in operation["responses"]:
            failures.append(f"{what}: {status} is not documented for {method} {template}")
        path = template.replace("{cid}", conversation_id).replace("{rid}", turn["run_id"])
        request = dict(request)
        if "cursor" in request:
            request["params"] = {"cursor": encode_cursor(request.pop("cursor"),
                                                         turn["run_id"])}
        response = await fetch(api.a, method, path, **request)
        try:
            assert_error(response, status, code)
        except AssertionError as exc:
            failures.append(f"{what}: {exc}")
    assert not failures, "\n".join(failures)
    assert await db_state(api.pool) == before, "a rejected request changed the database"
    assert (await api.a.get("/readyz")).status_code == 200


async def test_a_post_of_max_content_chars_fits_however_its_json_spells_them(api: Api):
    """100,000 characters outside the BMP, as a JSON encoder that escapes them sends them
    (twelve bytes each): 1.2 MB, within max_content_chars. The body cap was a fixed 1 MiB, and
    such a post was refused with a bare 413 `payload_too_large`."""
    conversation_id = await create_conversation(api.a)
    content = "\U0001F600" * Settings().max_content_chars
    posted = await api.a.post(f"/v1/conversations/{conversation_id}/runs",
                              content=json.dumps({"content": content, "params": FAST}),
                              headers={"Content-Type": "application/json"})
    assert posted.status_code == 202, posted.text[:500]
    done = await wait_run(api.a, posted.json()["run_id"])
    assert done["status"] == "completed"


async def test_a_chunked_body_is_read_no_further_than_its_limit(api: Api):
    """A body whose length is not said first (chunked) is refused once past its route's limit
    (1 MiB for a title); one within it is read as any other."""
    async def chunks(body: bytes):
        for start in range(0, len(body), 1 << 16):
            yield body[start:start + (1 << 16)]

    big = json.dumps({"title": "t" * MAX_BODY_BYTES}).encode()
    over = await api.a.post("/v1/conversations", content=chunks(big),
                            headers={"Content-Type": "application/json"})
    assert_error(over, 413, "payload_too_large")
    small = json.dumps({"title": "chunked"}).encode()
    made = await api.a.post("/v1/conversations", content=chunks(small),
                            headers={"Content-Type": "application/json"})
    assert made.status_code == 201 and made.json()["title"] == "chunked", made.text


async def test_content_longer_than_the_configured_max_is_413(spawn_daemon, pool):
    async with started_api(spawn_daemon, pool, max_content_chars=1000) as api:
        conversation_id = await create_conversation(api.a)
        too_long = await api.a.post(f"/v1/conversations/{conversation_id}/runs",
                                    json={"content": "x" * 1001, "params": FAST})
        error = assert_error(too_long, 413, "content_too_large")
        assert "1000" in error["message"]
        assert await pool.fetchval("SELECT count(*) FROM agent_run") == 0
        at_limit = await start_run(api.a, conversation_id, "x" * 1000)
        assert (await wait_run(api.a, at_limit["run_id"]))["status"] == "completed"


async def test_idempotency_key_replays_the_same_payload_and_409s_a_different_one(api: Api):
    conversation_id = await create_conversation(api.a)
    path = f"/v1/conversations/{conversation_id}/runs"
    key = {"Idempotency-Key": "script-42"}
    body = {"content": "once", "params": FAST}
    first = await api.a.post(path, json=body, headers=key)
    assert first.status_code == 202 and "Idempotent-Replayed" not in first.headers
    again = await api.a.post(path, json=body, headers=key)
    assert again.status_code == 202 and again.headers["Idempotent-Replayed"] == "true"
    assert again.json()["run_id"] == first.json()["run_id"]
    assert again.headers["Location"] == first.headers["Location"]

    for changed in ({"content": "twice", "params": FAST},
                    {"content": "once", "params": {"tokens": 4}}):
        conflict = await api.a.post(path, json=changed, headers=key)
        error = assert_error(conflict, 409, "idempotency_conflict")
        assert error["run_id"] == first.json()["run_id"]
    other = await create_conversation(api.a)
    elsewhere = await api.a.post(f"/v1/conversations/{other}/runs", json=body, headers=key)
    assert_error(elsewhere, 409, "idempotency_conflict")
    # Keys are per account: bob's identical request is his own, new run.
    bobs = await create_conversation(api.b)
    mine = await api.b.post(f"/v1/conversations/{bobs}/runs", json=body, headers=key)
    assert mine.status_code == 202 and mine.json()["run_id"] != first.json()["run_id"]
    assert await api.pool.fetchval(
        "SELECT count(*) FROM agent_run WHERE idempotency_key = 'script-42'") == 2


async def test_reject_while_busy_is_409_naming_the_owner(api: Api):
    conversation_id = await create_conversation(api.a)
    running = await start_run(api.a, conversation_id, "long", SLOW)
    await wait_run(api.a, running["run_id"], ("running",))
    busy = await api.a.post(f"/v1/conversations/{conversation_id}/runs",
                            json={"content": "now", "params": FAST, "on_busy": "reject"})
    error = assert_error(busy, 409, "conversation_busy")
    assert error["run_id"] == running["run_id"] and error["device"] == "laptop"
    assert error["worker_id"] == api.daemon.worker_id
    assert await api.pool.fetchval("SELECT count(*) FROM agent_run") == 1

    interrupt = await start_run(api.a, conversation_id, "instead", FAST, on_busy="interrupt")
    assert (await wait_run(api.a, running["run_id"]))["status"] == "cancelled"
    assert (await wait_run(api.a, interrupt["run_id"]))["status"] == "completed"
