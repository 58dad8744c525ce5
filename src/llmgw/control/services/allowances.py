"""The gateways' shares of every key's and team's limits (llmgw.allowance).

The book lives in the leader's memory: a new leader starts an empty one (the
points report what they enforce, and it settles before it grants more), and
the calendar windows' counts so far come from the store's usage rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from llmgw.allowance import HOLD_S, REPORT_EVERY_S, SETTLE_S, AllowanceBook
from llmgw.control.services.core import Core
from llmgw.control.services.keys import ApiKeys
from llmgw.control.services.teams import Teams
from llmgw.wire import AllowanceAnswer, AllowanceReport, LimitKind, TenantLimits

KEY_PREFIX = "key:"
TEAM_PREFIX = "team:"


class Allowances:
    def __init__(
        self, core: Core, keys: ApiKeys, teams: Teams, *,
        clock: Callable[[], float] = time.monotonic,
        hold_s: float = HOLD_S, settle_s: float = SETTLE_S,
        report_every_s: float = REPORT_EVERY_S,
    ) -> None:
        self.core = core
        self.keys = keys
        self.teams = teams
        self.clock = clock
        self.hold_s, self.settle_s, self.report_every_s = hold_s, settle_s, report_every_s
        self._book: AllowanceBook | None = None
        self._book_epoch = -1

    @property
    def book(self) -> AllowanceBook:
        """This leadership's book: a new epoch starts a new one, which settles first."""
        epoch = self.core.epoch
        if self._book is None or epoch != self._book_epoch:
            self._book = AllowanceBook(hold_s=self.hold_s, settle_s=self.settle_s,
                                       report_every_s=self.report_every_s, now=self.clock())
            self._book_epoch = epoch
        return self._book

    @property
    def current_book(self) -> AllowanceBook | None:
        """The book as it is, never a new one (metrics; a standby has none)."""
        return self._book if self.core.is_leader else None

    async def exchange(self, report: AllowanceReport) -> AllowanceAnswer:
        self.core.require_leader()
        return await self.book.exchange(report, self.clock(), self._limit_of, self._base_of)

    def _holder(self, subject: str) -> TenantLimits | None:
        if subject.startswith(KEY_PREFIX):
            key = self.keys.find(subject[len(KEY_PREFIX):])
            return key if key is not None and not key.revoked else None
        if subject.startswith(TEAM_PREFIX):
            return self.teams.find(subject[len(TEAM_PREFIX):])
        return None

    def _limit_of(self, subject: str, kind: LimitKind) -> float | None:
        holder = self._holder(subject)
        return holder.limit_of(kind) if holder is not None else None

    async def _base_of(self, subject: str, kind: LimitKind, window: int) -> float:
        if subject.startswith(KEY_PREFIX):
            tokens, spend = await self.core.store.consumed(
                since=window, key_id=subject[len(KEY_PREFIX):])
        else:
            tokens, spend = await self.core.store.consumed(
                since=window, team_id=subject[len(TEAM_PREFIX):])
        return spend if kind == "budget" else float(tokens)
