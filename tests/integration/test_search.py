"""Search across an account's conversations (conversations.search_messages): a conversation
whose title matches is one hit, not every message it holds, so it cannot crowd out the
messages that match themselves."""

from __future__ import annotations

import asyncpg

from agentd.conversations import search_messages
from tests.support.factories import new_conversation, new_tenant


async def say(pool: asyncpg.Pool, conversation_id, content: str) -> object:
    return await pool.fetchval(
        "INSERT INTO message (conversation_id, role, content, status)"
        " VALUES ($1, 'user', $2, 'complete') RETURNING id", conversation_id, content)


async def test_a_matching_title_is_one_hit_and_messages_that_match_still_show(
        pool: asyncpg.Pool) -> None:
    tenant = await new_tenant(pool)
    older = await new_conversation(pool, tenant.account_id, "groceries")
    said = await say(pool, older, "remember the zebra crossing")
    titled = await new_conversation(pool, tenant.account_id, "Zebra plans")
    newest = None
    for n in range(30):
        newest = await say(pool, titled, f"step {n}")
    elsewhere = await new_tenant(pool)  # another account's title never shows
    await say(pool, await new_conversation(pool, elsewhere.account_id, "zebra"), "hidden")

    hits = await search_messages(pool, tenant.account_id, "%zebra%", 10)

    assert [(h["conversation_id"], h["message_id"]) for h in hits] == [
        (titled, newest), (older, said)]


async def test_a_titled_conversation_whose_messages_match_shows_those_messages(
        pool: asyncpg.Pool) -> None:
    tenant = await new_tenant(pool)
    titled = await new_conversation(pool, tenant.account_id, "zebra")
    first = await say(pool, titled, "a zebra here")
    await say(pool, titled, "nothing there")
    hits = await search_messages(pool, tenant.account_id, "%zebra%", 10)
    assert [h["message_id"] for h in hits] == [first]
