"""Counting over a sliding minute and over calendar periods (UTC day, ISO week, month).

The sliding count never counts less than the true count of the last 60 s:
it keeps amounts in half-second slots and counts a slot until all of it has
left the window, so it may count up to half a second longer. That errs
toward refusing: a limit is never passed because of the slots.
"""

from __future__ import annotations

from collections import deque
from datetime import UTC, datetime, timedelta

from llmgw.wire import BudgetPeriod, LimitKind

WINDOW_S = 60.0
SLOT_S = 0.5


class SlidingCount:
    """Amounts added over the last minute (monotonic seconds)."""

    __slots__ = ("_slots", "total")

    def __init__(self) -> None:
        self._slots: deque[list[float]] = deque()  # [slot index, amount]
        self.total = 0.0

    def _expire(self, now: float) -> None:
        # A slot [i*SLOT, (i+1)*SLOT) leaves when its end is a window ago.
        oldest = (now - WINDOW_S) / SLOT_S - 1
        slots = self._slots
        while slots and slots[0][0] <= oldest:
            self.total -= slots.popleft()[1]
        if not slots:
            self.total = 0.0  # no float drift left behind

    def add(self, amount: float, now: float) -> None:
        self._expire(now)
        index = float(int(now / SLOT_S))
        slots = self._slots
        if slots and slots[-1][0] == index:
            slots[-1][1] += amount
        else:
            slots.append([index, amount])
        self.total += amount

    def count(self, now: float) -> float:
        self._expire(now)
        return self.total

    def frees_in(self, now: float) -> float:
        """Seconds until the oldest amount leaves the window (0 when empty)."""
        self._expire(now)
        if not self._slots:
            return 0.0
        return max(0.0, (self._slots[0][0] + 1) * SLOT_S + WINDOW_S - now)


def period_bounds(kind: LimitKind, budget_period: BudgetPeriod, at: float) -> tuple[int, int]:
    """The calendar window (start, end) in unix seconds, UTC, that ``at`` falls in."""
    period = {"tokens_day": "day", "tokens_month": "month"}.get(kind, budget_period)
    moment = datetime.fromtimestamp(at, UTC)
    day = moment.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        start, end = day, day + timedelta(days=1)
    elif period == "week":
        start = day - timedelta(days=day.weekday())
        end = start + timedelta(days=7)
    else:
        start = day.replace(day=1)
        end = (start + timedelta(days=32)).replace(day=1)
    return int(start.timestamp()), int(end.timestamp())


def period_name(kind: LimitKind, budget_period: BudgetPeriod) -> str:
    period = {"tokens_day": "day", "tokens_month": "month"}.get(kind, budget_period)
    return {"day": "daily", "week": "weekly", "month": "monthly"}[period]
