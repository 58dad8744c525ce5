"""Waiting for something to become true, in one place.

A test that sleeps a fixed time either waits longer than it needs (the suite
gets slow) or not long enough on a loaded machine (the suite gets flaky). These
poll a condition instead and fail with what was awaited, so a timeout reads as
"timed out waiting for the replica to be ready", not a bare assertion.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(check: Callable[[], T | Awaitable[T]], within_s: float = 10.0,
                     what: str = "the condition", every_s: float = 0.05,
                     note: Callable[[], object] | None = None) -> T:
    """Poll `check` (plain or async) until it returns something truthy; return that.

    ``note``, if given, says at the timeout what was last seen.
    """
    deadline = time.monotonic() + within_s
    while True:
        got = check()
        if isinstance(got, Awaitable):
            got = await got
        if got:
            return got  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise AssertionError(_timed_out(within_s, what, note))
        await asyncio.sleep(every_s)


def eventually_sync(check: Callable[[], T], within_s: float = 10.0,
                    what: str = "the condition", every_s: float = 0.05,
                    note: Callable[[], object] | None = None) -> T:
    """`eventually` for tests without an event loop (subprocesses, threads)."""
    deadline = time.monotonic() + within_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(_timed_out(within_s, what, note))
        time.sleep(every_s)


async def ends_with_cancel(task: asyncio.Task[T], within_s: float = 1.0) -> bool:
    """Cancel ``task``: True when it ended, cancelled, within ``within_s``. One that
    outlived the cancel is cancelled again and awaited, so it does not outlive the test."""
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=within_s)
    if not done:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return bool(done) and task.cancelled()


def _timed_out(within_s: float, what: str, note: Callable[[], object] | None) -> str:
    seen = f"; last seen: {note()}" if note is not None else ""
    return f"timed out after {within_s} s waiting for {what}{seen}"
