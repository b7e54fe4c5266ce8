"""The named statements: parsed whole, documented, parameterized, and on the shared vocabulary."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agentd.queries import Q, parse_queries, sql_dir


def test_every_statement_has_an_invariant_comment() -> None:
    text = (sql_dir() / "queries.sql").read_text()
    for name in Q:
        block = text.split(f"-- {name} --", 1)[1].lstrip("\n")
        assert block.startswith("-- "), f"{name} lacks its one-line comment"


def test_statements_never_interpolate() -> None:
    for name, sql in Q.items():
        code = re.sub(r"--[^\n]*", "", sql)  # comments may say anything
        code = re.sub(r"'[^']*'", "''", code)  # string literals may hold JSON
        assert "{" not in code, f"{name} looks like a format string"
        assert "%s" not in code, name


def test_duplicate_names_are_rejected() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        parse_queries("-- a --\n-- x\nSELECT 1;\n-- a --\n-- y\nSELECT 2;\n")


def test_no_sql_outside_the_queries_file() -> None:
    """Application modules look statements up by name; none carries a SQL literal."""
    pattern = re.compile(r"[\"'](SELECT |INSERT INTO|UPDATE \w+ SET|DELETE FROM|CREATE "
                         r"(TABLE|DATABASE|INDEX)|WITH \w+ AS)")
    src = Path(__file__).resolve().parents[2] / "src" / "agentd"
    offenders = [str(p.relative_to(src)) for p in src.rglob("*.py")
                 if pattern.search(p.read_text())]
    assert offenders == []
