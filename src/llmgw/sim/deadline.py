"""Waking at a deadline to within tens of microseconds, not the event loop's millisecond.

A simulated engine stands in for a GPU, whose steps end when the work is
done. Sleeping with the event loop put every step's end on a millisecond
grid: uvloop rounds a timer to its millisecond clock, read once per loop
turn, so a step ended anywhere from ~0.4 ms early to ~0.8 ms late, evenly
spread. That is the size of the differences bench/routing.py has to tell
apart at low load, where every policy's prompts prefill the same 356 ms and
two runs of the same policy put its p90 0.1-0.6 ms apart.

One ``timerfd`` per event loop (Linux), armed on CLOCK_MONOTONIC (the clock
of :func:`time.monotonic`) at the earliest pending deadline, wakes the loop
through its readiness when the kernel's timer fires: ~0.05 ms after the
deadline, never before. Elsewhere, or where the calls fail, the loop's own
sleep stands in.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import heapq
import itertools
import math
import os
import sys
import time
import weakref

_CLOCK_MONOTONIC = 1
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.timerfd_settime.argtypes = [
            ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.c_void_p,
        ]  # fmt: skip
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


class _Deadlines:
    """A loop's pending wake-ups, on one timerfd armed at the earliest.

    One descriptor per event loop, not per engine: a simulated fleet runs
    hundreds of engines in one process.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        # The loop is not kept here: this object is the value of a weak
        # mapping keyed by the loop, and would otherwise keep it alive.
        self._fd = fd
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._armed = math.inf
        self._spec = _Itimerspec()
        loop.add_reader(fd, self._fired)

    def wait(self, deadline: float) -> asyncio.Future[None]:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (deadline, next(self._order), waiter))
        if deadline < self._armed:
            self._arm(deadline)
        return waiter

    def _arm(self, deadline: float) -> None:
        whole = math.floor(deadline)
        self._spec.it_value.tv_sec = whole
        # A zero it_value disarms the timer: a deadline on a whole second is
        # armed a nanosecond later instead.
        self._spec.it_value.tv_nsec = max(1, int((deadline - whole) * 1e9))
        assert _LIBC is not None
        if _LIBC.timerfd_settime(self._fd, _TFD_TIMER_ABSTIME, ctypes.byref(self._spec), None):
            # Not expected; the loop's own timer then, as without a timerfd.
            asyncio.get_running_loop().call_later(
                max(0.0, deadline - time.monotonic()), self._fired
            )
        self._armed = deadline

    def _fired(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._fd, 8)  # the expiry count; reading it clears readiness
        self._armed = math.inf
        now = time.monotonic()
        heap = self._heap
        while heap and heap[0][0] <= now:
            waiter = heapq.heappop(heap)[2]
            if not waiter.done():  # a cancelled sleep stays in the heap until due
                waiter.set_result(None)
        if heap:
            self._arm(heap[0][0])


_per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Deadlines | None] = (
    weakref.WeakKeyDictionary()
)


def _deadlines() -> _Deadlines | None:
    loop = asyncio.get_running_loop()
    try:
        return _per_loop[loop]
    except KeyError:
        pass
    found = None
    if _LIBC is not None:
        fd = _LIBC.timerfd_create(_CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC)
        if fd >= 0:
            found = _Deadlines(loop, fd)
            weakref.finalize(loop, os.close, fd)
    _per_loop[loop] = found
    return found


async def sleep_until(deadline: float) -> None:
    """Sleep until :func:`time.monotonic` reaches ``deadline`` (within tens of microseconds)."""
    delay = deadline - time.monotonic()
    if delay <= 0:
        await asyncio.sleep(0)
        return
    deadlines = _deadlines()
    if deadlines is None:
        await asyncio.sleep(delay)
        return
    await deadlines.wait(deadline)
