"""Every test is marked with what it needs, so a selection like `-m "not chaos and not slow"`
works without each file remembering to say so (the markers are declared in pyproject.toml and
`--strict-markers` refuses any other).

- `database`: uses a PostgreSQL database of its own (any test asking for `dsn` or `pool`).
- `process`: starts real `agentd` processes (a spawning fixture, or a tier made of them).
- `terminal`: drives the real agenttui binary under a pseudo-terminal (tests/terminal).
- `chaos`: the storm (tests/chaos): daemons killed and paused, PostgreSQL restarted.
- `slow`: takes tens of seconds on its own (listed in SLOW below, or the chaos tier).
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

# Tiers whose every test runs daemons or other real processes, whatever its fixtures say.
PROCESS_TIERS = {"process", "remote", "terminal", "chaos"}
DATABASE_FIXTURES = {"pg_admin_dsn", "dsn", "pool"}
PROCESS_FIXTURES = {"spawn_daemon", "spawn_remote", "daemon", "api"}
DIRECTORY_MARKERS = {"terminal": "terminal", "chaos": "chaos"}

# Tests that take tens of seconds by design (measured with --durations; see tests/README.md).
SLOW: set[str] = set()


def tier(item: pytest.Item) -> str | None:
    """The test's directory under tests/ (its tier), or None for a test outside one."""
    try:
        parts = Path(item.path).resolve().relative_to(TESTS).parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        where = tier(item)
        names = set(getattr(item, "fixturenames", ()))
        wanted = set()
        if names & DATABASE_FIXTURES:
            wanted.add("database")
        if names & PROCESS_FIXTURES or where in PROCESS_TIERS:
            wanted.add("process")
        if where in DIRECTORY_MARKERS:
            wanted.add(DIRECTORY_MARKERS[where])
        if where == "chaos" or item.nodeid.split("[")[0] in SLOW:
            wanted.add("slow")
        for name in sorted(wanted - {m.name for m in item.iter_markers()}):
            item.add_marker(name)
