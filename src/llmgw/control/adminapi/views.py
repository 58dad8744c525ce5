"""What the admin API shows of nodes, replicas and models.

The listings and the fleet summary are built from these views and from
nothing else (summary.py), so the two can never disagree: if a GPU is free
in ``ctl nodes`` it is free in ``ctl status``.

Views are plain slotted dataclasses rather than pydantic models, and they are
serialised with orjson. The summary must stay under 50 ms at 2,000 nodes x 8
GPUs; building 16,000 validated pydantic objects alone took ~50 ms on the
project's machines, the same objects as dataclasses ~11 ms. FastAPI still
derives their JSON schema (through pydantic) for the OpenAPI document.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

from llmgw.control.state import FleetState, ModelRecord, NodeRecord, ReplicaRecord
from llmgw.wire import (
    Device,
    DownloadProgress,
    ModelSpec,
    NodeInventory,
    ReplicaState,
    device_label,
)

DeviceStatus = Literal["free", "used", "unhealthy", "unplaceable"]


@dataclass(slots=True)
class DeviceView:
    """One placeable device: a card, a MIG instance (``0/mig1``) or a CPU slot."""

    number: int
    label: str
    gpu_class: str
    uuid: str
    name: str
    # free, used (by ``used_by``), unhealthy, or unplaceable (healthy but
    # unable to take work, e.g. a card in MIG mode with nothing carved).
    status: DeviceStatus
    used_by: str | None
    healthy: bool
    unhealthy_reasons: list[str]
    placeable: bool
    unplaceable_reason: str | None
    memory_total_mib: int
    memory_used_mib: int
    temperature_c: int | None
    power_w: float | None
    # None for MIG instances: the card cannot say, and 0 would claim idle.
    utilization_pct: int | None
    mig_profile: str | None


@dataclass(slots=True)
class ClassCount:
    """A node's devices of one class.

    ``unhealthy`` counts every device that is neither used nor available:
    unhealthy ones and healthy ones that cannot be placed (a MIG card with
    nothing carved). Counting either as free is how a node looks like it has
    room it does not have, and counting them as used blames replicas for it.
    """

    gpu_class: str
    total: int
    used: int
    free: int
    unhealthy: int


@dataclass(slots=True)
class NodeView:
    name: str
    # ready, cordoned, draining, or unreachable (derived: no recent report).
    state: str
    admin_state: str
    address: str
    agent_port: int | None
    fabrics: list[str]
    registered_at: float
    last_seen: float | None
    source: str | None
    driver_version: str | None
    warnings: list[str]
    # Empty in the summary's pass, which needs only the counts below (built
    # by the same loop, so they are the same numbers either way).
    devices: list[DeviceView]
    classes: list[ClassCount]
    # Devices of every class, CPU slots included (what a CPU replica is
    # placed on); "gpu" because that is what they are on a GPU node.
    gpu_total: int
    gpu_used: int
    gpu_free: int
    gpu_unhealthy: int
    # Models whose weights this node holds locally.
    models: list[str]
    replicas: list[str]
    refused: dict[str, str]


@dataclass(slots=True)
class ShardView:
    node: str
    rank: int
    devices: list[str]  # labels: "0", "0/mig1", "cpu0"
    device_numbers: list[int]


@dataclass(slots=True)
class ReplicaView:
    id: str
    model: str
    state: str
    draining: bool
    generation: int
    nodes: list[str]
    shards: list[ShardView]
    port: int | None
    url: str | None
    reason: str | None
    created_at: float
    ready_at: float | None
    last_request_at: float | None
    # Whole seconds since the last request (or since ready); None before ready.
    idle_seconds: int | None
    gpus: int
    in_flight: int
    # From the agent's latest status: weights download and the engine's log.
    download: DownloadProgress | None
    log_tail: list[str] = field(default_factory=list)


@dataclass(slots=True)
class ModelView:
    name: str
    spec: ModelSpec
    on_demand: bool
    min_replicas: int
    max_replicas: int
    # What it should have now: clamp(min, demand, max); see desired_now.
    desired: int
    # Asked for within its idle timeout (on-demand models).
    demanded: bool
    load_demand: int
    ready: int
    starting: int
    draining: int
    failed: int
    # Replicas serving or on their way to it: ready + starting.
    total: int
    parked: bool
    failures: int
    last_error: str | None
    # The one line to show: why parked, why unplaceable, or the last error.
    reason: str | None
    # The scheduler could not place what it is short of (never for a parked
    # model: that one is not being placed at all, and says why).
    unplaceable: bool
    unplaceable_reason: str | None


@dataclass(slots=True)
class FleetViews:
    nodes: list[NodeView]
    replicas: list[ReplicaView]
    models: list[ModelView]


# -- desired replicas -----------------------------------------------------------


def demanded(model: ModelRecord, now: float) -> bool:
    """Asked for recently enough that its idle timeout has not run out."""
    return model.demand_at is not None and now - model.demand_at <= model.spec.idle_timeout_s


def desired_now(model: ModelRecord, now: float, last_used: float | None = None) -> int:
    """clamp(min, demand, max): what the model should have now.

    Against this, not the minimum: an on-demand model's minimum is 0, so one
    that was asked for and fits nowhere would otherwise count as satisfied.
    The rule is the scheduler's (scheduler/decide.py), so that the summary's
    "short" is what the reconciler is working on; a test pins the two
    together. An on-demand model is in demand when asked for within its idle
    timeout, or while one of its live replicas was used (or started) within
    it (``last_used``: ReplicaTally.last_used); load demand is extra on top.
    """
    spec = model.spec
    if spec.on_demand:
        in_use = last_used is not None and now - last_used < spec.idle_timeout_s
        base = 1 if demanded(model, now) or in_use else 0
    else:
        base = spec.min_replicas
    return max(spec.min_replicas, min(base + max(0, model.load_demand), spec.max_replicas))


# -- garbage collection -------------------------------------------------------------


@contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection while a view or summary is built and serialised.

    Building views allocates tens of thousands of short-lived objects. If a
    collection runs while they are alive it promotes them, and every few
    calls that triggers a full collection over the whole fleet state (about
    260,000 objects at 2,000 nodes): 120-300 ms on this project's machines,
    measured, which alone would be the summary's p99. Views hold no
    reference cycles, so with the collector paused every one of them is
    freed by reference counting as soon as the answer's bytes exist, and
    the allocation count is back where it was. Synchronous code only: the
    pause must never span an ``await``.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# -- nodes ------------------------------------------------------------------------
#
# The builders below are generators on purpose. The summary folds each view
# into its totals and drops it, so a summary of 2,000 nodes keeps a handful of
# objects alive instead of tens of thousands; alive ones would be promoted by
# the garbage collector and trigger full collections of the whole fleet
# state, which cost 120-300 ms here (measured) and would be the p99.


def _device_status(device: Device, holder: str | None) -> DeviceStatus:
    # Unhealthy first: a replica still holding a device that went bad is not
    # "using" capacity anyone can count on.
    if not device.healthy:
        return "unhealthy"
    if not device.placeable:
        return "unplaceable"
    return "free" if holder is None else "used"


def _device_view(device: Device, status: DeviceStatus, holder: str | None) -> DeviceView:
    return DeviceView(
        number=device.number,
        label=device.label,
        gpu_class=device.gpu_class,
        uuid=device.uuid,
        name=device.name,
        status=status,
        used_by=holder,
        healthy=device.healthy,
        unhealthy_reasons=list(device.unhealthy_reasons),
        placeable=device.placeable,
        unplaceable_reason=device.unplaceable_reason,
        memory_total_mib=device.memory_total_mib,
        memory_used_mib=device.memory_used_mib,
        temperature_c=device.temperature_c,
        power_w=device.power_w,
        utilization_pct=device.utilization_pct,
        mig_profile=device.mig.profile if device.mig is not None else None,
    )


def used_by_node(state: FleetState) -> dict[str, dict[int, str]]:
    """node -> device number -> replica id: FleetState.used_devices(), grouped once
    per call so that each node looks up its own small dict."""
    out: dict[str, dict[int, str]] = {}
    for replica in state.replicas.values():
        rid = replica.id
        for shard in replica.shards:
            held = out.get(shard.node)
            if held is None:
                held = out[shard.node] = {}
            for number in shard.device_numbers:
                held[number] = rid
    return out


_NOTHING_HELD: dict[int, str] = {}


@dataclass(slots=True)
class _Counted:
    """A node's device-less view, and everything it was built from."""

    inputs: tuple[object, ...]
    view: NodeView


# node name -> its last device-less view. Between two summaries most nodes of
# a steady fleet change nothing, and building 2,000 views was half of a
# summary's time: a node whose inputs are the very objects used last time
# (compared by identity: inventories, fabric lists, weights and refusals are
# replaced, never edited in place, by ControlPlane.report) and whose state,
# heartbeat and held devices are equal gets the same view back. Any report
# changes last_seen and so rebuilds that node's view.
_COUNTED: dict[str, _Counted] = {}


def _count_devices(
    inventory: NodeInventory | None, held: dict[int, str], devices: list[DeviceView] | None
) -> tuple[list[ClassCount], tuple[int, int, int, int], list[str]]:
    holders: list[str] = []
    # class -> [total, used, free, unhealthy]; the hottest loop of the
    # summary, hence the inlined status and the reuse of the previous
    # device's row (a node's cards are mostly of one class).
    counts: dict[str, list[int]] = {}
    last_class, row = "", [0, 0, 0, 0]
    for device in inventory.devices if inventory is not None else ():
        gpu_class = device.gpu_class
        if gpu_class != last_class:
            found = counts.get(gpu_class)
            if found is None:
                found = counts[gpu_class] = [0, 0, 0, 0]
            last_class, row = gpu_class, found
        row[0] += 1
        holder = held.get(device.number) if held else None
        if holder is not None:
            holders.append(holder)
        if not device.healthy or not device.placeable:
            row[3] += 1
        elif holder is None:
            row[2] += 1
        else:
            row[1] += 1
        if devices is not None:
            devices.append(_device_view(device, _device_status(device, holder), holder))
    total = used_n = free = bad = 0
    classes: list[ClassCount] = []
    for gpu_class in sorted(counts) if len(counts) > 1 else counts:
        t, u, f, b = counts[gpu_class]
        classes.append(ClassCount(gpu_class, t, u, f, b))
        total += t
        used_n += u
        free += f
        bad += b
    return classes, (total, used_n, free, bad), holders


def node_view(
    node: NodeRecord,
    now: float,
    held: dict[int, str],
    *,
    with_devices: bool = True,
) -> NodeView:
    """One node; ``held`` is its entry of :func:`used_by_node`."""
    if with_devices:
        return _build_node_view(node, now, held, with_devices=True)
    state = node.state(now)
    inputs = (
        node.inventory, tuple(held.items()) if held else (), state, node.last_seen,
        node.admin_state, node.fabrics, node.weights, node.refused, node.address,
        node.agent_port,
    )
    counted = _COUNTED.get(node.name)
    # Tuple equality tries identity first, element by element, in C.
    if counted is None or counted.inputs != inputs:
        counted = _COUNTED[node.name] = _Counted(
            inputs, _build_node_view(node, now, held, with_devices=False)
        )
    return counted.view


def _build_node_view(
    node: NodeRecord, now: float, held: dict[int, str], *, with_devices: bool
) -> NodeView:
    inventory = node.inventory
    name = node.name
    devices: list[DeviceView] = []
    classes, totals, holders = _count_devices(inventory, held, devices if with_devices else None)
    total, used_n, free, bad = totals
    return NodeView(
        name=name,
        # Enum members are str: no .value lookups in the 2,000-node loop.
        state=node.state(now),
        admin_state=node.admin_state,
        address=node.address,
        agent_port=node.agent_port,
        fabrics=node.fabrics,
        registered_at=node.registered_at,
        last_seen=node.last_seen,
        source=inventory.source if inventory is not None else None,
        driver_version=inventory.driver_version if inventory is not None else None,
        warnings=inventory.warnings if inventory is not None else [],
        devices=devices,
        classes=classes,
        gpu_total=total,
        gpu_used=used_n,
        gpu_free=free,
        gpu_unhealthy=bad,
        models=sorted({w.model for w in node.weights}) if node.weights else [],
        replicas=sorted(set(holders)) if holders else [],
        refused=node.refused,
    )


def iter_node_views(
    state: FleetState, now: float, *, with_devices: bool = True
) -> Iterator[NodeView]:
    """Every node by name. The summary asks without device lists: the counts it
    reads are made by the same loop either way."""
    used = used_by_node(state)
    nodes = state.nodes
    if len(_COUNTED) > 2 * len(nodes) + 64:  # forget nodes that left the fleet
        for gone in [n for n in _COUNTED if n not in nodes]:
            del _COUNTED[gone]
    for name in sorted(nodes):
        yield node_view(nodes[name], now, used.get(name, _NOTHING_HELD),
                        with_devices=with_devices)


# -- replicas ---------------------------------------------------------------------

_LABELS: dict[int, str] = {}


def _label(number: int) -> str:
    # Device labels are a handful of distinct strings fleet-wide; formatting
    # each once keeps a 16,000-device pass from formatting 16,000 times.
    label = _LABELS.get(number)
    if label is None:
        label = _LABELS[number] = device_label(number)
    return label


def replica_view(
    replica: ReplicaRecord, nodes: dict[str, NodeRecord], now: float, *, detail: bool = True
) -> ReplicaView:
    """One replica. Without ``detail`` (the summary's pass) shards, URL, download
    and log stay empty; every count the summary reads is made the same way."""
    shards: list[ShardView] = []
    download: DownloadProgress | None = None
    log_tail: list[str] = []
    gpus = 0
    rid, generation = replica.id, replica.generation
    for shard in replica.shards:
        numbers = shard.device_numbers
        gpus += len(numbers)
        if not detail:
            continue
        shards.append(ShardView(shard.node, shard.rank, [_label(n) for n in numbers], numbers))
        # The leader shard (first) is looked at first: it is the one that
        # serves, and its log is the one that explains a failed start.
        node = nodes.get(shard.node)
        status = node.statuses.get(rid) if node is not None else None
        if status is None or status.generation != generation:
            continue
        if download is None and status.download is not None:
            download = status.download
        if not log_tail and status.log_tail:
            log_tail = status.log_tail
    port = replica.port
    url = None
    if detail and port and replica.shards:
        leader = nodes.get(replica.shards[0].node)
        url = f"http://{leader.address}:{port}" if leader is not None else None
    since = replica.last_request_at or replica.ready_at
    return ReplicaView(
        id=rid,
        model=replica.model,
        state=replica.state,
        draining=replica.draining,
        generation=generation,
        nodes=[s.node for s in shards],
        shards=shards,
        port=port,
        url=url,
        reason=replica.reason,
        created_at=replica.created_at,
        ready_at=replica.ready_at,
        last_request_at=replica.last_request_at,
        idle_seconds=None if since is None else int(max(0.0, now - since)),
        gpus=gpus,
        in_flight=replica.in_flight,
        download=download,
        log_tail=log_tail,
    )


# replica id -> (inputs, view) of its last detail-less view (the summary's), for
# the same reason as _COUNTED: most replicas change nothing between two
# summaries. Only the idle time moves with the clock; it is set on the reused
# view, which is safe because detail-less views are made for the summary's
# fold alone and never kept past it.
_REPLICA_VIEWS: dict[str, tuple[tuple[object, ...], ReplicaView]] = {}


def _replica_count_view(replica: ReplicaRecord, nodes: dict[str, NodeRecord],
                        now: float) -> ReplicaView:
    inputs = (
        replica.state, replica.draining, replica.generation, replica.shards, replica.port,
        replica.reason, replica.created_at, replica.ready_at, replica.last_request_at,
        replica.in_flight, replica.model,
    )
    cached = _REPLICA_VIEWS.get(replica.id)
    if cached is None or cached[0] != inputs:
        view = replica_view(replica, nodes, now, detail=False)
        _REPLICA_VIEWS[replica.id] = (inputs, view)
        return view
    view = cached[1]
    since = replica.last_request_at or replica.ready_at
    view.idle_seconds = None if since is None else int(max(0.0, now - since))
    return view


def iter_replica_views(
    state: FleetState, now: float, *, detail: bool = True
) -> Iterator[ReplicaView]:
    replicas, nodes = state.replicas, state.nodes
    if detail:
        for rid in sorted(replicas):
            yield replica_view(replicas[rid], nodes, now)
        return
    if len(_REPLICA_VIEWS) > 2 * len(replicas) + 64:  # forget removed replicas
        for gone in [r for r in _REPLICA_VIEWS if r not in replicas]:
            del _REPLICA_VIEWS[gone]
    for rid in sorted(replicas):
        yield _replica_count_view(replicas[rid], nodes, now)


class ReplicaTally:
    """Replicas per model and state, counted from replica views.

    Model views take their counts from here, so a model's ``ready`` is the
    number of ready replicas the replica listing shows for it.
    """

    __slots__ = ("_counts", "_last_used")

    def __init__(self, replicas: Iterable[ReplicaView] = ()) -> None:
        self._counts: dict[str, dict[str, int]] = {}
        self._last_used: dict[str, float] = {}
        for replica in replicas:
            self.add(replica)

    def add(self, replica: ReplicaView) -> None:
        model, state = replica.model, replica.state
        per_state = self._counts.get(model)
        if per_state is None:
            per_state = self._counts[model] = {}
        per_state[state] = per_state.get(state, 0) + 1
        if state in _LIVE and not replica.draining:
            # When it was last used, started or became ready; busy is now.
            latest = math.inf if replica.in_flight > 0 else max(
                replica.last_request_at or 0.0, replica.ready_at or 0.0, replica.created_at
            )
            if latest > self._last_used.get(model, -math.inf):
                self._last_used[model] = latest

    def of(self, model: str) -> dict[str, int]:
        return self._counts.get(model, {})

    def last_used(self, model: str) -> float | None:
        return self._last_used.get(model)


_LIVE = frozenset({ReplicaState.READY.value, ReplicaState.STARTING.value})


# -- models -----------------------------------------------------------------------


def model_view(model: ModelRecord, tally: ReplicaTally, now: float) -> ModelView:
    """One model, its replica counts taken from the replica views (``tally``)."""
    counts = tally.of(model.name)
    ready = counts.get(ReplicaState.READY.value, 0)
    starting = counts.get(ReplicaState.STARTING.value, 0)
    unplaceable = model.unplaceable_reason is not None and not model.parked
    if model.parked:
        reason = model.last_error
    elif unplaceable:
        reason = model.unplaceable_reason
    else:
        reason = model.last_error
    spec = model.spec
    return ModelView(
        name=model.name,
        spec=spec,
        on_demand=spec.on_demand,
        min_replicas=spec.min_replicas,
        max_replicas=spec.max_replicas,
        desired=desired_now(model, now, tally.last_used(model.name)),
        demanded=demanded(model, now),
        load_demand=model.load_demand,
        ready=ready,
        starting=starting,
        draining=counts.get(ReplicaState.DRAINING.value, 0),
        failed=counts.get(ReplicaState.FAILED.value, 0),
        total=ready + starting,
        parked=model.parked,
        failures=model.failures,
        last_error=model.last_error,
        reason=reason,
        unplaceable=unplaceable,
        unplaceable_reason=model.unplaceable_reason if unplaceable else None,
    )


def iter_model_views(state: FleetState, now: float, tally: ReplicaTally) -> Iterator[ModelView]:
    models = state.models
    for name in sorted(models):
        yield model_view(models[name], tally, now)


def fleet_views(state: FleetState, now: float, *, with_devices: bool = True) -> FleetViews:
    """Every view as lists: what the listings return."""
    replicas = list(iter_replica_views(state, now))
    return FleetViews(
        nodes=list(iter_node_views(state, now, with_devices=with_devices)),
        replicas=replicas,
        models=list(iter_model_views(state, now, ReplicaTally(replicas))),
    )
