"""Races lost on purpose: a trigger fails a statement the way PostgreSQL fails one that raced
other transactions, so the code's answer to a lost race (queue.lost_race) can be tested at will.

PostgreSQL fails such a statement in two ways the daemon knows: as a deadlock's victim, and with
the internal error "new multixact has more than one updating member" (seen on PostgreSQL 18 when a
rival transaction had just undone an update of a row both locked;
tests/integration/test_no_write_undone.py). The trigger counts with a sequence, not a table,
because the failing statement rolls back whatever it wrote.
"""

from __future__ import annotations

import asyncpg

MULTIXACT = ("'new multixact has more than one updating member: 7 members'", "XX000")
DEADLOCK = ("'deadlock detected'", "40P01")
# The same SQLSTATE as MULTIXACT but another message: an internal error that is not a lost race.
OTHER_INTERNAL = ("'could not read block 7 in file \"base/1/2\"'", "XX000")


async def lose_races(db: asyncpg.Pool | asyncpg.Connection, times: int, *,
                     on: str = "INSERT ON agent_run",
                     error: tuple[str, str] = MULTIXACT) -> None:
    """The first `times` rows that `on` (e.g. "UPDATE ON conversation") touches fail their
    statement with `error`; later ones pass."""
    message, code = error
    await db.execute(f"""
        CREATE SEQUENCE lost_races;
        CREATE FUNCTION lose_a_race() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF nextval('lost_races') <= {times} THEN
                RAISE EXCEPTION {message} USING ERRCODE = '{code}';
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER lose_a_race BEFORE {on} FOR EACH ROW EXECUTE FUNCTION lose_a_race();
    """)


async def stop_losing_races(db: asyncpg.Pool | asyncpg.Connection) -> None:
    """Take the trigger away (lose_races may then be called afresh)."""
    await db.execute("DROP FUNCTION lose_a_race() CASCADE; DROP SEQUENCE lost_races")


async def race_attempts(db: asyncpg.Pool | asyncpg.Connection) -> int:
    """How many rows the trigger has seen: the attempts of a statement that touches one row."""
    return await db.fetchval("SELECT last_value FROM lost_races")
