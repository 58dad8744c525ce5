"""One node as placement sees it, and the digest of its inventory behind it.

A PlacementNode is what filters and scorers read of a node: its devices by
class (free, usable, unhealthy, out of placement), the replicas per model
with a shard there, and its RAM. The parts that only the inventory decides
(``DeviceDigest``) are digested once per inventory object and shared by
every view built from it (``DeviceCache``): at 10,000 nodes, digesting
every inventory every pass was most of a pass. The snapshot (snapshot.py)
holds these views and the indexes over them.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from llmgw import memory
from llmgw.control.state import NodeRecord
from llmgw.memory import RamNeed
from llmgw.wire import CPU_CLASS, NodeInventory, NodeState


@dataclass(slots=True)
class DeviceDigest:
    """What a node's inventory says, independent of replicas and time.

    Shared (never mutated) by every PlacementNode built from the same
    inventory object; only the free lists are copied per node.
    """

    # Healthy, placeable devices no replica holds, lowest number first.
    free: dict[str, list[int]] = field(default_factory=dict)
    # Healthy and placeable devices (free or not): what the node could offer.
    capacity: dict[str, int] = field(default_factory=dict)
    # Every device of the class, healthy or not.
    total: dict[str, int] = field(default_factory=dict)
    unhealthy: dict[str, int] = field(default_factory=dict)
    out_of_placement: dict[str, int] = field(default_factory=dict)
    uuids: dict[int, str] = field(default_factory=dict)
    device_class: dict[int, str] = field(default_factory=dict)
    # Numbers of the healthy, placeable devices: only these can ever be freed,
    # so releasing a replica that sat on a now-unhealthy card cannot make that
    # card look free.
    placeable: set[int] = field(default_factory=set)
    capacity_total: int = 0


@dataclass(slots=True, kw_only=True)
class PlacementNode(DeviceDigest):
    """What placement needs to know about one node, by device class.

    The device maps it inherits are its inventory's digest, shared with the
    inventory cache and never changed, except ``free``, which is its own.
    Only ``free``, ``used``, ``replicas``, ``used_total`` and
    ``memory_used_mib`` change during a pass.
    """

    name: str
    state: NodeState
    fabrics: tuple[str, ...]
    weights: frozenset[str]
    used: dict[str, int] = field(default_factory=dict)
    # Replicas per model with a shard here (spreading).
    replicas: dict[str, int] = field(default_factory=dict)
    used_total: int = 0
    # The node's RAM (None: its agent does not say) and what the CPU
    # replicas placed here are charged for it (llmgw.memory).
    memory_total_mib: int | None = None
    memory_used_mib: int = 0
    # Whether the node's CPU computes bfloat16 natively (None: cannot tell):
    # what a vLLM shard on its CPU slots is charged depends on it.
    cpu_bf16: bool | None = None
    # The snapshot allowed to change this view in place (PlacementSnapshot._own).
    owner: object = None

    def free_count(self, gpu_class: str) -> int:
        free = self.free.get(gpu_class)
        return len(free) if free else 0

    @property
    def entirely_free(self) -> bool:
        return self.used_total == 0

    @property
    def memory_free_mib(self) -> int | None:
        if self.memory_total_mib is None:
            return None
        return self.memory_total_mib - self.memory_used_mib

    def hold(self, numbers: Collection[int], model: str, ram: RamNeed | None) -> None:
        """Mark these devices as held by a shard of ``model``; ``ram``: what a
        shard on CPU slots is charged in RAM (None: not placed against RAM).

        A device already held stays held: two replicas claiming one device
        (a report racing a pass) must not make it count twice.
        """
        free_by_class, used, device_class = self.free, self.used, self.device_class
        for number in numbers:
            gpu_class = device_class.get(number)
            if gpu_class is None:
                continue
            free = free_by_class.get(gpu_class)
            if free is not None and number in free:
                free.remove(number)
                used[gpu_class] = used.get(gpu_class, 0) + 1
                self.used_total += 1
        self.replicas[model] = self.replicas.get(model, 0) + 1
        if ram is not None and self.on_cpu(numbers):
            self.memory_used_mib += ram.on(self.cpu_bf16)

    def release_ram(self, numbers: Collection[int], ram: RamNeed | None) -> None:
        """Take back what ``hold`` charged a shard on these devices."""
        if ram is not None and self.on_cpu(numbers):
            self.memory_used_mib -= ram.on(self.cpu_bf16)

    def on_cpu(self, numbers: Iterable[int]) -> bool:
        """Whether a shard on these devices runs on CPU slots (and so in RAM)."""
        return any(self.device_class.get(n) == CPU_CLASS for n in numbers)


def copy_node(view: PlacementNode, owner: object) -> PlacementNode:
    """A view whose changing parts (free, used, replicas) are its own."""
    return _with_devices(
        view,
        name=view.name,
        state=view.state,
        fabrics=view.fabrics,
        weights=view.weights,
        used=dict(view.used),
        replicas=dict(view.replicas),
        used_total=view.used_total,
        memory_total_mib=view.memory_total_mib,
        memory_used_mib=view.memory_used_mib,
        cpu_bf16=view.cpu_bf16,
        owner=owner,
    )


def _with_devices(devices: DeviceDigest, **node: Any) -> PlacementNode:
    """A node view on ``devices``' maps (shared) and a copy of their free lists."""
    return PlacementNode(
        free={c: list(numbers) for c, numbers in devices.free.items()},
        capacity=devices.capacity,
        total=devices.total,
        unhealthy=devices.unhealthy,
        out_of_placement=devices.out_of_placement,
        uuids=devices.uuids,
        device_class=devices.device_class,
        placeable=devices.placeable,
        capacity_total=devices.capacity_total,
        **node,
    )


def _digest(inventory: NodeInventory | None) -> DeviceDigest:
    out = DeviceDigest()
    if inventory is None:
        return out
    # Locals, not attribute lookups: this runs for every device of every
    # node when a snapshot is first built (80,000 devices at 10,000 nodes).
    total, uuids, device_class = out.total, out.uuids, out.device_class
    capacity, free, placeable = out.capacity, out.free, out.placeable
    placeable_count = 0
    for device in inventory.devices:
        gpu_class = device.gpu_class
        number = device.number
        total[gpu_class] = total.get(gpu_class, 0) + 1
        uuids[number] = device.uuid
        device_class[number] = gpu_class
        # Unhealthy devices are neither used nor free: counting them as free is
        # how a fleet looks like it has room it does not have.
        if not device.healthy:
            out.unhealthy[gpu_class] = out.unhealthy.get(gpu_class, 0) + 1
        elif not device.placeable:
            out.out_of_placement[gpu_class] = out.out_of_placement.get(gpu_class, 0) + 1
        else:
            capacity[gpu_class] = capacity.get(gpu_class, 0) + 1
            numbers = free.get(gpu_class)
            if numbers is None:
                free[gpu_class] = [number]
            else:
                numbers.append(number)
            placeable.add(number)
            placeable_count += 1
    out.capacity_total = placeable_count
    for numbers in free.values():
        numbers.sort()
    return out


class DeviceCache:
    """Inventories already digested, by node, keyed by the inventory object.

    Digesting 2,000 inventories is most of a snapshot's cost, and between
    two passes almost none of them change. The key is the object itself:
    the control plane replaces a node's inventory when a report brings a
    different one and never edits it in place, so the same object means
    the same devices. (A report handler that replaces even equal
    inventories only costs hits, never correctness.)
    """

    def __init__(self) -> None:
        # node -> (the inventory object, its digest). Read directly by the
        # keeper's per-pass sweep of every node, where a method call per
        # node was a tenth of the sweep; written only through ``get``.
        self.entries: dict[str, tuple[NodeInventory | None, DeviceDigest]] = {}

    def get(self, node: NodeRecord) -> DeviceDigest:
        entry = self.entries.get(node.name)
        if entry is not None and entry[0] is node.inventory:
            return entry[1]
        devices = _digest(node.inventory)
        self.entries[node.name] = (node.inventory, devices)
        return devices

    def forget_missing(self, names: Iterable[str]) -> None:
        keep = set(names)
        for name in [n for n in self.entries if n not in keep]:
            del self.entries[name]


def placement_node(
    node: NodeRecord,
    now: float,
    cache: DeviceCache | None = None,
    state: NodeState | None = None,
) -> PlacementNode:
    """``state``: the node's ``state(now)``, when the caller has it already."""
    devices = cache.get(node) if cache is not None else _digest(node.inventory)
    return _with_devices(
        devices,
        name=node.name,
        state=node.state(now) if state is None else state,
        fabrics=tuple(node.fabrics),
        weights=frozenset(w.model for w in node.weights),
        memory_total_mib=_usable_ram(node.inventory),
        cpu_bf16=node.inventory.cpu_bf16 if node.inventory is not None else None,
    )


def _usable_ram(inventory: NodeInventory | None) -> int | None:
    if inventory is None or inventory.memory_total_mib is None:
        return None
    return memory.usable_mib(inventory.memory_total_mib)
