"""The client library against a live daemon: every endpoint typed, and streams that survive
connections cut at random bytes with every event delivered exactly once."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import defaultdict
from types import SimpleNamespace

import httpcore._async.http11
import httpx
import pytest

from agentd.providers.demo import expected_answer
from agentd.vocabulary import EventType, MessageStatus, RunStatus
from agenttui.client import (
    KEEPALIVE_S,
    AgentClient,
    Conflict,
    ConnectionState,
    ConnectionStatus,
    NotFound,
    Snapshot,
    Unauthorized,
)
from agenttui.models import RunEvent
from tests.support.daemon import Daemon
from tests.support.factories import Device
from tests.tui.helpers import Chaos, client_for

WAIT_S = 60.0


async def test_every_endpoint_answers_typed_objects(daemon: Daemon, desk: Device) -> None:
    async with client_for(daemon, desk) as client:
        me = await client.me()
        assert (me.account, me.device, me.device_id) == ("team", "desk", desk.device_id)

        created = await client.create_conversation("first")
        renamed = await client.rename_conversation(created.id, "typed client")
        assert renamed.title == "typed client"
        assert [c.id for c in await client.list_conversations()] == [created.id]
        second = await client.create_conversation("second")
        page, after = await client.conversation_page(1)
        assert [c.id for c in page] == [second.id] and after is not None
        page, after = await client.conversation_page(1, after=after)
        assert [c.id for c in page] == [created.id] and after is None
        await client.delete_conversation(second.id)

        run = await client.create_run(created.id, "what is a lease?",
                                      params={"tokens": 6, "delay_ms": 0},
                                      idempotency_key="typed-1")
        again = await client.create_run(created.id, "what is a lease?",
                                        params={"tokens": 6, "delay_ms": 0},
                                        idempotency_key="typed-1")
        assert (again.run_id, again.replayed, run.replayed) == (run.run_id, True, False)
        with pytest.raises(Conflict):
            await client.create_run(created.id, "something else", idempotency_key="typed-1")

        done = await client.wait_run(run.run_id, wait_s=WAIT_S)
        assert done.status == RunStatus.COMPLETED and done.device_id == desk.device_id
        assert (await client.get_run(run.run_id)).status == RunStatus.COMPLETED
        answer = expected_answer("demo", "what is a lease?", 6)

        events = [e async for e in client.run_events(run.run_id) if isinstance(e, RunEvent)]
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        assert "".join(e.delta for e in events) == answer
        assert events[-1].type == EventType.COMPLETE

        state = await client.get_conversation(created.id)
        assert [(m.role, m.content, m.status) for m in state.messages] == [
            ("user", "what is a lease?", MessageStatus.COMPLETE),
            ("assistant", answer, MessageStatus.COMPLETE)]
        assert state.runs == () and state.lease is None

        assert answer in await client.export_conversation(created.id)
        hits = await client.search(answer.split()[0])
        assert any(h.conversation_id == created.id for h in hits)

        idle = await client.stop_conversation(created.id)
        assert (idle.cancelled, idle.flagged, idle.drafts) == ((), (), ())
        assert (await client.cancel_run(run.run_id)).flagged == ()
        assert "/v1/conversations/{id}/events" in (await client.openapi())["paths"]

        with pytest.raises(NotFound):
            await client.get_conversation("00000000-0000-0000-0000-000000000000")
    async with AgentClient(daemon.url, "agd_not-a-token", trust_env=False) as stranger:
        with pytest.raises(Unauthorized):
            await stranger.me()


async def test_a_turn_posted_after_a_pause_goes_over_the_open_connection(
        daemon: Daemon, desk: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    """People read an answer, then type: a turn posted a while after the last call reuses the
    connection already open instead of paying a new one (and over https a new handshake) in
    front of its first token. The idle time passes on the connection pool's clock only."""
    idle_s = 0.0
    real_clock = time.monotonic
    monkeypatch.setattr(httpcore._async.http11, "time",
                        SimpleNamespace(monotonic=lambda: real_clock() + idle_s))
    async with client_for(daemon, desk) as client:
        used: list[object] = []

        async def note_connection(response: httpx.Response) -> None:
            stream = response.extensions["network_stream"]
            used.append(stream.get_extra_info("client_addr"))

        client._http.event_hooks["response"].append(note_connection)
        conversation = await client.create_conversation("after a pause")
        idle_s = 30.0  # six times httpx's own keep-alive
        await client.create_run(conversation.id, "and then?", params={"tokens": 2, "delay_ms": 0})
        assert used[1] == used[0]
        # The same check sees a new connection once the pause outlasts the client's keep-alive.
        idle_s += KEEPALIVE_S + 1
        await client.list_conversations()
        assert used[2] != used[1]


async def test_conversation_stream_survives_random_disconnects_exactly_once(
        daemon: Daemon, desk: Device) -> None:
    prompts = {"first question": 120, "second question": 90}
    chaos = Chaos(seed=20261129)
    async with client_for(daemon, desk) as client, \
            client_for(daemon, desk, transport=chaos) as flaky:
        conversation = await client.create_conversation("chaos")
        runs = {}
        for prompt, tokens in prompts.items():  # the second queues behind the first
            created = await client.create_run(conversation.id, prompt,
                                              params={"tokens": tokens, "delay_ms": 8})
            runs[created.run_id] = expected_answer("demo", prompt, tokens)

        seen: dict[str, list[int]] = defaultdict(list)
        text: dict[str, str] = defaultdict(str)
        states: list[ConnectionState] = []
        resumed_snapshots = 0
        completed: set[str] = set()
        stream = flaky.conversation_events(conversation.id)
        async with asyncio.timeout(WAIT_S * 2), contextlib.aclosing(stream.__aiter__()) as items:
            async for item in items:
                if isinstance(item, ConnectionStatus):
                    states.append(item.state)
                elif isinstance(item, Snapshot):
                    resumed_snapshots += item.resumed
                elif isinstance(item, RunEvent):
                    seen[item.run_id].append(item.seq)
                    if item.type == EventType.CONTENT_DELTA:
                        text[item.run_id] += item.delta
                    if item.type == EventType.COMPLETE:
                        completed.add(item.run_id)
                        if completed >= set(runs):
                            break
        for run_id, answer in runs.items():
            assert seen[run_id] == list(range(1, len(seen[run_id]) + 1)), \
                f"run {run_id}: events repeated or missing: {seen[run_id]}"
            assert text[run_id] == answer
        assert stream.reconnects >= 3 and chaos.cuts >= 4, (stream.reconnects, chaos.cuts)
        assert ConnectionState.RECONNECTING in states and ConnectionState.RESUMED in states
        assert resumed_snapshots >= 1


async def test_run_stream_survives_random_disconnects_exactly_once(
        daemon: Daemon, desk: Device) -> None:
    chaos = Chaos(seed=7)
    async with client_for(daemon, desk) as client, \
            client_for(daemon, desk, transport=chaos) as flaky:
        conversation = await client.create_conversation("chaos run")
        created = await client.create_run(conversation.id, "stream me",
                                          params={"tokens": 150, "delay_ms": 6})
        stream = flaky.run_events(created.run_id)
        async with asyncio.timeout(WAIT_S * 2):
            events = [item async for item in stream if isinstance(item, RunEvent)]
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        assert events[-1].type == EventType.COMPLETE
        assert events[-1].payload["status"] == RunStatus.COMPLETED
        assert "".join(e.delta for e in events) == expected_answer("demo", "stream me", 150)
        assert stream.reconnects >= 2, stream.reconnects


async def test_a_plain_http_daemon_is_never_reached_through_an_environment_proxy(
        daemon: Daemon, desk: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    """With HTTP_PROXY set (common at work), the client sent its requests for the local
    daemon, bearer token and all, in clear text to the proxy (httpx's NO_PROXY=localhost does
    not cover 127.0.0.1), and could not reach the daemon through it either."""
    seen: list[bytes] = []

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.read(65536))
        writer.close()

    server = await asyncio.start_server(proxy, "127.0.0.1", 0)
    try:
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        monkeypatch.setenv("ALL_PROXY", os.environ["HTTP_PROXY"])
        async with AgentClient(daemon.url, desk.token) as client:
            assert (await client.me()).device == "desk"
    finally:
        server.close()
        await server.wait_closed()
    assert seen == [], seen


async def test_a_refused_cursor_is_said_and_the_feed_starts_over_at_once(
        daemon: Daemon, desk: Device) -> None:
    """A feed resumed from a place the server no longer serves (400 invalid_cursor) says so
    in its status, then starts over from a fresh snapshot without waiting out a backoff."""
    async with client_for(daemon, desk) as client:
        conversation = await client.create_conversation("refused cursor")
        stream = client.conversation_events(conversation.id, cursor="e30")  # no cursor of ours
        statuses: list[ConnectionStatus] = []
        async with asyncio.timeout(WAIT_S), contextlib.aclosing(stream.__aiter__()) as items:
            async for item in items:
                if isinstance(item, ConnectionStatus):
                    statuses.append(item)
                elif isinstance(item, Snapshot):
                    assert not item.resumed
                    break
        refused = [s for s in statuses if s.error and "refused" in s.error]
        assert len(refused) == 1 and refused[0].retry_in == 0.0, statuses


async def test_unicode_line_separators_cross_the_feed_inside_their_message(
        daemon: Daemon, desk: Device) -> None:
    """SSE lines end at CR or LF only: U+2028, U+2029 and U+0085 inside a message's JSON stay
    in it (httpx-sse before 0.4.2 split frames there, and the feed then reconnected forever
    on the same frame)."""
    text = "one\u2028two\u2029three\x85four"
    async with client_for(daemon, desk) as client:
        conversation = await client.create_conversation("separators")
        created = await client.create_run(conversation.id, text,
                                          params={"tokens": 2, "delay_ms": 0})
        await client.wait_run(created.run_id)
        stream = client.conversation_events(conversation.id)
        async with asyncio.timeout(WAIT_S), contextlib.aclosing(stream.__aiter__()) as items:
            async for item in items:
                if isinstance(item, Snapshot):
                    break
    assert [m.content for m in item.state.messages if m.role == "user"] == [text]
    assert stream.reconnects == 0
