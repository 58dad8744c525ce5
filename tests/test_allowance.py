"""The control plane's book of limit shares (llmgw/allowance.py), driven by simulated points.

Points that obey their shares, report at uneven times, lose reports and come and go:
whatever they do, the fleet never admits more than an RPM limit in any 60 s, and a
quota is passed by no more than each point's request in flight when its share ran out.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque

import pytest

from llmgw.allowance import AllowanceBook
from llmgw.wire import AllowanceReport, AllowanceUse, LimitKind

STEP_S = 0.25


class Point:
    def __init__(self, name: str, kind: LimitKind) -> None:
        self.name = name
        self.kind = kind
        self.share = 0.0
        self.admitted: deque[tuple[float, float]] = deque()  # (time, amount)
        self.total = 0.0
        self.wanted: deque[float] = deque()

    def count(self, now: float) -> float:
        if self.kind == "rpm":
            while self.admitted and self.admitted[0][0] <= now - 60.0:
                self.admitted.popleft()
            return sum(amount for _, amount in self.admitted)
        return self.total

    def try_admit(self, now: float, cost: float) -> bool:
        self.wanted.append(now)
        if self.kind == "rpm":
            if self.count(now) + 1 > self.share + 1e-9:
                return False
            self.admitted.append((now, 1.0))
            return True
        if self.total >= self.share:
            return False
        self.total += cost  # charged at once: an answer in flight for one step
        return True

    def report(self, now: float) -> AllowanceReport:
        while self.wanted and self.wanted[0] <= now - 60.0:
            self.wanted.popleft()
        return AllowanceReport(point=self.name, uses=[AllowanceUse(
            subject="key:k", kind=self.kind, window=0, used=self.count(now),
            wanted=float(len(self.wanted)), enforced=self.share)])


async def simulate(seed: int, kind: LimitKind, limit: float, seconds: float
                   ) -> tuple[list[tuple[float, str]], list[Point]]:
    rng = random.Random(seed)
    book = AllowanceBook(settle_s=0.0, hold_s=90.0, now=0.0)
    points = [Point(f"p{i}", kind) for i in range(4)]
    live = set(range(4))
    admitted: list[tuple[float, str]] = []

    async def base(*_: object) -> float:
        return 0.0

    now = 0.0
    while now < seconds:
        for index in list(live):
            point = points[index]
            for _ in range(rng.choice((0, 0, 1, 2, 5))):
                if point.try_admit(now, float(rng.randint(10, 40))):
                    admitted.append((now, point.name))
            if rng.random() < 0.3:  # reports at uneven times; some answers lost
                answer = await book.exchange(point.report(now), now, lambda s, k: limit, base)
                if rng.random() < 0.9:
                    point.share = answer.shares[0].share if answer.shares else point.share
        if rng.random() < 0.01 and len(live) > 2:  # a worker goes away, a new one comes
            live.discard(rng.choice(sorted(live)))
            points.append(Point(f"p{len(points)}", kind))
            live.add(len(points) - 1)
        now += STEP_S
    return admitted, points


@pytest.mark.parametrize("seed", range(6))
def test_requests_never_pass_the_rpm_in_any_minute(seed: int) -> None:
    admitted, _ = asyncio.run(simulate(seed, "rpm", 60.0, 240.0))
    times = sorted(t for t, _ in admitted)
    first = 0
    worst = 0
    for last, at in enumerate(times):
        while at - times[first] >= 60.0:
            first += 1
        worst = max(worst, last - first + 1)
    assert worst <= 60
    assert len(admitted) >= 120  # and the limit is used, not starved (4 minutes of 60 allowed)


@pytest.mark.parametrize("seed", range(6))
def test_a_quota_is_passed_by_at_most_one_request_per_point(seed: int) -> None:
    _, points = asyncio.run(simulate(seed, "tokens_day", 5000.0, 240.0))
    used = sum(p.total for p in points)
    assert used <= 5000.0 + 40.0 * len(points)
    assert used >= 5000.0 - 40.0 * len(points)  # and it was all lent out in the end


def test_a_silent_point_keeps_its_claim_until_held_long_enough() -> None:
    async def run() -> None:
        book = AllowanceBook(settle_s=0.0, hold_s=120.0, now=0.0)

        async def base(*_: object) -> float:
            return 0.0

        def report(point: str, used: float, enforced: float) -> AllowanceReport:
            return AllowanceReport(point=point, uses=[AllowanceUse(
                subject="key:k", kind="rpm", window=0, used=used, wanted=100, enforced=enforced)])

        first = await book.exchange(report("a", 0, 0), 0.0, lambda s, k: 60.0, base)
        assert first.shares[0].share == 60.0  # alone: all of it
        # a goes silent holding 60; b gets nothing while a may still be admitting.
        later = await book.exchange(report("b", 0, 0), 60.0, lambda s, k: 60.0, base)
        assert later.shares[0].share == 0.0
        gone = await book.exchange(report("b", 0, 0), 121.0, lambda s, k: 60.0, base)
        assert gone.shares[0].share == 60.0

    asyncio.run(run())
