"""Which asyncio event loop runs agentd: uvloop when it is installed, else the standard one.

A daemon streaming to hundreds of clients spends a large share of its time in the loop's own
bookkeeping and socket calls (docs/benchmarks.md: the profiles); uvloop does that work in C.
It is a dependency where it has wheels; without it (another platform, a broken install) agentd
runs the same on asyncio's own loop. `event_loop = asyncio` (AGENTD_EVENT_LOOP) picks that one
on purpose, to tell a loop problem from any other.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
CHOICES = ("auto", "uvloop", "asyncio")


class LoopUnavailable(RuntimeError):
    pass


def run(main: Coroutine[Any, Any, T], choice: str = "auto") -> T:
    """asyncio.run(main) on the chosen loop; "auto" takes uvloop when it imports."""
    if choice == "asyncio":
        return asyncio.run(main)
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:
        if choice == "uvloop":
            main.close()
            raise LoopUnavailable("event_loop = uvloop, but uvloop is not installed "
                                  "(pip install uvloop, or use auto/asyncio)") from None
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def name() -> str:
    """The running loop's kind, for logs and `agentd doctor`."""
    loop = asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
