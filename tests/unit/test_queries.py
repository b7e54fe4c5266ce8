"""The named statements: parsed whole, documented, parameterized by name, and on the shared
vocabulary; every call site binds exactly the parameters its statement declares."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from agentd.queries import Q, Statement, parse_queries, placeholders, sql_dir

ROOT = Path(__file__).resolve().parents[2]
CHECKED_TREES = ("src", "tests", "bench")


def test_every_statement_has_an_invariant_comment() -> None:
    text = (sql_dir() / "queries.sql").read_text()
    for statement in Q:
        block = text.split(f"-- {statement.name} --", 1)[1].lstrip("\n")
        if statement.params:
            block = block.split("\n", 1)[1]  # the params line comes first
        assert block.startswith("-- "), f"{statement.name} lacks its one-line comment"
        assert not block.startswith("-- params:"), statement.name


def test_statements_never_interpolate() -> None:
    for statement in Q:
        code = re.sub(r"--[^\n]*", "", statement.sql)  # comments may say anything
        code = re.sub(r"'[^']*'", "''", code)  # string literals may hold JSON
        assert "{" not in code, f"{statement.name} looks like a format string"
        assert "%s" not in code, statement.name


def test_every_declaration_names_exactly_the_placeholders_its_statement_uses() -> None:
    """Counted here from the file's raw text, not trusted to the loader."""
    text = (sql_dir() / "queries.sql").read_text()
    blocks = re.split(r"^-- ([a-z_]+) --$", text, flags=re.MULTILINE)
    checked = 0
    for name, body in zip(blocks[1::2], blocks[2::2], strict=True):
        declared = re.findall(r"^-- params: (.*)$", body, flags=re.MULTILINE)
        names = [p.strip() for p in declared[0].split(",")] if declared else []
        assert len(declared) <= 1, f"{name}: more than one params line"
        code = re.sub(r"'(?:[^']|'')*'", "''", re.sub(r"--[^\n]*", "", body))
        used = {int(n) for n in re.findall(r"\$(\d+)", code)}
        highest = max(used, default=0)
        assert len(names) == highest, f"{name}: declares {names}, highest placeholder ${highest}"
        assert used == set(range(1, highest + 1)), f"{name}: uses {sorted(used)}, not 1..n"
        assert getattr(Q, name).params == tuple(names), name
        checked += 1
    assert checked == len(Q) and checked >= 50


@pytest.mark.parametrize(("text", "problem"), [
    ("-- a --\n-- x\nSELECT $1;\n", "declares 0 parameters"),
    ("-- a --\n-- params: id\n-- x\nSELECT 1;\n", "declares 1 parameters"),
    ("-- a --\n-- params: id, other\n-- x\nSELECT $1, $3;\n", "uses \\$1, \\$3"),
    ("-- a --\n-- params:\n-- x\nSELECT 1;\n", "empty params line"),
    ("-- a --\n-- params: id, id\n-- x\nSELECT $1, $2;\n", "declared twice"),
    ("-- a --\n-- params: from\n-- x\nSELECT $1;\n", "not a usable parameter name"),
    ("-- a --\n-- x\n-- params: id\nSELECT $1;\n", "right under the name"),
])
def test_a_wrong_declaration_is_refused_at_load(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_queries(text)


def test_placeholders_in_comments_and_literals_do_not_count() -> None:
    assert placeholders("-- costs $5\nSELECT '$2', 'it''s $3', $1") == {1}


def test_duplicate_names_are_rejected() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        parse_queries("-- a --\n-- x\nSELECT 1;\n-- a --\n-- y\nSELECT 2;\n")


def test_bind_orders_keywords_as_declared_and_names_what_is_wrong() -> None:
    statement = Statement("s", "SELECT $1, $2, $3", ("run_id", "claim_token", "fence"))
    assert statement.bind(fence=3, run_id=1, claim_token=2) == ("SELECT $1, $2, $3", 1, 2, 3)
    with pytest.raises(TypeError, match=r"'s' takes \(run_id, claim_token, fence\): "
                                        r"missing claim_token; unknown claim_tokn"):
        statement.bind(run_id=1, claim_tokn=2, fence=3)
    with pytest.raises(TypeError, match=r"missing fence$"):
        statement.bind(run_id=1, claim_token=2)
    with pytest.raises(TypeError, match=r"unknown extra$"):
        statement.bind(run_id=1, claim_token=2, fence=3, extra=4)
    assert Statement("p", "SELECT 1").bind() == ("SELECT 1",)


def test_an_unknown_statement_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no statement named 'claim_run'"):
        Q.claim_run  # noqa: B018
    with pytest.raises(AttributeError, match="read-only"):
        setattr(Q, "claim_runs", Q.check_lease)  # noqa: B010


def call_site_problems(source: str, filename: str) -> list[str]:
    """Every use of `Q` in a module: `Q.name.bind(k=…)` with exactly the declared keywords, or
    `Q.name.sql` run only for a statement without parameters. Anything else cannot be checked."""
    tree = ast.parse(source, filename)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    problems = []

    def where(node: ast.AST) -> str:
        return f"{filename}:{getattr(node, 'lineno', '?')}"

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "agentd.queries":
            problems += [f"{where(node)}: import Q as itself, not as {alias.asname}"
                         for alias in node.names if alias.name == "Q" and alias.asname]
        if not (isinstance(node, ast.Name) and node.id == "Q"):
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Subscript):
            problems.append(f"{where(node)}: Q[...] is gone; use Q.name.bind(...)")
            continue
        if not isinstance(parent, ast.Attribute):
            continue  # iterating the statements, len(Q), `name in Q`
        if parent.attr not in Q:
            problems.append(f"{where(node)}: no statement named {parent.attr!r}")
            continue
        statement = getattr(Q, parent.attr)
        use = parents.get(parent)
        call = parents.get(use) if isinstance(use, ast.Attribute) else None
        if isinstance(use, ast.Attribute) and use.attr == "bind" and \
                isinstance(call, ast.Call) and call.func is use:
            if call.args or any(k.arg is None for k in call.keywords):
                problems.append(f"{where(node)}: {statement.name}.bind takes keywords only")
                continue
            given = {k.arg for k in call.keywords}
            missing = [p for p in statement.params if p not in given]
            unknown = sorted(str(k) for k in given - set(statement.params))
            if missing or unknown:
                problems.append(f"{where(node)}: {statement.name} missing {missing}, "
                                f"unknown {unknown}")
        elif isinstance(use, ast.Attribute) and use.attr == "sql":
            if statement.params and isinstance(parents.get(use), ast.Call):
                problems.append(f"{where(node)}: {statement.name}.sql skips its parameters "
                                f"{statement.params}; bind them")
        elif not (isinstance(use, ast.Attribute) and use.attr in ("name", "params")):
            problems.append(f"{where(node)}: use Q.{statement.name}.bind(...) where it runs")
    return sorted(problems, key=lambda p: int(p.split(":")[1]))


def test_every_call_site_binds_exactly_the_declared_parameters() -> None:
    problems, sites = [], 0
    for tree in CHECKED_TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            source = path.read_text("utf-8")
            if "agentd.queries" not in source or path.name == "test_queries.py":
                continue
            sites += source.count("Q.")
            problems += call_site_problems(source, str(path.relative_to(ROOT)))
    assert problems == []
    assert sites >= 50  # the walk found the call sites at all


def test_the_call_site_check_catches_each_kind_of_mistake() -> None:
    bad = """
from agentd.queries import Q
from agentd.queries import Q as Queries
async def f(db, claim):
    await db.fetchrow(Q["check_lease"], claim.run_id, claim.claim_token)
    await db.fetchrow(*Q.check_lease.bind(run_id=claim.run_id, claim_tokn=claim.claim_token))
    await db.fetchrow(*Q.check_lease.bind(claim.run_id, claim.claim_token))
    await db.fetchrow(*Q.check_lease.bind(**{"run_id": 1}))
    await db.fetchrow(Q.check_lease.sql, claim.run_id)
    await db.fetchrow(*Q.check_leese.bind(run_id=1))
    statement = Q.check_lease
    await db.fetchval(Q.ping.sql)
    await db.fetchrow(*Q.check_lease.bind(run_id=1, claim_token=2))
"""
    problems = call_site_problems(bad, "bad.py")
    assert [p.split(": ", 1)[0] for p in problems] == [
        "bad.py:3", "bad.py:5", "bad.py:6", "bad.py:7", "bad.py:8", "bad.py:9", "bad.py:10",
        "bad.py:11"], problems
    assert "missing ['claim_token'], unknown ['claim_tokn']" in problems[2]


def test_no_sql_outside_the_queries_file() -> None:
    """Application modules look statements up by name; none carries a SQL literal."""
    pattern = re.compile(r"[\"'](SELECT |INSERT INTO|UPDATE \w+ SET|DELETE FROM|CREATE "
                         r"(TABLE|DATABASE|INDEX)|WITH \w+ AS)")
    src = ROOT / "src" / "agentd"
    offenders = [str(p.relative_to(src)) for p in src.rglob("*.py")
                 if pattern.search(p.read_text())]
    assert offenders == []
