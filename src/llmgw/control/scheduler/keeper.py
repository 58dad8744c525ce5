"""The reconciler's snapshot, kept from pass to pass and brought up to date.

Building a snapshot means a view per node and every replica's devices
marked used: at 10,000 nodes that was 150-300 ms, most of a pass that
should take well under 100 ms, to find that almost nothing had changed. The
keeper holds the snapshot the last pass started from (every replica held,
none excluded) and, each pass, changes only what changed in the fleet:

- a node whose digested inventory, state, fabrics, weights or RAM differ
  from what its view was built from gets a new view, with the replicas it
  holds marked on it again;
- a replica that appeared is marked on its nodes; one that went (or whose
  record was replaced) has its nodes' views built again, since giving a
  device back is not the exact inverse of taking it when two replicas
  claim one device;
- a change in what CPU replicas are charged in RAM rebuilds everything.

Each pass then gets a fork (PlacementSnapshot.fork), from which the replicas the
pass removes are taken out the same way, so the base stays the fleet as it
is. The result equals ``build_snapshot`` of the same state, down to the
order of every index (PlacementSnapshot.canonical); the planner builds its own and
the property tests hold the two to the same placements.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from llmgw.control.scheduler.placementnode import (
    DeviceCache,
    DeviceDigest,
    PlacementNode,
    placement_node,
)
from llmgw.control.scheduler.snapshot import PlacementSnapshot, build_snapshot, ram_needs
from llmgw.control.state import FleetState, NodeRecord, ReplicaRecord
from llmgw.memory import RamNeed
from llmgw.wire import NodeInventory, NodeState, WeightsEntry


@dataclass(slots=True)
class _Built:
    """What one node's view in the base was built from."""

    devices: DeviceDigest
    state: NodeState
    fabrics: list[str]
    weights_list: list[WeightsEntry]
    weights: frozenset[str]
    ram: tuple[int | None, bool | None]  # (memory_total_mib, cpu_bf16): what RAM placement reads


class SnapshotKeeper:
    def __init__(self) -> None:
        self.devices = DeviceCache()
        self._base: PlacementSnapshot | None = None
        self._built: dict[str, _Built] = {}
        # Replicas marked in the base, by id: the record itself, so a record
        # replaced under the same id counts as one gone and one new.
        self._held: dict[str, ReplicaRecord] = {}
        self._ram_need: dict[str, RamNeed] = {}
        self._replicas_version = -1
        # Nodes whose views the last refresh built again (None: all of them).
        self.changed_nodes: set[str] | None = None

    def snapshot(
        self,
        state: FleetState,
        now: float,
        exclude: Iterable[str] = (),
        states: Mapping[str, NodeState] | None = None,
    ) -> PlacementSnapshot:
        """The fleet as placement sees it at ``now``, without ``exclude``'s replicas.

        ``states``: every node's ``state(now)``, when the caller has them already.
        """
        self.refresh(state, now, states)
        return self.fork(state, now, exclude)

    def refresh(
        self, state: FleetState, now: float, states: Mapping[str, NodeState] | None = None
    ) -> PlacementSnapshot:
        """Bring the kept snapshot up to date with ``state``; it is returned for
        reading only (its views' device classes, say): ``fork`` is for placing."""
        return self._refresh(state, now, states)

    def fork(self, state: FleetState, now: float, exclude: Iterable[str] = ()) -> PlacementSnapshot:
        """A snapshot to place on, from the one ``refresh`` brought up to date."""
        base = self._base
        if base is None:
            raise RuntimeError("SnapshotKeeper.fork before refresh")
        fork = base.fork(now)
        skip = set(exclude)
        touched = {s.node for rid in skip if rid in self._held for s in self._held[rid].shards}
        if touched:
            fork.begin_changes()
            for name in sorted(touched):
                node = state.nodes.get(name)
                if node is not None and name in fork.nodes:
                    fork.put_node(self._view(state, node, now, skip))
            fork.canonical()
        return fork

    # -- the base ------------------------------------------------------------------

    def _refresh(
        self, state: FleetState, now: float, states: Mapping[str, NodeState] | None
    ) -> PlacementSnapshot:
        ram_need = ram_needs(state)
        base = self._base
        if base is None or ram_need != self._ram_need:
            return self._rebuild(state, now, ram_need, states)
        base.now = now
        base.begin_changes()
        stale = self._changed_nodes(state, now, states)
        replicas = state.replicas
        held = self._held
        nodes = base.nodes
        # The table counts its writes: the same count, the same replicas.
        if replicas.version != self._replicas_version or len(replicas) != len(held):
            gone = [rid for rid, r in held.items() if replicas.get(rid) is not r]
            for rid in gone:
                stale.update(s.node for s in held.pop(rid).shards)
            for rid, replica in replicas.items():
                if rid not in held:
                    held[rid] = replica
                    for shard in replica.shards:
                        # A stale node's view is built again below, with every
                        # replica it holds.
                        if shard.node not in stale and shard.node in nodes:
                            base.allocate(shard.node, shard.device_numbers, replica.model)
            self._replicas_version = replicas.version
        # A node that came is stale already; only then can one have gone.
        gone_nodes = (
            [n for n in nodes if n not in state.nodes]
            if len(nodes) != len(state.nodes) or stale.difference(nodes)
            else []
        )
        for name in gone_nodes:
            base.drop_node(name)
            self._built.pop(name, None)
            stale.discard(name)
        # For the triage memo (triagememo.py): views built again this refresh.
        self.changed_nodes = stale | set(gone_nodes)
        for name in sorted(stale):
            node = state.nodes.get(name)
            if node is not None:
                base.put_node(self._view(state, node, now))
        base.canonical()
        if gone_nodes:
            self.devices.forget_missing(state.nodes)
        return base

    def _rebuild(
        self,
        state: FleetState,
        now: float,
        ram_need: dict[str, RamNeed],
        states: Mapping[str, NodeState] | None,
    ) -> PlacementSnapshot:
        base = build_snapshot(state, now, cache=self.devices, states=states)
        self._base, self._ram_need = base, ram_need
        self.changed_nodes = None  # everything
        self._held = dict(state.replicas)
        self._replicas_version = state.replicas.version
        # What each view was just built from, read off the view and the
        # cache entry it was built with rather than asked of the node again.
        entries = self.devices.entries
        built: dict[str, _Built] = {}
        for name, node in state.nodes.items():
            view = base.nodes[name]
            inventory = node.inventory
            built[name] = _Built(
                devices=entries[name][1],
                state=view.state,
                fabrics=node.fabrics,
                weights_list=node.weights,
                weights=view.weights,
                ram=_ram_facts(inventory),
            )
        self._built = built
        return base

    def _changed_nodes(
        self, state: FleetState, now: float, states: Mapping[str, NodeState] | None
    ) -> set[str]:
        """Nodes whose view no longer matches what it was built from."""
        built = self._built
        cache = self.devices
        entries = cache.entries
        changed: set[str] = set()
        for name, node in state.nodes.items():
            seen = built.get(name)
            if seen is None:
                changed.add(name)
                continue
            entry = entries.get(name)
            devices = (
                entry[1] if entry is not None and entry[0] is node.inventory else cache.get(node)
            )
            if devices is not seen.devices:
                # A new inventory object (reports replace it whenever any
                # figure moved): the same placement facts change nothing.
                if devices != seen.devices or _ram_facts(node.inventory) != seen.ram:
                    changed.add(name)
                    continue
                seen.devices = devices
            node_state = states[name] if states is not None else node.state(now)
            if node_state is not seen.state or node.fabrics != seen.fabrics:
                changed.add(name)
                continue
            if node.weights is not seen.weights_list:
                if frozenset(w.model for w in node.weights) != seen.weights:
                    changed.add(name)
                    continue
                seen.weights_list = node.weights
        return changed

    def _view(
        self, state: FleetState, node: NodeRecord, now: float, skip: set[str] | None = None
    ) -> PlacementNode:
        """A node's view from scratch, with the replicas it holds (but ``skip``) marked."""
        view = placement_node(node, now, self.devices)
        if skip is None:
            self._built[node.name] = self._inputs(node, now, view.weights)
        one = PlacementSnapshot(now, {node.name: view}, self._ram_need)
        for replica in state.replicas.on_node(node.name):
            if skip is None or replica.id not in skip:
                for shard in replica.shards:
                    if shard.node == node.name:
                        one.allocate(shard.node, shard.device_numbers, replica.model)
        return one.nodes[node.name]

    def _inputs(self, node: NodeRecord, now: float, weights: frozenset[str]) -> _Built:
        return _Built(
            devices=self.devices.get(node),
            state=node.state(now),
            fabrics=node.fabrics,
            weights_list=node.weights,
            weights=weights,
            ram=_ram_facts(node.inventory),
        )


def _ram_facts(inventory: NodeInventory | None) -> tuple[int | None, bool | None]:
    if inventory is None:
        return None, None
    return inventory.memory_total_mib, inventory.cpu_bf16
