"""One fault under steady load, and what it cost: the frame every fault runs in.

The frame: read the store's rows, start the load and an admin writer, let
the load settle, inject the fault, wait until the fleet is whole again,
keep the load a little longer, stop, and read the rows again once the
gateway's last usage batch is in.

How a failure is judged (chaoskit.verdict): a failure is excused only
by a replica the fault killed while the request was in flight there, of the
request's model, the failure arriving within seconds of the kill, and no
more of them than that replica held; a failure whose OpenAI error code says
no replica ever took the request (``upstream_unavailable``,
``model_not_ready``, ...) is never excused: those the gateway must retry
elsewhere or hold until a replica is there. Every other failure is
``failed_unexcused`` (target 0). ``recovery_s`` runs from the end of the
fault (the kill; the agent's restart; its SIGCONT; the disk filling up,
which stays full) until the fleet is first seen whole. The fault's verdict
(``ok`` and the reasons it failed) is chaoskit.verdict.reasons.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from chaoskit.fleet import Fleet
from chaoskit.load import Load, Record, Worker
from chaoskit.rows import AdminWriter, Lost, Rows, lost, settled_usage
from chaoskit.verdict import Judged, Kill, excused, reasons
from llmgw.control.state import UNREACHABLE_AFTER_S

# After an outage of the control plane, how long the fleet must stay whole:
# the unreachable grace plus a report interval, past which a node silent
# since the outage would have turned unreachable.
OUTAGE_WATCH_S = UNREACHABLE_AFTER_S + 7.0
# The gateway's usage batches (GatewaySettings.usage_flush_s): the most a
# crash of whoever holds a batch may lose.
USAGE_FLUSH_S = 2.0


@dataclass
class Injected:
    """What a fault did, for judging the requests and waiting for recovery."""

    # When the fault was over (time.monotonic()); recovery runs from here.
    ended: float = 0.0
    # Each replica killed: what it held in flight then may fail.
    kills: list[Kill] = field(default_factory=list)
    # Replicas whose engines the fault killed: not ready in a whole fleet.
    gone: set[str] = field(default_factory=set)
    # Nodes left dead: unreachable in a whole fleet.
    dead: set[str] = field(default_factory=set)
    # Agents restarted or resumed: whole once they reported again.
    resumed: set[str] = field(default_factory=set)
    # Whole must hold until then (time.monotonic()), not only be seen once:
    # after a control-plane outage nodes may turn unreachable a grace later.
    hold_until: float = 0.0
    # More to require of a whole fleet (the control plane's new epoch, ...).
    also: Callable[[], Awaitable[bool]] | None = None
    # Other loads whose requests count with the steady load's (slow readers).
    extra_loads: list[Load] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Figures of this fault's own, beside the common ones in the JSON.
    figures: dict[str, float | None] = field(default_factory=dict)
    # Called after the fleet was whole and the load stopped (restarting what
    # the fault killed, for the next fault); not measured.
    restore: Callable[[], Awaitable[None]] | None = None


@dataclass
class Outcome:
    name: str
    sent: int = 0
    failed: int = 0
    failed_unexcused: int = 0
    answered_after: int = 0
    recovery_s: float | None = None
    lost: Lost | None = None
    usage_bound: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    figures: dict[str, float | None] = field(default_factory=dict)
    skipped: str | None = None

    def judged(self) -> Judged:
        return Judged(
            sent=self.sent, failed=self.failed, failed_unexcused=self.failed_unexcused,
            answered_after=self.answered_after, recovery_s=self.recovery_s,
            lost=self.lost.as_json() if self.lost else None, usage_bound=self.usage_bound,
            figures=self.figures, skipped=self.skipped,
        )

    @property
    def reasons(self) -> list[str]:
        """Why this fault's run failed its verdict (empty: it passed)."""
        return reasons(self.judged())

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "ok": not self.reasons, "sent": self.sent, "failed": self.failed,
            "failed_unexcused": self.failed_unexcused, "answered_after": self.answered_after,
            "recovery_s": None if self.recovery_s is None else round(self.recovery_s, 2),
            "rows_lost": self.lost.as_json() if self.lost else None,
            "usage_bound": self.usage_bound,
        }
        out.update(self.figures)
        if self.skipped:
            out["skipped"] = self.skipped
        if self.reasons:
            out["failed_because"] = self.reasons
        return out

    def line(self) -> str:
        if self.skipped:
            return f"{self.name:26s} skipped: {self.skipped}"
        rec = "never" if self.recovery_s is None else f"{self.recovery_s:.1f} s"
        rows = self.lost
        lost_text = (f"catalog {rows.catalog}, keys {rows.keys}, events {rows.events},"
                     f" usage {rows.usage} (bound {self.usage_bound}"
                     f"{', counted twice ' + str(rows.usage_extra) if rows.usage_extra else ''})"
                     if rows else "not read")
        verdict = "ok" if not self.reasons else "FAILED: " + "; ".join(self.reasons)
        return (f"{self.name:26s} failed {self.failed}/{self.sent}"
                f" (unexcused {self.failed_unexcused}), whole again after {rec};"
                f" rows lost: {lost_text}; {verdict}")


@dataclass
class Frame:
    """What every fault runs against: the fleet, its load and the timings of the mode."""

    fleet: Fleet
    workers: list[Worker]
    settle_s: float
    after_s: float
    recovery_timeout_s: float = 240.0

    @property
    def database_url(self) -> str:
        return self.fleet.database_url

    async def run(self, name: str, inject: Callable[[Load], Awaitable[Injected]]) -> Outcome:
        fleet = self.fleet
        assert fleet.creds is not None
        outcome = Outcome(name)
        await asyncio.sleep(USAGE_FLUSH_S * 1.5)  # the previous load's last batch
        before = await asyncio.to_thread(Rows.read, self.database_url)
        load = Load(f"{fleet.gateway_url}/v1", fleet.creds.api_key, list(self.workers))
        writer = AdminWriter(fleet.api, f"probe-{name.replace('_', '-')}")
        injected = Injected()
        load.start()
        writer.start()
        try:
            began = time.monotonic()
            if not await load.wait_answers(len(self.workers) * 2, began, 120):
                raise RuntimeError(f"{name}: no steady load before the fault: "
                                   f"{_errors(load.records)}\n{fleet.logs()}")
            await asyncio.sleep(self.settle_s)
            injected = await inject(load)
            whole_at = await self._recovered(injected)
            outcome.recovery_s = None if whole_at is None else max(0.0, whole_at - injected.ended)
        finally:
            await writer.stop()
            for extra in injected.extra_loads:
                await extra.stop()
            await load.stop()
        records = [*load.records, *(r for x in injected.extra_loads for r in x.records)]
        self._judge(outcome, records, injected)
        outcome.answered_after = sum(1 for r in records if r.ok and r.sent >= injected.ended)
        answered = sum(1 for r in load.records if r.answered)
        after = await settled_usage(self.database_url, fleet.creds.api_key_id,
                                    before.usage[fleet.creds.api_key_id] + answered)
        outcome.lost = lost(before, after, writer, fleet.creds.api_key_id, answered)
        elapsed = max(1e-9, max((r.done for r in load.records), default=0) - began)
        outcome.usage_bound = int(answered / elapsed * USAGE_FLUSH_S + 0.999)
        if writer.refused:
            injected.notes.append(f"admin writes refused: {dict(writer.refused)}")
        outcome.notes, outcome.figures = injected.notes, injected.figures
        await writer.clean_up()
        if injected.restore is not None:
            await injected.restore()
        return outcome

    async def _recovered(self, injected: Injected) -> float | None:
        """When the fleet became whole for good (time.monotonic()), or None.

        Whole must then hold through the after-window (and ``hold_until``):
        a relapse (a node turning unreachable a grace after a control-plane
        outage, say) moves recovery to when it was whole again.
        """
        fleet = self.fleet
        conditions: dict[str, Any] = {"dead": injected.dead, "resumed": injected.resumed,
                                      "since": injected.ended, "gone": injected.gone,
                                      "also": injected.also}
        whole_at = await fleet.wait_whole(self.recovery_timeout_s, **conditions)
        if whole_at is None:
            return None
        hold_until = max(whole_at + self.after_s, injected.hold_until)
        relapses = 0
        while time.monotonic() < hold_until:
            if not await fleet.whole(**conditions):
                relapses += 1
                whole_at = await fleet.wait_whole(self.recovery_timeout_s, **conditions)
                if whole_at is None:
                    break
                hold_until = max(hold_until, whole_at + self.after_s)
            await asyncio.sleep(0.25)
        if relapses:
            injected.notes.append(f"the fleet fell apart again {relapses} time(s) after it"
                                  " was first whole")
        return whole_at

    @staticmethod
    def _judge(outcome: Outcome, records: list[Record], injected: Injected) -> None:
        outcome.sent = len(records)
        failures = [r for r in records if not r.ok]
        outcome.failed = len(failures)
        outcome.failed_unexcused = len(failures) - len(excused(failures, injected.kills))
        for r in failures:
            key = r.code or re.sub(r"\d+", "N", (r.error or "?"))[:80]
            outcome.errors[key] = outcome.errors.get(key, 0) + 1


def _errors(records: list[Record]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        if not r.ok:
            out[r.error or "?"] = out.get(r.error or "?", 0) + 1
    return out


async def gateway_metric(fleet: Fleet, family: str, model: str) -> float | None:
    """One of the gateway's per-model figures from its /metrics (0 when not there yet)."""
    try:
        async with httpx.AsyncClient(timeout=5) as http:
            text = (await http.get(f"{fleet.gateway_url}/metrics")).text
    except httpx.HTTPError:
        return None
    match = re.search(rf'^{family}\{{model="{re.escape(model)}"\}} (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def gateway_in_flight(fleet: Fleet, model: str) -> int | None:
    """The gateway's requests in flight upstream for ``model``."""
    value = await gateway_metric(fleet, "llmgw_gateway_in_flight", model)
    return None if value is None else int(value)
