"""Waiting on a condition with a deadline, never a bare sleep: ``wait_until`` for async
predicates, ``wait_until_sync`` for plain ones (subprocess tests outside an event loop).

The predicate is checked once more after the deadline, so a condition met while the last
sleep ran still passes; the error names what was awaited."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

__all__ = ["wait_until", "wait_until_sync"]


async def wait_until(
    predicate: Callable[[], Awaitable[bool]],
    timeout_s: float = 10.0,
    what: str = "condition",
    every_s: float = 0.02,
) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout_s:g} s")
        await asyncio.sleep(every_s)


def wait_until_sync(
    predicate: Callable[[], bool],
    timeout_s: float = 10.0,
    what: str = "condition",
    every_s: float = 0.02,
) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout_s:g} s")
        time.sleep(every_s)
