"""Fleet-wide limits: the control plane lends each gateway worker a share of every limit.

Why: a limit checked in each gateway process gives a key its limit once per
process (LiteLLM's best-known failure: a key gets its RPM times the number of
pods). Here every gateway worker process is an *enforcement point*; it
enforces only the share of each limit the control plane lent it, and the
shares never add up to more than the limit.

The invariant, per limit (a subject, ``key:<id>`` or ``team:<id>``, and a
kind: rpm, tpm, tokens per day or month, budget) and window:

    base + sum over points of claim(point) <= limit

where a point's *claim* bounds what it can have counted in the window: the
largest of what it reported using, the share it says it enforces, and the
share last sent to it (it may not have applied a smaller one yet). A point
admits a request only while its own count is under its share, so the sum of
the points' counts, the fleet's use, stays under the limit:

* rpm and tpm are sliding 60 s windows. A point's count is what it admitted
  (rpm) or was charged (tpm) in the last 60 s; it only falls as time passes,
  so a claim taken at a report still bounds the point until the next one.
  Shares move only out of what is free: a point whose share is cut keeps
  its claim at what it used until those requests leave its window, so no
  request admitted under an old share is ever counted twice.
* tokens per UTC day or month and budgets in dollars are calendar windows.
  ``base`` is what the store says was used in the window when the ledger
  was opened, plus what points that left used; a point's claim is what it
  used since it joined (``used - joined_at``) or its share, if larger.

Over-admission comes only from what a point counts after admitting: tokens
and dollars are known when the answer ends, so a point that admitted while
under its share can pass it by the requests it had in flight. Request
counts are exact. What this costs: a point whose share is cut waits for its
own requests to age out before another point may use them, and a point with
no share asks for one before its first request of a limit (one round trip).

Shares follow demand: the part of the limit not yet used is split between
the points holding it in proportion to ``wanted + 1`` (requests asked for in
the last minute, refused included), and each live point not yet holding the
limit is counted as wanting one, so a point that sees its first request of a
key finds some of the limit free. A calendar quota is lent a little at a
time (HORIZON_S). Each answer says whether the fleet as a whole has used the
limit up (``exhausted``): a point refused while it has not waits for the
shares to move instead of refusing at once.

Points that go silent keep their claim for ``hold_s``, then lose it (their
used tokens and dollars go to ``base``): a partitioned gateway keeps
enforcing its last share meanwhile and after (never unlimited), so beyond
``hold_s`` of partition the fleet may admit that gateway's share on top of
the limit. A new leader knows no claims: for ``settle_s`` it grants no point
more than it says it enforces, while the points report theirs (a request
that finds no room meanwhile waits for the end of it and asks again).

Pure: no I/O. The caller supplies the limits and, for calendar windows, the
store's count of the window so far (llmgw.control.services.allowances).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from llmgw.wire import AllowanceAnswer, AllowanceReport, AllowanceShare, AllowanceUse, LimitKind

SLIDING: frozenset[LimitKind] = frozenset({"rpm", "tpm"})
# A silent point's claims are kept this long: longer than a sliding window,
# so that what it admitted before it went silent has left every window.
HOLD_S = 120.0
# A new leader grants no increase for this long (see the module's docstring).
SETTLE_S = 2.0
REPORT_EVERY_S = 1.0
# A live point not yet holding a limit counts as wanting this much of it.
RESERVE_WEIGHT = 1.0
# Calendar windows: a point is lent at most what it used in this long (or
# an equal part of what is left).
HORIZON_S = 10.0

LedgerKey = tuple[str, LimitKind, int]
# The store's count of (subject, kind, window start): tokens or dollars.
BaseReader = Callable[[str, LimitKind, int], Awaitable[float]]


@dataclass(slots=True)
class Entry:
    """One point's standing in one ledger."""

    used: float = 0.0
    joined_at: float = 0.0  # calendar windows: its count when it joined (already in base)
    enforced: float = 0.0
    granted: float = 0.0
    wanted: float = 0.0
    seen_at: float = 0.0
    rate: float = 0.0  # calendar windows: what it uses a second, smoothed

    def observe(self, used: float, now: float) -> None:
        if self.seen_at and now > self.seen_at and used >= self.used:
            latest = (used - self.used) / (now - self.seen_at)
            self.rate = latest if self.rate == 0.0 else 0.7 * self.rate + 0.3 * latest
        self.used, self.seen_at = used, now

    def claim(self) -> float:
        return max(self.used, self.enforced, self.granted) - self.joined_at

    def used_since_joined(self) -> float:
        return max(0.0, self.used - self.joined_at)


@dataclass(slots=True)
class Ledger:
    limit: float
    sliding: bool
    base: float = 0.0
    entries: dict[str, Entry] = field(default_factory=dict)

    def release(self, point: str) -> None:
        """A point leaves: what it used in a calendar window stays counted."""
        entry = self.entries.pop(point, None)
        if entry is not None and not self.sliding:
            self.base += entry.used_since_joined()


class AllowanceBook:
    """Every ledger of the leader, and the points that report into them."""

    def __init__(self, *, hold_s: float = HOLD_S, settle_s: float = SETTLE_S,
                 report_every_s: float = REPORT_EVERY_S, now: float = 0.0) -> None:
        self.hold_s = hold_s
        self.report_every_s = report_every_s
        self.settled_at = now + settle_s
        self.ledgers: dict[LedgerKey, Ledger] = {}
        # Point -> the ledgers it holds an entry in, and when it last reported.
        self.holdings: dict[str, set[LedgerKey]] = {}
        self.points_seen: dict[str, float] = {}

    async def exchange(self, report: AllowanceReport, now: float,
                       limit_of: Callable[[str, LimitKind], float | None],
                       base_of: BaseReader) -> AllowanceAnswer:
        """Take a point's report and answer its shares (``now``: monotonic)."""
        self.expire(now)
        point = report.point
        self.points_seen[point] = now
        held = self.holdings.setdefault(point, set())
        reported: set[LedgerKey] = set()
        shares: list[AllowanceShare] = []
        for use in report.uses:
            limit = limit_of(use.subject, use.kind)
            if limit is None:
                continue  # no such limit (any more): the point's next config drops it
            key: LedgerKey = (use.subject, use.kind, use.window)
            ledger = self.ledgers.get(key)
            if ledger is None:
                sliding = use.kind in SLIDING
                base = 0.0 if sliding else await base_of(use.subject, use.kind, use.window)
                ledger = self.ledgers.setdefault(key, Ledger(limit=limit, sliding=sliding,
                                                             base=base))
            ledger.limit = limit
            reported.add(key)
            held.add(key)
            share = self._grant(ledger, point, use, now)
            # Less than one request left counts as none (requests count whole).
            left = ledger.limit - ledger.base - sum(
                e.used_since_joined() for e in ledger.entries.values())
            exhausted = left < 1.0 if use.kind == "rpm" else left <= 0.0
            shares.append(AllowanceShare(subject=use.subject, kind=use.kind, window=use.window,
                                         share=share, limit=limit, exhausted=exhausted))
        for key in held - reported:  # dropped by the point: it holds no share there now
            ledger = self.ledgers.get(key)
            if ledger is not None:
                ledger.release(point)
                self._forget_if_empty(key, ledger)
        self.holdings[point] = reported
        return AllowanceAnswer(shares=shares, report_every_s=self.report_every_s,
                               settling_s=max(0.0, self.settled_at - now))

    def _grant(self, ledger: Ledger, point: str, use: AllowanceUse, now: float) -> float:
        entry = ledger.entries.get(point)
        if entry is not None and not ledger.sliding and use.used < entry.used:
            # A count that went back: a new process under an old id (or a lost
            # release): what the old one used stays counted.
            ledger.release(point)
            entry = None
        if entry is None:
            entry = ledger.entries[point] = Entry(
                joined_at=0.0 if ledger.sliding else use.used)
        entry.observe(use.used, now)
        entry.wanted = use.wanted
        entry.enforced = max(entry.joined_at, use.enforced)
        pool = ledger.limit - ledger.base
        others = sum(e.claim() for p, e in ledger.entries.items() if p != point)
        unused = max(0.0, pool - sum(e.used_since_joined() for e in ledger.entries.values()))
        weights = {p: e.wanted + 1.0 for p, e in ledger.entries.items()}
        idle_points = sum(1 for p in self.points_seen if p not in ledger.entries)
        total_weight = sum(weights.values()) + idle_points * RESERVE_WEIGHT
        headroom = unused * weights[point] / total_weight
        if not ledger.sliding:
            # A day's or a month's quota is lent a little at a time: an
            # equal part, or what the point uses in HORIZON_S if more, so a
            # worker that sees the key next finds most of it free.
            live = max(1, len(self.points_seen))
            headroom = min(headroom, max(unused / live, HORIZON_S * entry.rate))
        own = entry.used_since_joined()
        if use.kind == "rpm":
            # Whole requests: fractions of a share admit nothing and would
            # leave the fleet short of its limit by up to one per point.
            grant: float = min(math.ceil(own + headroom - 1e-9),
                               math.floor(pool - others + 1e-9))
        else:
            grant = min(own + headroom, pool - others)
        if now < self.settled_at:
            grant = min(grant, entry.enforced - entry.joined_at)
        grant = max(0.0, grant)
        entry.granted = entry.joined_at + grant
        return entry.granted

    def expire(self, now: float) -> None:
        """Points silent for ``hold_s`` lose their claims."""
        gone = [p for p, at in self.points_seen.items() if now - at > self.hold_s]
        for point in gone:
            del self.points_seen[point]
            for key in self.holdings.pop(point, set()):
                ledger = self.ledgers.get(key)
                if ledger is not None:
                    ledger.release(point)
                    self._forget_if_empty(key, ledger)

    def _forget_if_empty(self, key: LedgerKey, ledger: Ledger) -> None:
        # Opened again, a calendar ledger reads its base from the store, which
        # by then holds what the points that left had flushed.
        if not ledger.entries:
            del self.ledgers[key]

    def claims(self, subject: str, kind: LimitKind, window: int) -> float:
        """base + every claim: what the invariant bounds (tests, metrics)."""
        ledger = self.ledgers.get((subject, kind, window))
        if ledger is None:
            return 0.0
        return ledger.base + sum(e.claim() for e in ledger.entries.values())
