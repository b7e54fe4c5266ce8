"""Accounts, conversations, devices and turns made for a test, in the database or over HTTP."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import asyncpg
import httpx

from agentd import conversations
from agentd.accounts import create_device_token, ensure_account
from agentd.providers.demo import expected_answer
from agentd.queue import Claim, ClaimBeside, EnqueuedRun, NewRun, enqueue_run, post_turn
from tests.support.daemon import Daemon
from tests.support.sse import STREAM_TIMEOUT

Db = asyncpg.Pool | asyncpg.Connection


async def new_account(db: Db, name: str | None = None) -> UUID:
    return await ensure_account(db, name or f"acct-{uuid.uuid4().hex[:10]}")


async def new_conversation(db: Db, account_id: UUID, title: str = "test") -> UUID:
    return (await conversations.create_conversation(db, account_id, title)).id


@dataclass(frozen=True, slots=True)
class Tenant:
    account_id: UUID
    conversation_id: UUID


async def new_tenant(db: Db, name: str | None = None) -> Tenant:
    """A fresh account with one conversation."""
    account_id = await new_account(db, name)
    return Tenant(account_id, await new_conversation(db, account_id))


async def enqueue(db: Db, account_id: UUID, conversation_id: UUID, content: str = "hi",
                  **kwargs: Any) -> EnqueuedRun:
    """Queue a turn as the service does (a demo turn unless `request` says otherwise)."""
    request = kwargs.pop("request", {"content": content, "model": "demo"})
    return await enqueue_run(db, account_id=account_id, conversation_id=conversation_id,
                             content=content, request=request, **kwargs)


async def post_beside(db: Db, account_id: UUID, conversation_id: UUID, content: str,
                      worker_id: str, lease_ttl_s: float) -> tuple[EnqueuedRun, list[Claim]]:
    """Post a demo turn as the daemon does with a free slot: enqueued and claimed beside its
    enqueue in one statement (queue.post_turn); the claim, if the fair claim picked it."""
    run, claim = await post_turn(
        db, account_id=account_id, claim=ClaimBeside(worker_id, lease_ttl_s),
        turn=NewRun(conversation_id, content, {"content": content, "model": "demo"}))
    return run, [] if claim is None else [claim]


@dataclass(frozen=True, slots=True)
class Turn:
    """One enqueued demo turn and what the demo model will answer to it."""

    run_id: UUID
    account_id: UUID
    conversation_id: UUID
    content: str
    tokens: int

    @property
    def expected(self) -> str:
        return expected_answer("demo", self.content, self.tokens)


async def enqueue_demo(db: Db, account_id: UUID, conversation_id: UUID, content: str, *,
                       tokens: int, delay_ms: int = 0) -> Turn:
    """Queue a demo turn answering `tokens` words, `delay_ms` apart."""
    params = {"tokens": tokens, "delay_ms": delay_ms}
    run = await enqueue_run(db, account_id=account_id, conversation_id=conversation_id,
                            content=content, request={"content": content, "params": params})
    return Turn(run.run_id, account_id, conversation_id, content, tokens)


@dataclass(frozen=True, slots=True)
class Device:
    """A device credential of an account: each device has its own bearer token."""

    name: str
    token: str
    device_id: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def client(self, daemon: Daemon, *,
               timeout: float | httpx.Timeout = STREAM_TIMEOUT) -> httpx.AsyncClient:
        """An HTTP client of `daemon` acting as this device."""
        return daemon.client(timeout=timeout, headers=self.headers)


async def new_device(pool: asyncpg.Pool, account: str, name: str) -> Device:
    """A device token minted for `account` (created if new), as `agentd token create` does."""
    token, device_id = await create_device_token(pool, account=account, device=name)
    return Device(name, token, str(device_id))


async def create_conversation(client: httpx.AsyncClient, title: str = "test") -> str:
    """POST /v1/conversations; asserts the 201 and returns the id."""
    response = await client.post("/v1/conversations", json={"title": title})
    assert response.status_code == 201, response.text
    return response.json()["id"]
