"""Remote-access tests: daemons over real TLS handshakes, real sockets, the real CLIs."""

from tests.daemon_harness import pytest_runtest_makereport
from tests.remote.helpers import spawn_remote

__all__ = ["pytest_runtest_makereport", "spawn_remote"]
