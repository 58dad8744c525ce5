"""How many gateways route with the table, counted from their load reports.

Gateways share no state, so where a new prompt prefix goes is where their
views of the replicas agree: by hash, with a wide tolerance for load. A
gateway that is the only one has nobody to agree with and can place a new
prefix on the replica that starts it soonest (an idle one rather than one
still decoding another answer); the routing table tells it so.

Every gateway reports its load about once a second. One that stops
reporting (stopped, crashed, cut off) is no longer counted after
STALE_AFTER_S, as its in-flight counts are dropped (control.inflight). A
control plane that has just started, or just taken over, answers 0
("cannot tell") until reports have come in for SETTLE_S: a count of 1 read
before the second gateway's first report would send both down the lone
path for a moment and leave second copies of the prefixes they placed.

Each gateway's last report is kept in brief (its totals, not its replicas)
so that operators can see which gateways the count is made of
(``GET /admin/v1/gateways``, ``llmgw ctl gateways``): a count of 2 where one
gateway was meant is otherwise invisible until the cache hit rate falls.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from llmgw.control.inflight import STALE_AFTER_S

# Several report intervals (the gateway's default is 1 s).
SETTLE_S = 5.0


Placement = Literal["by load", "by hash", "settling"]


def placement(count: int) -> Placement:
    """How gateways told ``count`` place a new prefix (gateway.snapshot: only 1 is alone)."""
    if count == 0:
        return "settling"  # gateways treat "not known yet" as several
    return "by load" if count == 1 else "by hash"


@dataclass(frozen=True, slots=True)
class LastReport:
    """One gateway's last load report in brief, and when it came (monotonic)."""

    at: float
    # Summed over the replicas it named: the requests it was proxying.
    in_flight: int = 0
    # Model -> requests waiting for a replica, as reported.
    waiting: Mapping[str, int] = field(default_factory=dict)


class GatewayCount:
    """gateway id -> its last load report; the count the table carries."""

    def __init__(self, stale_after_s: float = STALE_AFTER_S, settle_s: float = SETTLE_S) -> None:
        self.stale_after_s = stale_after_s
        self.settle_s = settle_s
        self._heard: dict[str, LastReport] = {}
        self._since: float | None = None
        self.count = 0

    def heard(self, gateway_id: str, now: float, in_flight: int = 0,
              waiting: Mapping[str, int] | None = None) -> bool:
        """Note a report from ``gateway_id`` at ``now``; True when :attr:`count` changed."""
        if self._since is None:
            self._since = now
        self._heard[gateway_id] = LastReport(now, in_flight, dict(waiting or {}))
        self._forget_stale(now)
        count = len(self._heard) if now - self._since >= self.settle_s else 0
        if count == self.count:
            return False
        self.count = count
        return True

    def reporting(self, now: float) -> dict[str, LastReport]:
        """The gateways not stale at ``now``, by id.

        Stale ones are forgotten here too: with no report coming at all (every
        gateway stopped) nothing else would, and they would be listed for ever.
        :attr:`count` stays what the table carries: changing it is a new table,
        which only a report makes.
        """
        self._forget_stale(now)
        return dict(self._heard)

    def _forget_stale(self, now: float) -> None:
        for gateway, report in list(self._heard.items()):
            if now - report.at > self.stale_after_s:
                del self._heard[gateway]
