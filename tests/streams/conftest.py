"""Stream tests: real `agentd serve` subprocesses, driven over HTTP + SSE like a script would."""

from tests.daemon_harness import pytest_runtest_makereport, spawn_daemon

__all__ = ["pytest_runtest_makereport", "spawn_daemon"]
