"""Node views: each node's devices, counted by class, with who holds them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from llmgw.control import telemetry
from llmgw.control.adminapi.views.memo import Memo, forget_gone
from llmgw.control.state import FleetState, NodeRecord
from llmgw.wire import Device, NodeInventory, device_label

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
        label=device_label(device.number, device.gpu_class),
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
    """node -> device number -> replica id, for every device a replica holds;
    grouped by node so that each node looks up its own small dict."""
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

# node name -> its last device-less view (see memo.py). Any report changes
# last_seen and so rebuilds that node's view.
_COUNTED: Memo[NodeView] = {}


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
    """One node; ``held`` is its entry of :func:`used_by_node`. Without devices
    the view is the memoised one while the node's inputs are unchanged."""
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
    if counted is None or counted[0] != inputs:
        counted = _COUNTED[node.name] = (
            inputs, _build_node_view(node, now, held, with_devices=False)
        )
    return counted[1]


def _build_node_view(
    node: NodeRecord, now: float, held: dict[int, str], *, with_devices: bool
) -> NodeView:
    inventory = node.inventory
    name = node.name
    devices: list[DeviceView] = []
    classes, totals, holders = _count_devices(inventory, held, devices if with_devices else None)
    readings = telemetry.current(inventory, node.readings)
    if readings is not None and devices:
        # Newer than the devices' own (control.telemetry); apart from the
        # counting loop, which reads none of them.
        for index, view in enumerate(devices):
            (view.memory_used_mib, view.utilization_pct, view.temperature_c,
             view.power_w) = readings.of(index)
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
        warnings=([f"waiting for approval: llmgw ctl nodes approve {name}"]
                  if node.pending_approval else [])
        + ([f"reports fabrics {','.join(node.reported_fabrics) or 'none'}; kept"
            f" {','.join(node.fabrics) or 'none'} (set by an operator)"]
           if node.fabrics_pinned and node.reported_fabrics != node.fabrics else [])
        + ([f"reports fabrics {','.join(node.reported_fabrics)}; not used until an"
            f" operator sets them: llmgw ctl nodes fabrics {name}"
            f" {' '.join(node.reported_fabrics)}"]
           if not node.fabrics_pinned and node.reported_fabrics != node.fabrics else [])
        + (inventory.warnings if inventory is not None else []),
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
    forget_gone(_COUNTED, nodes)
    for name in sorted(nodes):
        yield node_view(nodes[name], now, used.get(name, _NOTHING_HELD),
                        with_devices=with_devices)
