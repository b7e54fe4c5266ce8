"""A long conversation written straight into the database: `turns` completed exchanges (a
question and a Markdown answer each), as the daemon would have stored them, in two statements.

Running 1,000 real demo turns would take minutes; the TUI tests and the TUI benchmark need the
transcript, not its history. Rows are shaped like the daemon's own (a completed run per turn, its
user message and answer), so every read path treats them as real turns. Answer N ends with
`last_line(N)`, which a test can look for on screen.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from uuid import UUID

import asyncpg

# Fixture data, not application SQL (which lives in sql/queries.sql): one run per turn, then the
# messages in turn order (question before answer), so `position` follows the conversation.
_INSERT_RUNS = """
INSERT INTO agent_run (id, account_id, conversation_id, user_message_id, origin_device_id,
                       status, request, request_hash, usage, created_at, started_at,
                       finished_at)
SELECT run_id, $1::uuid, $2::uuid, question_id, $3::uuid, 'completed',
       jsonb_build_object('model', 'demo'), 'generated',
       jsonb_build_object('input_tokens', 40 + n, 'output_tokens', 90),
       at, at, at + interval '2 seconds'
FROM unnest($4::uuid[], $5::uuid[], $6::timestamptz[]) WITH ORDINALITY
     AS t(run_id, question_id, at, n)
"""
_INSERT_MESSAGES = """
INSERT INTO message (id, conversation_id, run_id, role, content, status, created_at)
SELECT id, $1::uuid, run_id, role, content, 'complete', at
FROM unnest($2::uuid[], $3::uuid[], $4::text[], $5::text[], $6::timestamptz[])
     WITH ORDINALITY AS t(id, run_id, role, content, at, n)
ORDER BY n
"""
_TOUCH = "UPDATE conversation SET updated_at = clock_timestamp() WHERE id = $1::uuid"


@dataclass(frozen=True)
class LongConversation:
    conversation_id: UUID
    turns: int
    question_ids: list[UUID]
    answer_ids: list[UUID]

    @property
    def messages(self) -> int:
        return 2 * self.turns


def question(n: int) -> str:
    return f"Question {n}: how would you keep step {n} of the plan durable?"


def last_line(n: int) -> str:
    """The closing line of answer `n`: unique, short enough to fit on one screen line."""
    return f"End of answer {n}."


def answer(n: int) -> str:
    """A Markdown answer of a few hundred characters: a heading, a list, now and then code."""
    parts = [f"### Step {n}",
             f"Keep step {n} in the database and let every device read it from there.",
             "",
             f"- write the state of step {n} in one transaction",
             "- wake the workers with a notify (a hint, never the truth)",
             "- read the rows again when woken"]
    if n % 5 == 0:
        parts += ["", "```python", f"async def step_{n}(pool):",
                  f"    await pool.execute('select {n}')", "```"]
    parts += ["", last_line(n)]
    return "\n".join(parts)


async def write_long_conversation(pool: asyncpg.Pool, *, account_id: UUID, device_id: UUID,
                                  conversation_id: UUID, turns: int, first: int = 1,
                                  answer_of: Callable[[int], str] = answer,
                                  ) -> LongConversation:
    """Append `turns` completed turns (numbered from `first`) to the conversation, answer `n`
    being `answer_of(n)`."""
    numbers = range(first, first + turns)
    run_ids = [uuid.uuid4() for _ in numbers]
    question_ids = [uuid.uuid4() for _ in numbers]
    answer_ids = [uuid.uuid4() for _ in numbers]
    async with pool.acquire() as conn, conn.transaction():
        now = await conn.fetchval("SELECT clock_timestamp() - make_interval(secs => $1)",
                                  float(turns * 10))
        times = [now + dt.timedelta(seconds=10 * i) for i in range(turns)]
        await conn.execute(_INSERT_RUNS, account_id, conversation_id, device_id, run_ids,
                           question_ids, times)
        ids, runs, roles, contents, at = [], [], [], [], []
        for i, n in enumerate(numbers):
            ids += [question_ids[i], answer_ids[i]]
            runs += [run_ids[i], run_ids[i]]
            roles += ["user", "assistant"]
            contents += [question(n), answer_of(n)]
            at += [times[i], times[i] + dt.timedelta(seconds=2)]
        await conn.execute(_INSERT_MESSAGES, conversation_id, ids, runs, roles, contents, at)
        await conn.execute(_TOUCH, conversation_id)
    return LongConversation(conversation_id, turns, question_ids, answer_ids)
