"""Remote-access tests: daemons over real TLS handshakes, real sockets, the real CLIs."""

from tests.remote.helpers import spawn_remote

__all__ = ["spawn_remote"]
