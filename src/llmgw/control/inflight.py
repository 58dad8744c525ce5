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


# A busy replica's last-use time moves with every gateway report (each second
# or so); storing each move would be a row update per busy replica per second.
# The store gets a replica's use when it turns busy or quiet, and otherwise
# once its last-use time has moved this far from the stored one: a standby
# (which reads only the store) then shows a busy replica as busy, and its idle
# times trail the leader's by at most this plus its own refresh, far below the
# summary's 10-minute idle threshold.
ACTIVITY_SLACK_S = 30.0

# (requests in flight, last used) of one replica, as stored or as known now.
Activity = tuple[int, float | None]


class StoredActivity:
    """What the store holds of each replica's use, and which rows a flush must update.

    The leader alone knows requests in flight (gateways report to it); a
    standby builds its summary from the store, where only the replica rows
    written for other reasons carried any use, so a replica streaming one
    long request read as idle there while the leader rightly kept it.
    """

    def __init__(self, slack_s: float = ACTIVITY_SLACK_S) -> None:
        self.slack_s = slack_s
        self._held: dict[str, Activity] = {}

    def stored(self, activity: dict[str, Activity]) -> None:
        """Note what the store now holds (rows read at load, or just written)."""
        self._held.update(activity)

    def due(self, current: dict[str, Activity]) -> dict[str, Activity]:
        """The replicas of ``current`` whose stored use is out of date enough to write.

        Replicas not in ``current`` (removed) are forgotten.
        """
        for gone in [rid for rid in self._held if rid not in current]:
            del self._held[gone]
        out: dict[str, Activity] = {}
        for rid, (in_flight, last_used) in current.items():
            held = self._held.get(rid)
            if held is None:
                out[rid] = (in_flight, last_used)
                continue
            held_in_flight, held_used = held
            moved = (last_used or 0.0) - (held_used or 0.0)
            if (in_flight > 0) != (held_in_flight > 0) or moved >= self.slack_s:
                out[rid] = (in_flight, last_used)
        return out
