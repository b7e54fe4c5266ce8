"""Process-level tests: real `agentd serve` subprocesses on this test's database.

Daemons come from `spawn_daemon` (tests/support/daemon.py)."""
