"""Loads the named SQL statements of sql/queries.sql; call sites bind their parameters by name.

The statements are the only SQL agentd sends; modules look them up by name, never build SQL.
Each statement declares its parameters in $1..$n order (`-- params: run_id, claim_token`), so a
call reads `await db.fetchrow(*Q.check_lease.bind(run_id=…, claim_token=…))`.
"""

from __future__ import annotations

import keyword
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

_HEADER = re.compile(r"^-- ([a-z_]+) --$", re.MULTILINE)
_PARAMS = "-- params:"
_COMMENT = re.compile(r"--[^\n]*")
_LITERAL = re.compile(r"'(?:[^']|'')*'")
_PLACEHOLDER = re.compile(r"\$(\d+)")


def sql_dir() -> Path:
    """The directory holding migrations and queries: inside the wheel, or the source tree's."""
    packaged = resources.files("agentd").joinpath("sql")
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parents[2] / "sql"


def placeholders(sql: str) -> set[int]:
    """The $n a statement uses (comments and string literals may say anything)."""
    code = _LITERAL.sub("''", _COMMENT.sub("", sql))
    return {int(n) for n in _PLACEHOLDER.findall(code)}


@dataclass(frozen=True, slots=True)
class Statement:
    """One named statement: its SQL and the names of $1..$n, in order."""

    name: str
    sql: str
    params: tuple[str, ...] = ()
    _names: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_names", frozenset(self.params))

    def bind(self, **values: Any) -> tuple[Any, ...]:
        """(sql, $1, …, $n) for asyncpg: `await db.fetch(*Q.name.bind(param=value, …))`.

        Every declared parameter must be given, and nothing else: a missing or unknown keyword
        raises TypeError naming it, before anything reaches the database.
        """
        if len(values) == len(self.params):
            try:
                return (self.sql, *[values[name] for name in self.params])
            except KeyError:
                pass
        missing = [name for name in self.params if name not in values]
        unknown = sorted(set(values) - self._names)
        problems = ([f"missing {', '.join(missing)}"] if missing else []) + \
                   ([f"unknown {', '.join(unknown)}"] if unknown else [])
        raise TypeError(f"statement {self.name!r} takes ({', '.join(self.params)}): "
                        f"{'; '.join(problems)}")


def _declared_params(name: str, body: str) -> tuple[str, ...]:
    """The `-- params:` line right under the name; no line means no parameters."""
    first = body.lstrip("\n").split("\n", 1)[0]
    if not first.startswith(_PARAMS):
        if _PARAMS in body:
            raise ValueError(f"query {name!r}: the params line must come right under the name")
        return ()
    params = tuple(p.strip() for p in first[len(_PARAMS):].split(","))
    if params == ("",):
        raise ValueError(f"query {name!r}: an empty params line (omit it instead)")
    for param in params:
        if not param.isidentifier() or keyword.iskeyword(param):
            raise ValueError(f"query {name!r}: {param!r} is not a usable parameter name")
    if len(set(params)) != len(params):
        raise ValueError(f"query {name!r}: a parameter is declared twice")
    return params


def parse_queries(text: str) -> dict[str, Statement]:
    """Split a queries file into {name: Statement}; each statement keeps its comment lines.

    The declaration must name exactly $1..$n: as many names as the highest $n, each $k used.
    """
    parts = _HEADER.split(text)
    queries: dict[str, Statement] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"duplicate query name {name!r}")
        statement = body.strip().rstrip(";").strip()
        if not statement:
            raise ValueError(f"query {name!r} is empty")
        params = _declared_params(name, body)
        used = placeholders(statement)
        if used != set(range(1, len(params) + 1)):
            raise ValueError(f"query {name!r} declares {len(params)} parameters "
                             f"({', '.join(params) or 'none'}) but uses "
                             f"{', '.join(f'${n}' for n in sorted(used)) or 'none'}")
        queries[name] = Statement(name, statement, params)
    return queries


class Queries:
    """The named statements as attributes: `Q.claim_runs` is a Statement. Iterable, read-only."""

    def __init__(self, statements: dict[str, Statement]) -> None:
        # Plain instance attributes: a lookup on the hot path is one dict access.
        self.__dict__.update(statements)

    def __getattr__(self, name: str) -> Statement:
        # Only reached when no statement has this name.
        raise AttributeError(f"sql/queries.sql has no statement named {name!r}")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("the named statements are read-only")

    def __iter__(self) -> Iterator[Statement]:
        return iter(list(self.__dict__.values()))

    def __len__(self) -> int:
        return len(self.__dict__)

    def __contains__(self, name: object) -> bool:
        return name in self.__dict__


def load_queries() -> Queries:
    return Queries(parse_queries((sql_dir() / "queries.sql").read_text("utf-8")))


Q = load_queries()
