"""One gateway worker's counters and its shares of every limit, exchanged with the control plane.

A counter exists while its limit is in use here: made at a request of its
key or team, dropped after ``IDLE_S`` without one (and, for a sliding
minute, with nothing left in it), which tells the control plane at the next
report that its share is free. Shares are kept whatever happens to the link:
a worker that cannot reach the control plane enforces its last ones, and a
counter that never had one admits nothing (llmgw.allowance).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable

from llmgw import wire
from llmgw.gateway.tenancy.windows import SlidingCount

log = logging.getLogger(__name__)

# A counter unused this long is dropped (its share handed back).
IDLE_S = 90.0
# A refused request asks for a larger share first, if the last answer is
# older than this: a share cut to what another worker left free grows back
# at once, not at the next report; and a flood costs at most a few calls a second.
RESYNC_S = 0.5
# How long a request waits for a share it has none of.
SYNC_WAIT_S = 2.0

Exchange = Callable[[wire.AllowanceReport], Awaitable[wire.AllowanceAnswer]]


class Counter:
    """One limit (subject and kind) as this worker counts it."""

    __slots__ = ("exhausted", "kind", "last_attempt", "limit", "share", "sliding", "subject",
                 "synced_at", "used", "wanted", "window", "window_end", "window_used")

    def __init__(self, subject: str, kind: wire.LimitKind, limit: float) -> None:
        self.subject = subject
        self.kind: wire.LimitKind = kind
        self.limit = limit
        self.sliding = kind in ("rpm", "tpm")
        self.used = SlidingCount()  # sliding kinds
        self.window = 0  # calendar kinds: the window's start (unix s)
        self.window_end = 0
        self.window_used = 0.0
        self.wanted = SlidingCount()
        self.share: float | None = None  # None: none lent yet
        self.exhausted = False  # the fleet's use of it had reached it at the last answer
        self.synced_at = -1e18
        self.last_attempt = time.monotonic()

    def roll(self, start: int, end: int) -> None:
        """Enter the calendar window [start, end): a new one starts at nothing, with no share."""
        if start != self.window:
            self.window, self.window_end, self.window_used = start, end, 0.0
            self.share = None

    def count(self, now: float) -> float:
        return self.used.count(now) if self.sliding else self.window_used

    def add(self, amount: float, now: float) -> None:
        if self.sliding:
            self.used.add(amount, now)
        else:
            self.window_used += amount

    def room(self, now: float) -> bool | None:
        """Whether one more request fits its share; None: no share yet.

        Requests are counted whole (the next one must fit); tokens and
        dollars are known after the answer, so a counter admits while under
        its share and a request may end past it (the bound in llmgw.allowance).
        """
        if self.share is None:
            return None
        if self.kind == "rpm":
            return self.count(now) + 1 <= self.share + 1e-9
        return self.count(now) < self.share

    def use(self, now: float) -> wire.AllowanceUse:
        return wire.AllowanceUse(subject=self.subject, kind=self.kind, window=self.window,
                                 used=self.count(now), wanted=self.wanted.count(now),
                                 enforced=self.share or 0.0)


class EnforcementPoint:
    """This worker's counters, its reports and the shares the answers lend it."""

    def __init__(self, exchange: Exchange, point_id: str | None = None) -> None:
        self.exchange = exchange
        # One per process start: a restarted worker is a new point, and the
        # old one's claims are held until they have aged out (llmgw.allowance).
        self.point_id = point_id or f"{os.uname().nodename}-{os.getpid()}-{os.urandom(4).hex()}"
        self.counters: dict[tuple[str, wire.LimitKind], Counter] = {}
        self.report_every_s = 1.0
        # Until then (monotonic), the control plane lends no increase (a new leader).
        self.settling_until = 0.0
        self._sync: asyncio.Task[bool] | None = None
        self.failures = 0

    def counter(self, subject: str, kind: wire.LimitKind, limit: float) -> Counter:
        found = self.counters.get((subject, kind))
        if found is None:
            found = self.counters[(subject, kind)] = Counter(subject, kind, limit)
        found.limit = limit
        return found

    def report(self, now: float) -> wire.AllowanceReport:
        for key, counter in list(self.counters.items()):
            if now - counter.last_attempt > IDLE_S and (
                    not counter.sliding or counter.count(now) == 0):
                del self.counters[key]
        return wire.AllowanceReport(point=self.point_id,
                                    uses=[c.use(now) for c in self.counters.values()])

    def apply(self, answer: wire.AllowanceAnswer, now: float) -> None:
        for share in answer.shares:
            counter = self.counters.get((share.subject, share.kind))
            if counter is not None and counter.window == share.window:
                counter.share, counter.limit, counter.synced_at = share.share, share.limit, now
                counter.exhausted = share.exhausted
        self.report_every_s = max(0.05, answer.report_every_s)
        # From the answer's arrival, not the report's: never earlier than the leader's own.
        self.settling_until = time.monotonic() + answer.settling_s

    async def sync(self) -> bool:
        """One exchange, shared by every caller while it runs; True when it was answered."""
        task = self._sync
        if task is None or task.done():
            task = self._sync = asyncio.get_running_loop().create_task(self._exchange())
        return await asyncio.shield(task)

    async def _exchange(self) -> bool:
        now = time.monotonic()
        report = self.report(now)
        try:
            answer = await self.exchange(report)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.failures += 1
            if self.failures == 1 or self.failures % 60 == 0:
                log.warning("cannot exchange limit shares with the control plane (%d failures;"
                            " enforcing the last shares): %s", self.failures, exc)
            return False
        self.failures = 0
        self.apply(answer, now)
        return True

    async def run(self) -> None:
        """Report every ``report_every_s`` (the control plane sets it), with no
        counter too: a live point is kept a part of every limit (llmgw.allowance)."""
        while True:
            await self.sync()  # at once at the start: the leader counts this point in
            await asyncio.sleep(self.report_every_s)
