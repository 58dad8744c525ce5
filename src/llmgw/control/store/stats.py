"""How the store's write transactions went: timed and counted where they all pass.

Kept by the Store itself (Store.transaction) rather than by its callers, so
that no write path (the fenced one, elections, migrations of settings) can
be missed; the control plane's /metrics reads it (llmgw.control.metrics).
"""

from __future__ import annotations

from llmgw.promkit import Histogram

# A write waits for SQLite's lock (busy timeout 5 s) or a PostgreSQL commit.
WRITE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class WriteStats:
    def __init__(self) -> None:
        self.seconds = Histogram(WRITE_BUCKETS)
        self.errors: dict[str, int] = {}

    def record(self, seconds: float, outcome: str) -> None:
        """A write transaction ended: ``ok``, ``error``, ``stale_epoch`` or ``aborted``.

        Only committed writes are timed: a refused one says nothing about how
        long the store takes. ``aborted`` (the caller's own exception, or a
        cancellation) is no fault of the store and is not counted at all.
        """
        if outcome == "ok":
            self.seconds.observe(seconds)
        elif outcome != "aborted":
            self.errors[outcome] = self.errors.get(outcome, 0) + 1
