"""Process-level tests: real `agentd serve` subprocesses on this test's database."""

from tests.daemon_harness import pytest_runtest_makereport, spawn_daemon

__all__ = ["pytest_runtest_makereport", "spawn_daemon"]
