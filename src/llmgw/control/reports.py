"""An agent's report applied to the fleet's memory, and the answer it gets.

Pure with respect to I/O: :func:`apply_report` changes the in-memory records
and returns what must be written (:class:`ReportEffects`); the control plane
(llmgw.control.services.agents) does the writing. Keeping the two apart is what lets
the rules below (which status wins, what is worth a write) be read, and
tested, without a store.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llmgw.control import weightdigests
from llmgw.control.adapters import AdapterIndex
from llmgw.control.state import FleetState, NodeRecord, ReplicaRecord
from llmgw.control.telemetry import Reading, Readings
from llmgw.wire import (
    AgentReport,
    EngineKind,
    ModelSpec,
    NodeInventory,
    NodeState,
    ReplicaAssignment,
    ReplicaState,
    ReplicaStatus,
    ShardAssignment,
    WeightsDigests,
    WeightsEntry,
    host_in_url,
)


@dataclass
class ReportEffects:
    """What one report changed that outlives memory or concerns others."""

    # The node's row (address, ports, fabrics, weights) or its placement facts.
    write_node: bool = False
    # The GPU rows: only when placement facts changed (see apply_report).
    write_gpus: bool = False
    replicas: list[ReplicaRecord] = field(default_factory=list)
    routing_changed: bool = False
    wake_reconciler: bool = False
    # The node had no agent key hash and the report gave it one (an event).
    agent_key_recorded: bool = False
    # Replica ids the report spoke about (status or refusal) that exist but
    # are not assigned to this node: ignored, and logged by the caller.
    foreign: list[str] = field(default_factory=list)


def apply_report(
    state: FleetState,
    node: NodeRecord,
    report: AgentReport,
    now: float,
    *,
    trust_reported_fabrics: bool = False,
    vouch: Callable[[list[WeightsEntry]], list[WeightsEntry]] | None = None,
    readings: tuple[Reading, ...] | None = None,
) -> ReportEffects:
    """Take in a node's report: its facts, its heartbeat and its replicas' states.

    A node's fabrics decide whose weights it copies and which multi-node
    replicas it joins, so its own report only proposes them: they are the
    operator's (pinned) or none, unless ``serve --trust-reported-fabrics``
    says every machine that can join is the operator's own. ``vouch`` keeps
    the holdings placement and peers may believe (weightdigests.vouched).
    ``readings``: the devices' telemetry where it is newer than what the
    report's inventory says (control.telemetry: the report route reused the
    node's last report with this body's readings).
    """
    effects = ReportEffects()
    effects.routing_changed = node.state(now) == NodeState.UNREACHABLE
    _take_facts(node, report, effects, trust_reported_fabrics, vouch, readings)
    node.last_seen = now
    _take_replica_states(state, node, report, now, effects)
    return effects


def _take_facts(
    node: NodeRecord,
    report: AgentReport,
    effects: ReportEffects,
    trust_reported_fabrics: bool,
    vouch: Callable[[list[WeightsEntry]], list[WeightsEntry]] | None,
    readings: tuple[Reading, ...] | None,
) -> None:
    """The node's own facts: address, fabrics, weights, inventory, readings, agent key."""
    weights = vouch(report.weights) if vouch is not None else list(report.weights)
    if node.fabrics_pinned:
        fabrics = node.fabrics
    else:
        fabrics = list(report.fabrics) if trust_reported_fabrics else []
    node.reported_fabrics = list(report.fabrics)
    changed_row = (
        node.address != report.address
        or node.agent_port != report.agent_port
        or node.fabrics != fabrics
        or node.weights != weights
    )
    # The same object when the report's bytes were the last one's (the
    # report route keeps it): no field-by-field comparison of every device.
    inventory_changed = (
        node.inventory is not report.inventory and node.inventory != report.inventory
    )
    # Temperatures, power and memory in use change on every report of a
    # busy GPU node; only what placement and the views' health read is
    # worth a write (2,000 nodes would otherwise rewrite their GPU rows
    # 400 times a second). The in-memory inventory is always the latest.
    effects.write_gpus = inventory_changed and (
        node.inventory is None
        or _placement_facts(node.inventory) != _placement_facts(report.inventory)
    )
    effects.write_node = changed_row or effects.write_gpus
    node.address = report.address
    node.agent_port = report.agent_port
    node.fabrics = fabrics
    node.weights = weights
    if inventory_changed:
        # Replaced, never edited in place, and only when it changed: the
        # scheduler caches per-node device indexes keyed by this object.
        node.inventory = report.inventory
    # Equal inventories list the same devices in the same order, so the
    # readings fit the node's object whichever of the two it is.
    node.readings = (
        Readings(node.inventory, readings)
        if readings is not None and node.inventory is not None
        else None
    )
    if node.agent_key_hash is None and report.agent_key_hash is not None:
        # Only ever the first: once a node has a hash, a report with another
        # one must not move it, or a node token alone (copied, leaked) would
        # be enough to take over who may register the node again.
        node.agent_key_hash = report.agent_key_hash
        effects.agent_key_recorded = effects.write_node = True


def _take_replica_states(
    state: FleetState, node: NodeRecord, report: AgentReport, now: float, effects: ReportEffects
) -> None:
    """What the node says of the replicas placed on it: statuses and refusals."""
    # A node token speaks for its own node only: what it says about a replica
    # placed elsewhere is dropped before it can touch that replica (one rogue
    # or confused agent must not fail, or mark ready, another node's work).
    # Ids the control plane does not know (a replica deleted while its
    # engine still stops) stay: they change nothing.
    effects.foreign = sorted(
        rid
        for rid in {*report.refused, *(s.replica_id for s in report.replicas)}
        if rid in state.replicas and node.name not in state.replicas[rid].nodes
    )
    foreign = set(effects.foreign)
    node.refused = {k: v for k, v in report.refused.items() if k not in foreign}
    node.statuses = {s.replica_id: s for s in report.replicas if s.replica_id not in foreign}
    _mirror_statuses(state, node, now, effects)
    for replica_id, reason in node.refused.items():
        replica = state.replicas.get(replica_id)
        if replica is not None and replica.can_move_to(ReplicaState.FAILED):
            replica.move_to(ReplicaState.FAILED, f"refused by agent on {node.name}: {reason}")
            effects.routing_changed = effects.wake_reconciler = True


def _mirror_statuses(
    state: FleetState, node: NodeRecord, now: float, effects: ReportEffects
) -> None:
    """Copy what the agent says about replicas into their records.

    Only the leader shard's status decides readiness (it is the one that
    serves); any shard failing fails the whole replica.
    """
    for status in node.statuses.values():
        replica = state.replicas.get(status.replica_id)
        if replica is None or status.generation != replica.generation:
            continue
        if replica.state == ReplicaState.FAILED:
            continue
        if status.state == ReplicaState.FAILED:
            exited = status.reason or f"engine exited ({status.exit_code})"
            if replica.draining:
                # Stopping anyway: no failure; the reconciler removes it.
                replica.reason = f"{exited} while draining"
                effects.wake_reconciler = True
                continue
            replica.move_to(ReplicaState.FAILED, exited)
            effects.replicas.append(replica)
            effects.routing_changed = effects.wake_reconciler = True
            continue
        if replica.leader_node != node.name:
            continue
        if status.dialect != replica.dialect:
            # The gateway mends per endpoint from it (memory only: every
            # report carries it, so a restarted control plane has it again
            # with the next report, and the routing table follows).
            replica.dialect = status.dialect
            effects.routing_changed = effects.routing_changed or replica.state == ReplicaState.READY
        if status.tls != replica.tls:
            # The endpoint's scheme (http:// or https://) follows it.
            replica.tls = status.tls
            effects.routing_changed = effects.routing_changed or replica.state == ReplicaState.READY
        _mirror_engine_state(replica, status, now, effects)
        if status.state == ReplicaState.READY and replica.state == ReplicaState.STARTING:
            replica.move_to(ReplicaState.READY)
            replica.port = status.port
            replica.ready_at = status.ready_at or now
            effects.replicas.append(replica)
            effects.routing_changed = effects.wake_reconciler = True
        elif replica.state == ReplicaState.STARTING:
            replica.port = status.port
            replica.reason = status.reason
        elif replica.state == ReplicaState.READY:
            # What the agent says about a serving replica, e.g. that its health
            # probe has been failing (agent.liveness), for `llmgw ctl replicas`;
            # memory only, like a starting replica's progress.
            replica.reason = status.reason
            if status.port != replica.port:
                replica.port = status.port
                effects.replicas.append(replica)
                effects.routing_changed = True


def _mirror_engine_state(
    replica: ReplicaRecord, status: ReplicaStatus, now: float, effects: ReportEffects
) -> None:
    """Adapters loaded and sleep, as the leader shard's agent reports them (memory only)."""
    loaded = frozenset(status.adapters)
    if loaded != replica.loaded_adapters:
        replica.loaded_adapters = loaded
        effects.routing_changed = effects.wake_reconciler = True
    if status.adapter_errors != replica.adapter_errors:
        replica.adapter_errors = dict(status.adapter_errors)
        effects.wake_reconciler = True
    if replica.adapters is None:
        # Decided by an instance before this one: what is loaded stays.
        replica.adapters = tuple(sorted(loaded))
    if replica.asleep is None:
        # Decided by an instance before this one: a sleeper sleeps on.
        replica.asleep = status.sleeping
        replica.asleep_since = now if status.sleeping else None
    if status.sleeping != replica.sleeping:
        replica.sleeping = status.sleeping
        effects.routing_changed = effects.wake_reconciler = True


def assignments_for(
    state: FleetState,
    node_name: str,
    engine_key: Callable[[str], str] | None = None,
    adapters: AdapterIndex | None = None,
) -> list[ReplicaAssignment]:
    """Every replica shard the node must run: the answer to each report.

    ``engine_key``: each replica's engine key by id (control.enginekeys);
    every shard gets it, since every rank may serve or be probed.
    ``adapters``: the catalog's adapters by base (the agents service keeps
    one; a fresh one otherwise).
    """
    index = adapters if adapters is not None else AdapterIndex()
    return [
        _assignment(replica, inputs)
        for replica in state.replicas.on_node(node_name)
        if (inputs := _assignment_inputs(state, node_name, replica, engine_key, index))
        is not None
    ]


# What one replica's assignment to a node is made from, besides the replica's
# id: generation, model spec, shard, node count, leader address, draining,
# engine key. Specs and shards are replaced when they change, never edited.
_Inputs = tuple[
    int, ModelSpec, ShardAssignment, int, str | None, bool, str | None,
    tuple[ModelSpec, ...], bool,
]


def _assignment_inputs(
    state: FleetState,
    node_name: str,
    replica: ReplicaRecord,
    engine_key: Callable[[str], str] | None,
    adapters: AdapterIndex,
) -> _Inputs | None:
    if replica.state == ReplicaState.FAILED:
        return None
    shard = next((s for s in replica.shards if s.node == node_name), None)
    model = state.models.get(replica.model)
    if shard is None or model is None:
        return None
    nodes = len(replica.shards)
    leader = state.nodes.get(replica.leader_node) if nodes > 1 else None
    return (
        replica.generation,
        model.spec,
        shard,
        nodes,
        leader.address if leader is not None else None,
        replica.draining,
        engine_key(replica.id) if engine_key is not None else None,
        _adapter_specs(state, replica, model.spec, adapters),
        bool(replica.asleep),
    )


def _adapter_specs(
    state: FleetState, replica: ReplicaRecord, spec: ModelSpec, adapters: AdapterIndex
) -> tuple[ModelSpec, ...]:
    """The catalog entries of the adapters the replica should have loaded.

    llama-server takes its adapters only at its start: a replica of it gets
    every adapter of its base the catalog holds (by name, the order it
    numbers them in), and starts with those it is given then.
    """
    if spec.engine is EngineKind.LLAMA_SERVER:
        return adapters.every(state, spec.name)
    if not replica.adapters:
        return ()
    found = (state.models.get(name) for name in replica.adapters)
    return tuple(m.spec for m in found if m is not None and m.spec.base == replica.model)


def _assignment(replica: ReplicaRecord, inputs: _Inputs) -> ReplicaAssignment:
    generation, spec, shard, nodes, leader_address, draining, key, adapters, asleep = inputs
    return ReplicaAssignment(
        replica_id=replica.id,
        generation=generation,
        model=spec,
        shard=shard,
        nodes=nodes,
        leader_address=leader_address,
        draining=draining,
        engine_key=key,
        adapters=list(adapters),
        asleep=asleep,
    )


class AssignmentJson:
    """Each replica's assignment to each of its nodes as JSON, made again only when
    what it is made from changed.

    Every report's answer carries all of its node's assignments, each with
    its model's whole catalog entry: at 10,000 nodes, building and dumping
    them was the largest part of answering a report, for bytes that change
    only when the replica or its model does.
    """

    def __init__(self, adapters: AdapterIndex) -> None:
        # (replica id, node) -> (its inputs, its JSON)
        self._kept: dict[tuple[str, str], tuple[_Inputs, bytes]] = {}
        # The catalog's adapters by base: the one index its owner keeps.
        self._adapters = adapters

    def for_node(
        self, state: FleetState, node_name: str, engine_key: Callable[[str], str] | None = None
    ) -> list[bytes]:
        """:func:`assignments_for`'s list, each dumped as ``model_dump_json`` would."""
        kept = self._kept
        if len(kept) > 2 * len(state.replicas) + 64:
            # Removed replicas' entries are never read again.
            for gone in [k for k in kept if k[0] not in state.replicas]:
                del kept[gone]
        out: list[bytes] = []
        for replica in state.replicas.on_node(node_name):
            inputs = _assignment_inputs(state, node_name, replica, engine_key, self._adapters)
            if inputs is None:
                continue
            entry = kept.get((replica.id, node_name))
            # Tuple comparison tries identity first: unchanged specs and
            # shards cost a pointer comparison each.
            if entry is None or entry[0] != inputs:
                entry = kept[replica.id, node_name] = (
                    inputs,
                    _assignment(replica, inputs).model_dump_json().encode(),
                )
            out.append(entry[1])
        return out


def weight_peers(
    state: FleetState,
    node: NodeRecord,
    records: dict[str, WeightsDigests],
    scheme: str = "http",
) -> dict[str, list[str]]:
    """Agents of the node's fabrics that hold weights it needs: model -> agent URLs.

    Only for models whose digests are recorded (weightdigests), and only
    nodes whose reported copy is the recorded one: a node's word that it
    holds a model makes it no one's weight source. Where the record cannot
    tell (a Hub record without a whole-entry digest), only a node that was
    given a replica of the model counts, since it fetched and verified it.
    """
    wanted = {
        r.model
        for r in state.replicas.on_node(node.name)
        if r.model not in {w.model for w in node.weights}
        and r.model in records
        and r.model in state.models
        and records[r.model].source == state.models[r.model].spec.weights
    }
    if not wanted:
        return {}
    peers: dict[str, list[str]] = {}
    fabrics = set(node.fabrics)
    now = time.time()
    for other in state.nodes.values():
        if other.name == node.name or other.agent_port is None or other.pending_approval:
            # A node no operator accepted yet serves no one its "weights".
            continue
        if fabrics and not fabrics & set(other.fabrics):
            continue
        if other.state(now) == NodeState.UNREACHABLE:
            continue
        for entry in other.weights:
            if entry.model not in wanted:
                continue
            match = weightdigests.matches(records[entry.model], entry)
            if match is None:
                match = any(r.model == entry.model for r in state.replicas.on_node(other.name))
            if match:
                # https:// where agents' servers hold node certificates
                # (control.nodecerts): the peer token must not cross in the clear.
                url = f"{scheme}://{host_in_url(other.address)}:{other.agent_port}"
                peers.setdefault(entry.model, []).append(url)
    return peers


def _placement_facts(inventory: NodeInventory) -> list[tuple[object, ...]]:
    return [
        (
            d.number,
            d.uuid,
            d.gpu_class,
            d.healthy,
            tuple(d.unhealthy_reasons),
            d.placeable,
            d.unplaceable_reason,
            d.memory_total_mib,
        )
        for d in inventory.devices
    ]
