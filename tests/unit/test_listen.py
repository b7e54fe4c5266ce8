"""The listen address: bound first, claimed (listened on) once the daemon is ready, and a
second daemon told in plain words whichever of the two steps finds the port taken."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from agentd.listen import ListenError, bind_listen_sockets, claim, describe_process
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


@pytest.mark.parametrize("secret_args", [
    ["--dsn", "postgresql://app:S3cret@db/agentd"], ["postgresql://app:S3cret@db/agentd"],
    ["-p", "app:S3cret"], ["-p", "S3cret"], ["-pS3cret"], ["--password=S3cret"]])
def test_the_holder_is_described_without_its_options_or_values(
        secret_args: list[str]) -> None:
    """Its whole command line went into the error (and the journal), with whatever secrets its
    options held; as root, any user's process."""
    holder = subprocess.Popen([sys.executable, "-m", "tests.support.sleeper", "serve",
                               *secret_args], stdin=subprocess.DEVNULL)
    try:
        said = poll_process(holder.pid)
    finally:
        holder.kill()
        holder.wait()
    assert "S3cret" not in said
    assert said == f"pid {holder.pid} ({sys.executable} -m tests.support.sleeper serve …)", said


def poll_process(pid: int) -> str:
    """The description once the child's command line is readable (just after its exec)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        said = describe_process(pid)
        if sys.executable in said:
            return said
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} never showed its command line")
