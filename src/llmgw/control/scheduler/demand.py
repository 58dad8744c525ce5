"""How many replicas a model should have now, and how long a replica has been idle.

The admin views apply the same rule (desired_given, from adminapi/views/
models.py) so that the summary's "short" is what the reconciler is working
on; a test pins the two together.
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
    in_use = spec.on_demand and any(idle_for(r, now) < spec.idle_timeout_s for r in replicas)
    return desired_given(record, now, in_use=in_use)


def desired_given(record: ModelRecord, now: float, *, in_use: bool) -> int:
    """clamp(min, demand, max) once the caller knows whether a replica is in use.

    The one rule both the reconciler (:func:`desired_count`) and the admin
    views (which know use from replica views) apply; ``in_use`` only matters
    for an on-demand model.
    """
    spec = record.spec
    if spec.external is not None or spec.is_adapter:
        # Servers elsewhere, or an adapter loaded on its base's replicas
        # (control.adapters): nothing of its own to place or keep.
        return 0
    base = spec.min_replicas
    if spec.on_demand:
        base = 1 if in_use or asked_for(record, now) else 0
    return max(spec.min_replicas, min(base + max(0, record.load_demand), spec.max_replicas))


def asked_for(record: ModelRecord, now: float) -> bool:
    """Asked for recently enough that its idle timeout has not run out."""
    return record.demand_at is not None and now - record.demand_at <= record.spec.idle_timeout_s


def idle_for(replica: ReplicaRecord, now: float) -> float:
    """Seconds since it was last used, became ready or was created; 0 while busy."""
    if replica.in_flight > 0:
        return 0.0
    latest = max(replica.last_request_at or 0.0, replica.ready_at or 0.0, replica.created_at)
    return max(0.0, now - latest)
