"""Search across an account's conversations (conversations.search_messages): a conversation
whose title matches is one hit, not every message it holds, so it cannot crowd out the
messages that match themselves."""

from __future__ import annotations

import asyncpg

from agentd.conversations import SEARCH_EXCERPT_CHARS, search_messages
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

    hits = await search_messages(pool, tenant.account_id, "zebra", 10)

    assert [(h["conversation_id"], h["message_id"]) for h in hits] == [
        (titled, newest), (older, said)]


async def test_a_titled_conversation_whose_messages_match_shows_those_messages(
        pool: asyncpg.Pool) -> None:
    tenant = await new_tenant(pool)
    titled = await new_conversation(pool, tenant.account_id, "zebra")
    first = await say(pool, titled, "a zebra here")
    await say(pool, titled, "nothing there")
    hits = await search_messages(pool, tenant.account_id, "zebra", 10)
    assert [h["message_id"] for h in hits] == [first]


async def test_a_hit_carries_the_part_of_a_long_message_around_its_match(
        pool: asyncpg.Pool) -> None:
    """A hit is at most SEARCH_EXCERPT_CHARS of its message, around the first match (any
    case), and says it was cut; a short message comes whole; a wildcard in the query is a
    plain character."""
    tenant = await new_tenant(pool)
    conversation = await new_conversation(pool, tenant.account_id, "notes")
    long_text = "x" * 50_000 + " the 100%_Needle is here " + "y" * 50_000
    long_id = await say(pool, conversation, long_text)
    short_id = await say(pool, conversation, "a short 100%_needle")
    await say(pool, conversation, "100 and _ and needle, apart")  # no match for the query

    hits = await search_messages(pool, tenant.account_id, "100%_NEEDLE", 10)

    by_id = {h["message_id"]: h for h in hits}
    assert set(by_id) == {long_id, short_id}
    assert by_id[short_id]["content"] == "a short 100%_needle"
    assert by_id[short_id]["truncated"] is False
    cut = by_id[long_id]
    assert cut["truncated"] is True
    assert len(cut["content"]) == SEARCH_EXCERPT_CHARS
    assert "100%_Needle" in cut["content"] and cut["content"] in long_text
    # A quarter of the excerpt before the match, for context.
    assert cut["content"].index("100%_Needle") == SEARCH_EXCERPT_CHARS // 4


async def test_a_match_near_either_end_keeps_the_excerpt_whole(pool: asyncpg.Pool) -> None:
    tenant = await new_tenant(pool)
    conversation = await new_conversation(pool, tenant.account_id, "ends")
    head = await say(pool, conversation, "needle at the start " + "h" * 5_000)
    tail = await say(pool, conversation, "t" * 5_000 + " the end has a NEEDLE")
    hits = {h["message_id"]: h["content"]
            for h in await search_messages(pool, tenant.account_id, "needle", 10)}
    assert hits[head] == ("needle at the start " + "h" * 5_000)[:SEARCH_EXCERPT_CHARS]
    assert hits[tail] == ("t" * 5_000 + " the end has a NEEDLE")[-SEARCH_EXCERPT_CHARS:]


async def test_a_title_hit_carries_the_start_of_its_newest_message(pool: asyncpg.Pool) -> None:
    tenant = await new_tenant(pool)
    titled = await new_conversation(pool, tenant.account_id, "Zebra plans")
    await say(pool, titled, "z" * 10_000)
    [hit] = await search_messages(pool, tenant.account_id, "zebra", 10)
    assert hit["content"] == "z" * SEARCH_EXCERPT_CHARS and hit["truncated"] is True
