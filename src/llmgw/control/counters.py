"""The control plane's own counters: plain numbers, updated where the work happens.

Reconcile passes, placements and removals, agent reports: counted on the
event loop as ints and turned into Prometheus families only when scraped
(metrics.py, which also reads the fleet). Apart from that collector so the
services that count (services/core.py) do not depend on what it reads.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from llmgw.promkit import Histogram

if TYPE_CHECKING:
    from llmgw.control.reconciler import PassResult

# A pass is milliseconds on a small fleet and up to a second or two at
# 2,000 nodes; above that the reconcile interval itself is being missed.
PASS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def report_outcome(status: int) -> str:
    """An agent report's outcome, named by the answer's HTTP status."""
    if status == 200:
        return "accepted"
    if status == 401:
        return "unauthorized"  # unknown or revoked node token
    if status == 403:
        return "wrong_node"  # a node token speaking for another node
    if status in (400, 408, 413, 422):
        return "invalid"
    if status == 503:
        return "unavailable"  # a standby, or the store refused the write
    return "error"


class ControlMetrics:
    """The control plane's own counters; plain ints, updated from the event loop."""

    def __init__(self) -> None:
        self.pass_seconds = Histogram(PASS_BUCKETS)
        self.passes: dict[str, int] = {}
        self.last_pass_at: float | None = None
        self.placed: dict[str, int] = {}
        self.removed: dict[str, int] = {}
        self.reports: dict[str, int] = {}
        # How the report route read accepted reports (reportroute.py).
        self.report_reads: dict[str, int] = {}

    def reconcile_pass(self, seconds: float, outcome: str, result: PassResult | None) -> None:
        """One pass ended: ``ok``, ``error`` (retried next tick) or ``stale_epoch``."""
        self.pass_seconds.observe(seconds)
        _add(self.passes, outcome, 1)
        self.last_pass_at = time.time()
        if result is not None:
            for reason, count in result.placed_by.items():
                _add(self.placed, reason, count)
            for reason, count in result.removed_by.items():
                _add(self.removed, reason, count)

    def agent_report(self, status: int) -> None:
        _add(self.reports, report_outcome(status), 1)

    def report_read(self, path: str) -> None:
        _add(self.report_reads, path, 1)


def _add(counts: dict[str, int], key: str, n: int) -> None:
    counts[key] = counts.get(key, 0) + n
