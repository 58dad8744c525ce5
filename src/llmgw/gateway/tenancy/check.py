"""The request path's hook: may this key (and its team) start a request now; charge it after.

``admit`` is called once the model is known, before anything is routed;
``charge`` once the answer's usage is counted. Everything else about limits
lives in this package, so the request path holds two calls.

Refusals are OpenAI's: 429 ``rate_limit_exceeded`` for requests and tokens
per minute, 429 ``insufficient_quota`` for token quotas and budgets (what
OpenAI answers when an account's quota or credit runs out), each naming the
limit and whose it is, with ``Retry-After``. A limit whose share this worker
could not get (the control plane unreachable since before its first
request) is answered 503 ``limits_unavailable``: refused, never unlimited.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from datetime import UTC, datetime

from llmgw import wire
from llmgw.gateway.checks.auth import KeyRecord, Refusal
from llmgw.gateway.tenancy.point import RESYNC_S, SYNC_WAIT_S, Counter, EnforcementPoint
from llmgw.gateway.tenancy.windows import period_bounds, period_name

UNAVAILABLE_RETRY_S = 2.0
# A request waits this long at most for a new leader to settle (llmgw.allowance.SETTLE_S).
SETTLE_WAIT_S = 3.0
# ...and this long for room another worker holds while the fleet has some.
MOVE_WAIT_S = 2.5
# Exchanges one request may wait for, whatever the answers say.
MAX_ASKS = 6


def subjects(record: KeyRecord) -> Iterator[tuple[str, str, wire.TenantLimits]]:
    """(subject, who for messages, limits) of the key and of its team, where they have any."""
    if record.limits is not None:
        yield f"key:{record.key_id}", "this API key", record.limits
    team = record.team
    if team is not None and record.team_limited:
        yield f"team:{team.team_id}", f"team `{team.name}`", team


class TenantCheck:
    def __init__(self, point: EnforcementPoint) -> None:
        self.point = point

    def _counters(self, record: KeyRecord, at: float) -> list[tuple[Counter, str,
                                                                     wire.TenantLimits]]:
        point = self.point
        found = []
        for subject, who, limits in subjects(record):
            for kind in wire.LIMIT_KINDS:
                limit = limits.limit_of(kind)
                if limit is None:
                    continue
                counter = point.counter(subject, kind, limit)
                if not counter.sliding:
                    counter.roll(*period_bounds(kind, limits.budget_period, at))
                found.append((counter, who, limits))
        return found

    async def admit(self, record: KeyRecord) -> Refusal | None:
        """None when the request may start (one request counted), else why not."""
        if record.limits is None and not record.team_limited:
            return None
        counters = self._counters(record, time.time())
        now = time.monotonic()
        for counter, _, _ in counters:
            counter.wanted.add(1.0, now)
            counter.last_attempt = now
        # Room the fleet has but another worker holds comes back within
        # two reports (the holder's cut share, then its confirmation): worth
        # waiting for rather than refusing. A leader settling lends more only
        # once it has heard every point.
        wait_until = now + MOVE_WAIT_S
        for _ in range(MAX_ASKS):
            blocked = self._first_blocked(counters, now)
            if blocked is None:
                for counter, _, _ in counters:
                    if counter.kind == "rpm":
                        counter.add(1.0, now)
                return None
            counter, who, limits, unknown = blocked
            settling = self.point.settling_until - now
            if unknown:
                pass  # ask for a first share below
            elif 0 < settling <= SETTLE_WAIT_S:
                await asyncio.sleep(settling + 0.01)
            elif not counter.exhausted and now < wait_until:
                await asyncio.sleep(min(self.point.report_every_s, wait_until - now))
            elif now - counter.synced_at >= RESYNC_S:
                pass  # a stale answer: ask once more before refusing
            else:
                return self._refusal(counter, who, limits, unknown, now)
            try:
                async with asyncio.timeout(SYNC_WAIT_S):
                    answered = await self.point.sync()
            except TimeoutError:
                answered = False
            if not answered:
                return self._refusal(counter, who, limits, counter.share is None, now)
            now = time.monotonic()
        return self._refusal(counter, who, limits, counter.share is None, now)

    @staticmethod
    def _first_blocked(counters: list[tuple[Counter, str, wire.TenantLimits]], now: float
                       ) -> tuple[Counter, str, wire.TenantLimits, bool] | None:
        for counter, who, limits in counters:
            room = counter.room(now)
            if room is not True:
                return counter, who, limits, room is None
        return None

    def charge(self, record: KeyRecord, price: wire.ModelPrice | None, prompt: int,
               completion: int) -> None:
        """Count an answer's tokens and cost against the key's and team's limits."""
        if record.limits is None and not record.team_limited:
            return
        tokens = float(prompt + completion)
        cost = price.cost(prompt, completion) if price is not None else 0.0
        now = time.monotonic()
        for counter, _, _ in self._counters(record, time.time()):
            if counter.kind == "budget":
                if cost:
                    counter.add(cost, now)
            elif counter.kind != "rpm" and tokens:
                counter.add(tokens, now)

    def _refusal(self, counter: Counter, who: str, limits: wire.TenantLimits, unknown: bool,
                 now: float) -> Refusal:
        if unknown:
            return Refusal(503, "limits_unavailable", "server_error",
                           f"The limits of {who} cannot be checked: this gateway has not reached"
                           " the control plane yet. Please try again shortly.",
                           UNAVAILABLE_RETRY_S)
        limit = counter.limit
        if counter.sliding:
            wait = max(0.1, counter.used.frees_in(now))
            name = ("requests per minute (RPM)" if counter.kind == "rpm"
                    else "tokens per minute (TPM)")
            return Refusal(429, "rate_limit_exceeded",
                           "requests" if counter.kind == "rpm" else "tokens",
                           f"Rate limit reached for {who} on {name}: limit {limit:g}."
                           f" Please try again in {wait:.1f}s.", wait)
        wait = max(1.0, counter.window_end - time.time())
        renews = datetime.fromtimestamp(counter.window_end, UTC).strftime("%Y-%m-%d %H:%M UTC")
        period = period_name(counter.kind, limits.budget_period)
        if counter.kind == "budget":
            message = (f"The {period} budget of {who} (${limit:,.2f}) is spent; it renews"
                       f" at {renews}.")
        else:
            message = (f"The {period} token quota of {who} ({limit:,.0f} tokens) is used up;"
                       f" it renews at {renews}.")
        return Refusal(429, "insufficient_quota", "insufficient_quota", message, wait)
