"""Stream tests: real `agentd serve` subprocesses, driven over HTTP + SSE like a script would.

Daemons come from `spawn_daemon` (tests/support/daemon.py)."""
