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
"""

from __future__ import annotations

from llmgw.control.inflight import STALE_AFTER_S

# Several report intervals (the gateway's default is 1 s).
SETTLE_S = 5.0


class GatewayCount:
    """gateway id -> when its last load report came; the count the table carries."""

    def __init__(self, stale_after_s: float = STALE_AFTER_S, settle_s: float = SETTLE_S) -> None:
        self.stale_after_s = stale_after_s
        self.settle_s = settle_s
        self._heard: dict[str, float] = {}
        self._since: float | None = None
        self.count = 0

    def heard(self, gateway_id: str, now: float) -> bool:
        """Note a report from ``gateway_id`` at ``now``; True when :attr:`count` changed."""
        if self._since is None:
            self._since = now
        self._heard[gateway_id] = now
        for gateway, at in list(self._heard.items()):
            if now - at > self.stale_after_s:
                del self._heard[gateway]
        count = len(self._heard) if now - self._since >= self.settle_s else 0
        if count == self.count:
            return False
        self.count = count
        return True
