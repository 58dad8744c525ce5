"""How many replicas a model should have now, and how long a replica has been idle.

The admin views show the same count (adminapi/views/models.py, desired_now)
so that the summary's "short" is what the reconciler is working on; a test
pins the two together.
"""

from __future__ import annotations

from llmgw.control.state import ModelRecord, ReplicaRecord


def desired_count(record: ModelRecord, replicas: list[ReplicaRecord], now: float) -> int:
    """clamp(min, demand, max).

    An on-demand model is in demand when a request asked for it within its
    idle timeout, or while one of its replicas is busy or was used within
    it; load-driven scale-up (``load_demand``, extra replicas the gateways'
    load calls for) is added on top of that, or of the minimum for an
    always-on model.
    """
    spec = record.spec
    if spec.on_demand:
        asked = record.demand_at is not None and now - record.demand_at <= spec.idle_timeout_s
        in_use = any(idle_for(r, now) < spec.idle_timeout_s for r in replicas)
        base = 1 if asked or in_use else 0
    else:
        base = spec.min_replicas
    return max(spec.min_replicas, min(base + max(0, record.load_demand), spec.max_replicas))


def idle_for(replica: ReplicaRecord, now: float) -> float:
    """Seconds since it was last used, became ready or was created; 0 while busy."""
    if replica.in_flight > 0:
        return 0.0
    latest = max(replica.last_request_at or 0.0, replica.ready_at or 0.0, replica.created_at)
    return max(0.0, now - latest)
