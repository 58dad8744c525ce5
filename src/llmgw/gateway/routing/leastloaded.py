"""Least-loaded: the replica with the least work in flight from this gateway.

Load is requests in flight plus the prefill queued on the replica
(:meth:`Replica.load`), so one long prompt counts for more than a short
one. Also what the prefix policy falls back to for a request without a
prompt to route by.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmgw.gateway.routing.policy import UNROUTED, Pick, Policy
from llmgw.gateway.routing.replica import Replica


def least_loaded(replicas: Sequence[Replica], tokens_per_unit: float, start: int) -> Replica:
    """The least-loaded replica; ties go round-robin from ``start`` so idle replicas share."""
    count = len(replicas)
    best = replicas[start % count]
    best_load = best.load(tokens_per_unit)
    for offset in range(1, count):
        candidate = replicas[(start + offset) % count]
        load = candidate.load(tokens_per_unit)
        if load < best_load:
            best, best_load = candidate, load
    return best


class LeastLoaded(Policy):
    """``tokens_per_unit``: queued prefill tokens that weigh as one request in flight."""

    __slots__ = ("_units",)

    def __init__(self, tokens_per_unit: float) -> None:
        self._units = tokens_per_unit

    def choose(
        self, replicas: Sequence[Replica], prompt: str | None, turn: int,
        tokens: Sequence[int] | None = None,
    ) -> Pick:  # fmt: skip
        return Pick(least_loaded(replicas, self._units, turn), UNROUTED, [], 0.0)
