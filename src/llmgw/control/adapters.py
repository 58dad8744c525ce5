"""Which LoRA adapters each replica of a base model should have loaded.

An adapter takes no devices: it lives in its base's engine, in one of that
engine's adapter slots (vLLM's --max-loras). Loading one costs the engine a
read of a few MB and a copy to the device (seconds at most), a small price
next to a replica's cold start, so adapters are loaded where asked for and
kept while used; when a replica's slots are full the least recently used
adapter there makes room. The answer is a pure function of the fleet
(``plan_adapters``), applied by the reconciler after each pass (the
assignments carry the lists, agent.loras loads and unloads) and shown by
the planner and the summary, so the three cannot disagree.

Use is the adapter's ``demand_at``: a request that waited for it (the
gateway's demand) or its usage reported by a gateway (services/gateways).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel, Field

from llmgw.control.adaptercheck import lora_slots
from llmgw.control.scheduler.demand import asked_for
from llmgw.control.state import FleetState, ModelRecord, ReplicaRecord
from llmgw.wire import EngineKind, ModelSpec, ReplicaState


class AdapterPlacement(BaseModel):
    """One base model's adapters, as the plan and the summary show them."""

    base: str
    adapters: int  # in the catalog
    slots_per_replica: int
    # Replica id -> the adapters it should have loaded (least recently used first).
    loaded: dict[str, list[str]] = Field(default_factory=dict)
    # Adapter -> why it is asked for and loaded nowhere.
    not_loaded: dict[str, str] = Field(default_factory=dict)


@dataclass
class AdapterPlan:
    # Replica id -> its new list, for replicas whose list changes.
    changes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    bases: dict[str, AdapterPlacement] = field(default_factory=dict)


def plan_adapters(state: FleetState, now: float) -> AdapterPlan:
    plan = AdapterPlan()
    by_base: dict[str, list[ModelRecord]] = {}
    for record in state.models.values():
        if record.spec.base is not None:
            by_base.setdefault(record.spec.base, []).append(record)
    for base_name in sorted(by_base):
        base = state.models.get(base_name)
        if base is None:
            continue
        _plan_base(state, base, sorted(by_base[base_name], key=lambda m: m.name), now, plan)
    return plan


def _serving(state: FleetState, replica: ReplicaRecord, now: float) -> bool:
    """A replica adapters can be loaded on: ready, not stopping, reachable (asleep is fine:
    the adapter is loaded as it wakes)."""
    return (
        replica.state is ReplicaState.READY
        and not replica.draining
        and state.reachable(replica, now)
    )


def _plan_base(
    state: FleetState, base: ModelRecord, adapters: list[ModelRecord], now: float,
    plan: AdapterPlan,
) -> None:
    slots_info = lora_slots(base.spec)
    slots = slots_info.max_loras if slots_info is not None else 0
    known = {a.name: a for a in adapters}
    replicas = sorted(
        (r for r in state.replicas_of(base.name) if _serving(state, r, now)), key=lambda r: r.id
    )
    if base.spec.engine is EngineKind.LLAMA_SERVER:
        _plan_started(base, adapters, replicas, plan)
        return
    placement = plan.bases[base.name] = AdapterPlacement(
        base=base.name, adapters=len(adapters), slots_per_replica=slots
    )
    wanted = {a.name: _wanted_count(a, now) for a in adapters}

    def recency(name: str) -> float:
        record = known.get(name)
        return (record.demand_at or 0.0) if record is not None else 0.0

    lists: dict[str, list[str]] = {}
    for replica in replicas:
        current = replica.adapters if replica.adapters is not None else ()
        # Deleted, no longer wanted anywhere, or refused by this engine: unloaded.
        kept = [
            name for name in current
            if name in known and wanted[name] > 0 and name not in replica.adapter_errors
        ]
        lists[replica.id] = kept
    count = {name: sum(name in kept for kept in lists.values()) for name in known}
    # Most recently asked for first: a burst for a new adapter takes the
    # slot of one nobody asked for in a while, never the other way round.
    for adapter in sorted(adapters, key=lambda a: (-(a.demand_at or 0.0), a.name)):
        name = adapter.name
        while count[name] < min(wanted[name], len(replicas)):
            target = _soonest(replicas, lists, name, slots, recency)
            if target is None:
                break
            chosen = lists[target.id]
            if len(chosen) >= slots:
                victim = min(chosen, key=recency)
                chosen.remove(victim)
                count[victim] -= 1
            chosen.append(name)
            count[name] += 1
        if wanted[name] > 0 and count[name] == 0:
            placement.not_loaded[name] = _why_not(base, adapter, replicas, slots)
    for replica in replicas:
        ordered = tuple(sorted(lists[replica.id], key=lambda n: (recency(n), n)))
        placement.loaded[replica.id] = list(ordered)
        if replica.adapters is None or set(ordered) != set(replica.adapters):
            plan.changes[replica.id] = ordered


def _plan_started(
    base: ModelRecord, adapters: list[ModelRecord], replicas: list[ReplicaRecord],
    plan: AdapterPlan,
) -> None:
    """A base whose engine takes its adapters at its start (llama-server): each replica
    serves those it started with, all of them at once, and loads no other."""
    placement = plan.bases[base.name] = AdapterPlacement(
        base=base.name, adapters=len(adapters), slots_per_replica=len(adapters)
    )
    known = {a.name for a in adapters}
    for replica in replicas:
        served = tuple(sorted(known & replica.loaded_adapters))
        placement.loaded[replica.id] = list(served)
        if replica.adapters is None or set(served) != set(replica.adapters):
            plan.changes[replica.id] = served
    for adapter in adapters:
        if not any(adapter.name in served for served in placement.loaded.values()):
            placement.not_loaded[adapter.name] = _why_not(base, adapter, replicas, len(adapters))


def adapter_load_demand(state: FleetState, adapter: ModelRecord, busy: float) -> int:
    """1 when every replica holding the adapter (and in use now) has more than ``busy``
    requests in flight: it is then loaded on one more replica of its base (bounded by
    its max_replicas), which the gateway shares its requests with. Per replica, not per
    adapter: the gateways count requests by engine, and an adapter used now on an
    engine that is full is worth a slot elsewhere."""
    holders = [r for r in state.replicas_of(adapter.spec.base or "")
               if adapter.name in r.loaded_adapters]  # fmt: skip
    return int(bool(holders) and all(r.in_flight > busy for r in holders))


def _wanted_count(adapter: ModelRecord, now: float) -> int:
    """On how many base replicas it should be loaded: clamp(min, demand, max)."""
    spec = adapter.spec
    # Load asks for more only while the adapter is in use: an idle one is unloaded.
    demand = 1 + max(0, adapter.load_demand) if asked_for(adapter, now) else 0
    return max(spec.min_replicas, min(demand, spec.max_replicas))


def _soonest(
    replicas: list[ReplicaRecord], lists: dict[str, list[str]], name: str, slots: int,
    recency: Callable[[str], float],
) -> ReplicaRecord | None:
    """The replica that can serve ``name`` soonest: awake before asleep, a free slot
    before an unload, then the least busy; one whose engine refused it never."""
    best: tuple[tuple[float, ...], ReplicaRecord] | None = None
    for replica in replicas:
        chosen = lists[replica.id]
        if name in chosen or name in replica.adapter_errors or slots < 1:
            continue
        full = len(chosen) >= slots
        # The slot to be freed is the least recently used one here, and only
        # one used less recently than this adapter: otherwise two adapters
        # would take each other's slot pass after pass.
        victim_use = min((recency(n) for n in chosen), default=0.0) if full else 0.0
        if full and victim_use >= recency(name):
            continue
        key = (float(not replica.awake), float(full), victim_use, float(replica.in_flight))
        if best is None or key < best[0]:
            best = (key, replica)
    return best[1] if best is not None else None


def _why_not(
    base: ModelRecord, adapter: ModelRecord, replicas: list[ReplicaRecord], slots: int
) -> str:
    if slots < 1:
        return f"its base {base.name!r} serves no adapters"
    if not replicas:
        return f"no ready replica of its base {base.name!r}"
    errors = [r.adapter_errors[adapter.name] for r in replicas if adapter.name in r.adapter_errors]
    if errors:
        return (f"refused by {len(errors)} of {len(replicas)} replica(s) of {base.name!r}:"
                f" {errors[0]}")
    return (f"every adapter slot of {base.name!r} holds an adapter used more recently"
            f" ({len(replicas)} replica(s), {slots} slot(s) each)")


# Adapters a node is told to hold ahead of need, per report: the most
# recently used first. A few tens of MB each, so dozens cost little disk;
# capped so that a base with thousands of adapters does not fill a node's cache.
PREFETCH_MAX = 32


class AdapterIndex:
    """Each base's adapters with weights to fetch, rebuilt when the catalog changes.

    Every report's answer asks it (``prefetch_for``), so it must not walk the
    whole catalog each time: the catalog's table counts its writes
    (modeltable.py), and the index is rebuilt only when that count moved.
    Not on the routing version: that moves with every node turning
    unreachable or back, which a loaded 10,000-node fleet did on nearly
    every report.
    """

    def __init__(self) -> None:
        # The table the index was built from and its write count then.
        self._built: tuple[object, int] | None = None
        self._by_base: dict[str, list[ModelRecord]] = {}
        self._every: dict[str, tuple[ModelSpec, ...]] = {}

    def of(self, state: FleetState) -> dict[str, list[ModelRecord]]:
        """Each base's adapters whose weights a node fetches (not local, not none)."""
        self._build(state)
        return self._by_base

    def every(self, state: FleetState, base: str) -> tuple[ModelSpec, ...]:
        """All of ``base``'s adapters in the catalog, by name."""
        self._build(state)
        return self._every.get(base, ())

    def _build(self, state: FleetState) -> None:
        models = state.models
        # FleetState makes every catalog a ModelTable; -1 (rebuilt each
        # time) for a plain dict put in its place afterwards.
        key = (models, getattr(models, "version", -1))
        built = self._built
        if built is None or built[0] is not models or built[1] != key[1] or key[1] < 0:
            self._built = key
            self._by_base = {}
            every: dict[str, list[ModelSpec]] = {}
            for record in sorted(models.values(), key=lambda r: r.name):
                spec = record.spec
                if spec.base is None:
                    continue
                every.setdefault(spec.base, []).append(spec)
                if spec.weights.kind not in ("none", "local"):
                    self._by_base.setdefault(spec.base, []).append(record)
            self._every = {base: tuple(specs) for base, specs in every.items()}


def prefetch_for(state: FleetState, node: str, index: AdapterIndex) -> list[ModelSpec]:
    """The adapters whose weights ``node`` should hold before any is asked for: those of
    the bases it runs a replica of, most recently used first."""
    by_base = index.of(state)
    if not by_base:
        return []
    bases = {r.model for r in state.replicas.on_node(node) if r.state is not ReplicaState.FAILED}
    found = [a for base in sorted(bases) for a in by_base.get(base, ())]
    found.sort(key=lambda a: (-(a.demand_at or 0.0), a.name))
    return [a.spec for a in found[:PREFETCH_MAX]]
