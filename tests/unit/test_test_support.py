"""The suite keeps one copy of each shared helper (tests/support) and its markers honest."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.markers import SLOW

TESTS = Path(__file__).resolve().parents[1]
SUPPORT = TESTS / "support"

# Defined in tests/support and nowhere else: a second copy drifts from the first.
SHARED = {"assert_journal_sound", "assert_contiguous", "read_journal", "parse_frame",
          "iter_sse", "read_sse", "read_until_cut", "Follower", "Frame", "Device", "new_device",
          "poll_until", "free_port", "spawn_daemon", "Daemon", "enqueue_demo", "new_tenant",
          "pg_admin_dsn", "template_db", "dsn", "pool"}


def definitions(path: Path) -> dict[str, int]:
    """Top-level functions and classes of a module: name -> line."""
    tree = ast.parse(path.read_text("utf-8"), str(path))
    return {node.name: node.lineno for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def test_shared_helpers_are_defined_once_in_tests_support() -> None:
    copies = [f"{path.relative_to(TESTS.parent)}:{line} defines {name}"
              for path in sorted(TESTS.rglob("*.py")) if SUPPORT not in path.parents
              for name, line in definitions(path).items() if name in SHARED]
    assert not copies, "use tests/support instead of a copy:\n" + "\n".join(copies)


def test_every_test_marked_slow_exists() -> None:
    """A renamed or removed test must leave the SLOW list too (it would silently go fast)."""
    missing = []
    for node_id in sorted(SLOW):
        file, _, name = node_id.partition("::")
        path = TESTS.parent / file
        if not path.is_file() or name not in definitions(path):
            missing.append(node_id)
    assert not missing, f"SLOW names tests that do not exist: {missing}"
