"""The suite's root: loads the shared test support (tests/support) and marks every test with
its tier, so `pytest -m "not chaos"` and friends select by what a test needs (tests/README.md).
"""

from __future__ import annotations

import pytest

pytest_plugins = ["tests.support.db", "tests.support.daemon", "tests.support.markers"]

def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("agentd")
    group.addoption("--chaos-runs", type=int, default=150,
                    help="turns posted during the chaos storm (long soak: 500+)")
    group.addoption("--chaos-conversations", type=int, default=25,
                    help="conversations the storm spreads its turns over")
    group.addoption("--chaos-workers", type=int, default=1,
                    help="worker processes per storm daemon (agentd serve --workers N)")

