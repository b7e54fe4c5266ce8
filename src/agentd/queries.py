"""Loads the named SQL statements of sql/queries.sql into one read-only mapping.

The statements are the only SQL agentd sends; modules look them up by name, never build SQL.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from types import MappingProxyType

_HEADER = re.compile(r"^-- ([a-z_]+) --$", re.MULTILINE)


def sql_dir() -> Path:
    """The directory holding migrations and queries: inside the wheel, or the source tree's."""
    packaged = resources.files("agentd").joinpath("sql")
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parents[2] / "sql"


def parse_queries(text: str) -> dict[str, str]:
    """Split a queries file into {name: statement}; each statement keeps its comment lines."""
    parts = _HEADER.split(text)
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"duplicate query name {name!r}")
        statement = body.strip().rstrip(";").strip()
        if not statement:
            raise ValueError(f"query {name!r} is empty")
        queries[name] = statement
    return queries


def load_queries() -> Mapping[str, str]:
    return MappingProxyType(parse_queries((sql_dir() / "queries.sql").read_text("utf-8")))


Q: Mapping[str, str] = load_queries()
