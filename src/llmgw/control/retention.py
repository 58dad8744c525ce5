"""How long events and usage are kept, and the leader's pruning of older rows.

Both tables only ever grew: a busy gateway writes a usage row per key, model
and minute, and a fleet of thousands of nodes an event for every node that
comes and goes. Without a bound the store (and every backup of it) grows
forever, and a slow query over all of it is what an operator finds first.

The defaults keep what people look back for: 30 days of events (an
incident's history, a node's recent failures) and 400 days of usage (a year
of billing, with a month to spare for the year-over-year report). Zero keeps
a table forever. Only the leader prunes, once soon after it starts leading
and then every ``every_s``; deleting old rows is idempotent, so a pass
repeated by a new leader after a failover does no harm.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from llmgw.control.store.repo import Store
from llmgw.control.writes import FencedWrites
from llmgw.errors import ConfigError

log = logging.getLogger(__name__)

DAY_S = 86400.0


@dataclass(frozen=True)
class Retention:
    events_days: float = 30.0
    usage_days: float = 400.0
    # An hour: rows a little past their age cost nothing, and a pass is one
    # indexed range delete per table.
    every_s: float = 3600.0

    def __post_init__(self) -> None:
        for name in ("events_days", "usage_days"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0 keeps everything)")
        if self.every_s <= 0:
            raise ConfigError("the retention interval must be > 0 seconds")


async def prune(
    store: Store | FencedWrites, retention: Retention, now: float | None = None) -> tuple[int, int]:
    """Delete events and usage older than the retention; (events, usage rows) deleted."""
    now = time.time() if now is None else now
    events = usage = 0
    if retention.events_days > 0:
        events = await store.prune_events(before_at=now - retention.events_days * DAY_S)
    if retention.usage_days > 0:
        cutoff = int(now - retention.usage_days * DAY_S) // 60 * 60
        usage = await store.prune_usage(before_minute=cutoff)
    if events or usage:
        log.info("retention: deleted %d events and %d usage rows", events, usage)
    return events, usage
