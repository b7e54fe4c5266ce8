"""The listen address: bound first, claimed (listened on) once the daemon is ready, and a
second daemon told in plain words whichever of the two steps finds the port taken."""

from __future__ import annotations

import os

import pytest

from agentd.listen import ListenError, bind_listen_sockets, claim
from tests.support.daemon import free_port


def test_two_daemons_bound_at_once_the_second_to_claim_is_told_who_holds_it() -> None:
    """Two processes starting together can both bind the port (neither listens yet): the
    second to listen used to fail inside aiohttp as "cannot reach the database: [Errno 98]"."""
    port = free_port()
    first = bind_listen_sockets("127.0.0.1", port)
    second = bind_listen_sockets("127.0.0.1", port)  # allowed: no socket listens yet
    try:
        claim(first, "127.0.0.1", port)
        with pytest.raises(ListenError) as refused:
            claim(second, "127.0.0.1", port)
        message = str(refused.value)
        assert message.startswith(f"cannot listen on 127.0.0.1:{port}: the address is already "
                                  f"in use by pid {os.getpid()}")
        assert "--listen" in message
        with pytest.raises(ListenError, match="already in use"):  # and once it listens, bind
            bind_listen_sockets("127.0.0.1", port)
    finally:
        for sock in first + second:
            sock.close()
