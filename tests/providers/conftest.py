"""Provider tests: fake servers speaking each real wire format, and real daemons pointed at them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.providers.fake_servers import FakeServer

__all__ = ["fake"]


@pytest.fixture
async def fake() -> AsyncIterator[FakeServer]:
    """A started fake provider server; script it with `fake.script(...)`."""
    server = await FakeServer().start()
    try:
        yield server
    finally:
        await server.close()
