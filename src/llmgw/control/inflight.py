"""Requests in flight per replica, summed over the gateways that report them.

Each gateway reports only the requests it proxies. With two or more gateways
(one per zone, or a hot spare), taking each report as the replica's whole
count let the last reporter win: a gateway with nothing in flight erased
another's long request, and the replica read as idle -- in the summary's
idle list, and to the scheduler that unloads idle replicas -- while it was
streaming. So counts are kept per gateway and summed.

A gateway that stops reporting (stopped, crashed, cut off) would otherwise
keep its last count forever and pin the replica as busy; its counts are
dropped once older than :data:`STALE_AFTER_S`.
"""

from __future__ import annotations

from collections.abc import Container

# Many report intervals (the gateway's default is 1 s), so a slow report or a
# GC pause does not make a busy replica look idle; short next to the idle
# threshold (minutes), so a dead gateway pins nothing for long.
STALE_AFTER_S = 30.0


class InFlightBook:
    """replica id -> gateway id -> (requests in flight, when reported)."""

    def __init__(self, stale_after_s: float = STALE_AFTER_S) -> None:
        self.stale_after_s = stale_after_s
        self._counts: dict[str, dict[str, tuple[int, float]]] = {}

    def record(self, replica_id: str, gateway_id: str, in_flight: int, now: float) -> int:
        """Note one gateway's count; returns the replica's total over fresh reports."""
        per_gateway = self._counts.setdefault(replica_id, {})
        per_gateway[gateway_id] = (max(0, in_flight), now)
        total = 0
        for gateway, (count, at) in list(per_gateway.items()):
            if now - at > self.stale_after_s:
                del per_gateway[gateway]
            else:
                total += count
        return total

    def forget_except(self, live: Container[str]) -> None:
        """Drop the counts of replicas that no longer exist."""
        for gone in [rid for rid in self._counts if rid not in live]:
            del self._counts[gone]
