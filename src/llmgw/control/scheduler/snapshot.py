"""A point-in-time view of the fleet that placement reads and updates.

Placement must never consult the live FleetState: agent reports change it
while a pass runs, and a decision taken half on old and half on new facts is
how one device ends up given to two replicas. The snapshot is built once per
pass from FleetState, then placements and removals made during the pass are
applied to it (``allocate``/``release``) so later decisions see earlier ones.

It also keeps the indexes that make placement cheap at fleet scale: ready
nodes bucketed by their number of free devices per class, entirely free
nodes per class and fabric, and nodes per model whose weights they hold.
Without them every placement is a scan of every node, which at 2,000 nodes
and thousands of replicas turns a pass into seconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from llmgw import memory
from llmgw.control.state import FleetState, NodeRecord, ReplicaRecord
from llmgw.wire import CPU_CLASS, NodeInventory, NodeState

# An insertion-ordered set: iteration order must not depend on string hash
# seeds, or the planner and the reconciler could pick different nodes for the
# same state in two processes.
OrderedSet = dict[str, None]


@dataclass(slots=True)
class NodeView:
    """What placement needs to know about one node, by device class.

    Only ``free``, ``used``, ``replicas`` and ``used_total`` change during a
    pass; the other maps are shared with the inventory cache.
    """

    name: str
    state: NodeState
    fabrics: tuple[str, ...]
    weights: frozenset[str]
    # Healthy, placeable devices no replica holds, lowest number first.
    free: dict[str, list[int]] = field(default_factory=dict)
    # Healthy and placeable devices (free or not): what the node could offer.
    capacity: dict[str, int] = field(default_factory=dict)
    # Every device of the class, healthy or not.
    total: dict[str, int] = field(default_factory=dict)
    used: dict[str, int] = field(default_factory=dict)
    unhealthy: dict[str, int] = field(default_factory=dict)
    out_of_placement: dict[str, int] = field(default_factory=dict)
    uuids: dict[int, str] = field(default_factory=dict)
    device_class: dict[int, str] = field(default_factory=dict)
    # Numbers of the healthy, placeable devices: only these can ever be freed,
    # so releasing a replica that sat on a now-unhealthy card cannot make that
    # card look free.
    placeable: set[int] = field(default_factory=set)
    # Replicas per model with a shard here (spreading).
    replicas: dict[str, int] = field(default_factory=dict)
    used_total: int = 0
    capacity_total: int = 0
    # The node's RAM (None: its agent does not say) and what the CPU
    # replicas placed here are charged for it (llmgw.memory).
    memory_total_mib: int | None = None
    memory_used_mib: int = 0

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

    def on_cpu(self, numbers: Iterable[int]) -> bool:
        """Whether a shard on these devices runs on CPU slots (and so in RAM)."""
        return any(self.device_class.get(n) == CPU_CLASS for n in numbers)


class Snapshot:
    """Nodes by name plus the indexes over them; see the module docstring."""

    def __init__(
        self, now: float, nodes: dict[str, NodeView], ram_need: dict[str, int] | None = None
    ) -> None:
        self.now = now
        self.nodes = nodes
        # model -> MiB of RAM one shard on CPU slots is charged (llmgw.memory);
        # models absent here are not placed against RAM.
        self.ram_need = ram_need or {}
        # class -> free count -> ready nodes with exactly that many free.
        self._buckets: dict[str, dict[int, OrderedSet]] = {}
        # class -> fabric -> ready nodes with nothing placed on them.
        self._whole_free: dict[str, dict[str, OrderedSet]] = {}
        # model -> nodes holding its weights (any state).
        self._holders: dict[str, OrderedSet] = {}
        # class -> nodes having at least one device of it (any state).
        self._class_nodes: dict[str, OrderedSet] = {}
        # class -> what placement can see of the nodes having it (see
        # ``fingerprint``); dropped whenever one of those nodes changes.
        self._fingerprints: dict[str, tuple[object, ...]] = {}
        for view in nodes.values():
            for model in view.weights:
                self._holders.setdefault(model, {})[view.name] = None
            for gpu_class in view.total:
                self._class_nodes.setdefault(gpu_class, {})[view.name] = None
            self._index(view)

    # -- indexes ---------------------------------------------------------------

    def _index(self, view: NodeView) -> None:
        if view.state is not NodeState.READY:
            return
        for gpu_class, free in view.free.items():
            if free:
                self._buckets.setdefault(gpu_class, {}).setdefault(len(free), {})[view.name] = None
        if view.entirely_free:
            for gpu_class, cap in view.capacity.items():
                if cap:
                    by_fabric = self._whole_free.setdefault(gpu_class, {})
                    for fabric in view.fabrics:
                        by_fabric.setdefault(fabric, {})[view.name] = None

    def _unindex(self, view: NodeView) -> None:
        if view.state is not NodeState.READY:
            return
        for gpu_class, free in view.free.items():
            if free:
                bucket = self._buckets.get(gpu_class, {}).get(len(free))
                if bucket is not None:
                    bucket.pop(view.name, None)
                    if not bucket:
                        del self._buckets[gpu_class][len(free)]
        if view.entirely_free:
            for gpu_class in view.capacity:
                by_fabric = self._whole_free.get(gpu_class, {})
                for fabric in view.fabrics:
                    by_fabric.get(fabric, {}).pop(view.name, None)

    def buckets(self, gpu_class: str) -> Mapping[int, OrderedSet]:
        """Ready nodes by their number of free ``gpu_class`` devices."""
        return self._buckets.get(gpu_class, {})

    def whole_free(self, gpu_class: str) -> Mapping[str, OrderedSet]:
        """Ready, entirely free nodes with ``gpu_class`` devices, by fabric."""
        return self._whole_free.get(gpu_class, {})

    def holders(self, model: str) -> OrderedSet:
        return self._holders.get(model, {})

    def class_nodes(self, gpu_class: str) -> OrderedSet:
        return self._class_nodes.get(gpu_class, {})

    def fingerprint(self, gpu_class: str) -> tuple[object, ...]:
        """Everything a filter or an explanation reads of ``gpu_class`` nodes.

        Two snapshots with equal fingerprints for a request's classes (and
        the same number of nodes) give that request the same placement
        answer, which lets the reconciler reuse an "unplaceable" from the
        previous pass instead of explaining it again every pass.
        """
        found = self._fingerprints.get(gpu_class)
        if found is None:
            nodes = self.nodes
            found = tuple(
                (
                    name,
                    view.state,
                    len(view.free.get(gpu_class, ())),
                    view.capacity.get(gpu_class, 0),
                    view.total.get(gpu_class, 0),
                    view.used_total,
                    view.fabrics,
                    view.memory_free_mib,
                )
                for name in self._class_nodes.get(gpu_class, {})
                for view in (nodes[name],)
            )
            self._fingerprints[gpu_class] = found
        return found

    def _touched(self, view: NodeView) -> None:
        for gpu_class in view.total:
            self._fingerprints.pop(gpu_class, None)

    # -- changes made during a pass ---------------------------------------------

    def allocate(self, node: str, numbers: Iterable[int], model: str) -> None:
        """Mark devices of ``node`` as held by a replica of ``model``."""
        view = self.nodes[node]
        self._unindex(view)
        self._touched(view)
        taken = set(numbers)
        for number in taken:
            gpu_class = view.device_class.get(number)
            if gpu_class is None:
                continue
            free = view.free.get(gpu_class)
            if free is not None and number in free:
                free.remove(number)
                view.used[gpu_class] = view.used.get(gpu_class, 0) + 1
                view.used_total += 1
        view.replicas[model] = view.replicas.get(model, 0) + 1
        if model in self.ram_need and view.on_cpu(taken):
            view.memory_used_mib += self.ram_need[model]
        self._index(view)

    def release(self, node: str, numbers: Iterable[int], model: str) -> None:
        """Give the devices back, e.g. for a replica removed in this pass."""
        view = self.nodes.get(node)
        if view is None:
            return
        self._unindex(view)
        self._touched(view)
        given = set(numbers)
        if model in self.ram_need and view.on_cpu(given):
            view.memory_used_mib -= self.ram_need[model]
        for number in given:
            gpu_class = view.device_class.get(number)
            if gpu_class is None or number not in view.placeable:
                continue
            free = view.free.setdefault(gpu_class, [])
            if number in free:
                continue
            free.append(number)
            free.sort()
            view.used[gpu_class] -= 1
            view.used_total -= 1
        count = view.replicas.get(model, 0) - 1
        if count > 0:
            view.replicas[model] = count
        else:
            view.replicas.pop(model, None)
        self._index(view)

    def allocate_replica(self, replica: ReplicaRecord) -> None:
        for shard in replica.shards:
            if shard.node in self.nodes:
                self.allocate(shard.node, shard.device_numbers, replica.model)

    def release_replica(self, replica: ReplicaRecord) -> None:
        for shard in replica.shards:
            self.release(shard.node, shard.device_numbers, replica.model)


@dataclass(slots=True)
class _Devices:
    """What a node's inventory says, independent of replicas and time.

    Shared (never mutated) by every NodeView built from the same inventory
    object; only the free lists are copied per snapshot.
    """

    free: dict[str, list[int]] = field(default_factory=dict)
    capacity: dict[str, int] = field(default_factory=dict)
    total: dict[str, int] = field(default_factory=dict)
    unhealthy: dict[str, int] = field(default_factory=dict)
    out_of_placement: dict[str, int] = field(default_factory=dict)
    uuids: dict[int, str] = field(default_factory=dict)
    device_class: dict[int, str] = field(default_factory=dict)
    placeable: set[int] = field(default_factory=set)
    capacity_total: int = 0


def _devices(inventory: NodeInventory | None) -> _Devices:
    out = _Devices()
    if inventory is None:
        return out
    for device in inventory.devices:
        gpu_class = device.gpu_class
        out.total[gpu_class] = out.total.get(gpu_class, 0) + 1
        out.uuids[device.number] = device.uuid
        out.device_class[device.number] = gpu_class
        # Unhealthy devices are neither used nor free: counting them as free is
        # how a fleet looks like it has room it does not have.
        if not device.healthy:
            out.unhealthy[gpu_class] = out.unhealthy.get(gpu_class, 0) + 1
        elif not device.placeable:
            out.out_of_placement[gpu_class] = out.out_of_placement.get(gpu_class, 0) + 1
        else:
            out.capacity[gpu_class] = out.capacity.get(gpu_class, 0) + 1
            out.free.setdefault(gpu_class, []).append(device.number)
            out.placeable.add(device.number)
            out.capacity_total += 1
    for free in out.free.values():
        free.sort()
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
        self._entries: dict[str, tuple[NodeInventory | None, _Devices]] = {}

    def get(self, node: NodeRecord) -> _Devices:
        entry = self._entries.get(node.name)
        if entry is not None and entry[0] is node.inventory:
            return entry[1]
        devices = _devices(node.inventory)
        self._entries[node.name] = (node.inventory, devices)
        return devices

    def forget_missing(self, names: Iterable[str]) -> None:
        keep = set(names)
        for name in [n for n in self._entries if n not in keep]:
            del self._entries[name]


def node_view(node: NodeRecord, now: float, cache: DeviceCache | None = None) -> NodeView:
    devices = cache.get(node) if cache is not None else _devices(node.inventory)
    return NodeView(
        name=node.name,
        state=node.state(now),
        fabrics=tuple(node.fabrics),
        weights=frozenset(w.model for w in node.weights),
        free={c: list(numbers) for c, numbers in devices.free.items()},
        capacity=devices.capacity,
        total=devices.total,
        used={},
        unhealthy=devices.unhealthy,
        out_of_placement=devices.out_of_placement,
        uuids=devices.uuids,
        device_class=devices.device_class,
        placeable=devices.placeable,
        replicas={},
        used_total=0,
        capacity_total=devices.capacity_total,
        memory_total_mib=_usable_ram(node.inventory),
    )


def _usable_ram(inventory: NodeInventory | None) -> int | None:
    if inventory is None or inventory.memory_total_mib is None:
        return None
    return memory.usable_mib(inventory.memory_total_mib)


def ram_needs(state: FleetState) -> dict[str, int]:
    """What one CPU shard of each RAM-placed model is charged (llmgw.memory.need_mib).

    The weights size is the largest any node reports for the model; before
    any node holds them the estimate has its fixed part only, and the agent,
    which knows the file, enforces the whole of it.
    """
    specs = {n: r.spec for n, r in state.models.items() if memory.places_on_ram(r.spec)}
    if not specs:
        return {}
    sizes: dict[str, int] = {}
    for node in state.nodes.values():
        for entry in node.weights:
            if entry.model in specs and entry.size_bytes > sizes.get(entry.model, 0):
                sizes[entry.model] = entry.size_bytes
    return {name: memory.need_mib(spec, sizes.get(name)) for name, spec in specs.items()}


def build_snapshot(
    state: FleetState,
    now: float,
    *,
    exclude: Iterable[str] = (),
    cache: DeviceCache | None = None,
) -> Snapshot:
    """The fleet as placement sees it at ``now``.

    ``exclude`` names replicas whose devices count as free (replicas the
    current pass is removing); ``cache`` keeps digested inventories between
    passes.
    """
    views = {name: node_view(node, now, cache) for name, node in sorted(state.nodes.items())}
    if cache is not None:
        cache.forget_missing(views)
    skip = set(exclude)
    ram_need = ram_needs(state)
    for replica in state.replicas.values():
        if replica.id in skip:
            continue
        for shard in replica.shards:
            view = views.get(shard.node)
            if view is None:
                continue
            for number in shard.device_numbers:
                gpu_class = view.device_class.get(number)
                if gpu_class is None:
                    continue
                free = view.free.get(gpu_class)
                if free is not None and number in free:
                    free.remove(number)
                    view.used[gpu_class] = view.used.get(gpu_class, 0) + 1
                    view.used_total += 1
            view.replicas[replica.model] = view.replicas.get(replica.model, 0) + 1
            if replica.model in ram_need and view.on_cpu(shard.device_numbers):
                view.memory_used_mib += ram_need[replica.model]
    return Snapshot(now, views, ram_need)
