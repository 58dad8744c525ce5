"""The control plane's working state: nodes, models and replicas in memory.

The control plane answers hundreds of agent reports a second and computes
summaries over thousands of nodes; doing either from SQL rows on every call
would make the store the bottleneck. So the state lives here, is loaded from
the store when an instance starts (or becomes leader), and every change that
must survive a restart is written through to the store by the code that
makes it. What is only ever re-learnt from agents and gateways (replica
status lines, in-flight counts) is never persisted.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from llmgw.control.external import HealthReports
from llmgw.control.modeltable import ModelTable
from llmgw.control.nodetable import NodeTable
from llmgw.control.replicatable import ReplicaTable
from llmgw.control.telemetry import Readings
from llmgw.control.writelog import Logged
from llmgw.errors import TransitionError
from llmgw.sleepmode import sleeps_by_itself
from llmgw.wire import (
    EngineDialect,
    ModelSpec,
    NodeInventory,
    NodeState,
    ReplicaState,
    ReplicaStatus,
    ShardAssignment,
    WeightsEntry,
)

# A node that has not reported for this long is unreachable: its replicas are
# no longer routed to. Several report intervals, so one lost report or a slow
# GC pause does not flap the node.
UNREACHABLE_AFTER_S = 30.0
# ... and after this long its replicas are replaced elsewhere. Longer than the
# first, because replacing throws away a warm KV cache and may copy weights.
REPLACE_AFTER_S = 120.0
# A node not heard from since this instance began to lead gets this much more
# (NodeRecord.listening_since): its agent may be waiting out its longest
# retry (agent MAX_BACKOFF_S) after failing to reach a control plane that was
# down or loading, and a new leader at 10,000 nodes takes every node's first
# report, read whole, 11 s on a quiet machine and 23-50 s on a loaded one
# (bench/reports.py's first round). Without it a restart alone called healthy
# nodes unreachable and took their replicas out of routing.
TAKEOVER_ALLOWANCE_S = 30.0

@dataclass(slots=True)
class NodeRecord(Logged):
    name: str
    registered_at: float
    admin_state: NodeState = NodeState.READY  # ready, cordoned or draining
    token_hash: str | None = None
    agent_key_hash: str | None = None  # see the nodes table (store/schema.py)
    address: str = "127.0.0.1"
    agent_port: int | None = None
    fabrics: list[str] = field(default_factory=list)
    inventory: NodeInventory | None = None
    # The devices' latest telemetry where it is newer than the inventory's
    # (control.telemetry; memory only): reports that change only readings
    # leave the inventory object, and so everything digested from it, alone.
    readings: Readings | None = None
    weights: list[WeightsEntry] = field(default_factory=list)
    last_seen: float | None = None
    # Latest replica status lines from the agent, by replica id (memory only).
    statuses: dict[str, ReplicaStatus] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    # Registered while `serve --approve-nodes` holds new nodes: kept cordoned,
    # given no peer token, until an operator approves it (llmgw.control.approval).
    pending_approval: bool = False
    # Fabrics an operator set (or accepted with the node's approval): reports
    # no longer change them, so a node cannot talk itself into a fabric.
    fabrics_pinned: bool = False
    # What the agent last reported (memory only), shown when it differs.
    reported_fabrics: list[str] = field(default_factory=list)
    # When this instance began to lead (memory only; ControlPlane.load):
    # silence before it, and TAKEOVER_ALLOWANCE_S after it, does not count.
    # While no instance leads, no agent can report, and agents back off
    # meanwhile; counted from the stored last_seen, a store failover of ~20 s
    # made the new leader call every node unreachable at once (all replicas
    # out of routing, every model short) until the agents' backed-off reports
    # came in, and an outage longer than REPLACE_AFTER_S would have replaced
    # every replica.
    listening_since: float | None = None

    def silent_for(self, now: float) -> float:
        """Seconds without a report that count: since it last reported, or since
        this instance took over (plus TAKEOVER_ALLOWANCE_S) if that is later."""
        return now - self._heard_at()

    def _heard_at(self) -> float:
        seen = self.last_seen if self.last_seen is not None else self.registered_at
        if self.listening_since is not None and self.listening_since > seen:
            seen = self.listening_since + TAKEOVER_ALLOWANCE_S
        return seen

    def state(self, now: float, unreachable_after: float | None = None) -> NodeState:
        # The module's grace is read at call time, so a test can shorten it.
        grace = UNREACHABLE_AFTER_S if unreachable_after is None else unreachable_after
        seen = self.last_seen
        if seen is None:
            return NodeState.UNREACHABLE
        # silent_for, written out: this runs for every node several times a
        # pass (scheduler, keeper, views) and three calls deep it showed.
        since = self.listening_since
        if since is not None and since > seen:
            seen = since + TAKEOVER_ALLOWANCE_S
        if now - seen > grace:
            return NodeState.UNREACHABLE
        return self.admin_state

    def reachable_until(self) -> float:
        """About when ``state`` turns unreachable if nothing else changes (the
        grace past its last report); -inf when it has never reported.

        For callers that cache states and must know when to ask again; the
        figure is rounded by float arithmetic, so ask ``state`` near it.
        """
        if self.last_seen is None:
            return -math.inf
        return self._heard_at() + UNREACHABLE_AFTER_S


@dataclass(frozen=True, slots=True)
class NodeFailure:
    """A model's failed starts on one node (persisted with the model).

    A node with a broken card or driver fails every replica put on it;
    counted per model only, that parks good models. Counted per node too,
    placement can avoid the node for this model and parking can ask
    whether the failures span several nodes (scheduler/node_failures.py).
    """

    failures: int  # consecutive failures here; dropped when a start here succeeds
    last_at: float
    # Part of the model's current run of consecutive failures (the run that
    # can park it); false once a start of the model succeeded anywhere.
    current_run: bool = True


@dataclass(slots=True)
class ModelRecord:
    spec: ModelSpec
    created_at: float
    updated_at: float
    parked: bool = False
    # Consecutive failed starts; reset when a replica becomes ready.
    failures: int = 0
    last_error: str | None = None
    # By node name; replaced whole, never edited in place (decide builds new ones).
    node_failures: dict[str, NodeFailure] = field(default_factory=dict)
    # When a request last asked for this model (on-demand scale from zero).
    demand_at: float | None = None
    # Memory only: when the next start may be tried (backoff after failures),
    # and why the scheduler could not place it on its last pass.
    backoff_until: float = 0.0
    unplaceable_reason: str | None = None
    # Extra replicas wanted for load (gateway-reported), memory only.
    load_demand: int = 0
    # An external model's URLs as each gateway's probes see them (memory
    # only, re-learnt from the next load reports): url -> gateway -> Probe.
    endpoint_health: HealthReports = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name


_S = ReplicaState
# A replica's lifecycle: the only changes of state there are. Kept in one
# table, owned by the record: states assigned wherever convenient can give a
# replica told to drain (by the scheduler) a state of ready plus a flag,
# which a summary counts as ready and lists as idle.
# - starting -> starting is a restart with a new generation (a changed
#   catalog entry); ready -> starting likewise.
# - draining and failed are final; both end in removal by the reconciler.
#   A replica told to stop is never sent requests again, and an engine that
#   exits while draining was stopping anyway: that is no failed start to
#   count against its model.
REPLICA_TRANSITIONS: Mapping[ReplicaState, frozenset[ReplicaState]] = {
    _S.STARTING: frozenset({_S.STARTING, _S.READY, _S.DRAINING, _S.FAILED}),
    _S.READY: frozenset({_S.STARTING, _S.DRAINING, _S.FAILED}),
    _S.DRAINING: frozenset(),
    _S.FAILED: frozenset(),
}


@dataclass(slots=True)
class ReplicaRecord(Logged):
    id: str
    model: str
    created_at: float
    shards: list[ShardAssignment]
    generation: int = 1
    state: ReplicaState = ReplicaState.STARTING
    reason: str | None = None
    port: int | None = None
    ready_at: float | None = None
    # When it was last used: a request sent, or one seen still in flight.
    last_request_at: float | None = None
    # Requests in flight as the gateways last reported them (the leader), or
    # as the leader last stored them (a standby: control.inflight.StoredActivity).
    in_flight: int = 0
    # Memory only: the engine's dialect as its agent last reported it.
    dialect: EngineDialect | None = None
    # Memory only, like the dialect: whether its engine listens with TLS
    # (ReplicaStatus.tls); None until its agent reports after a restart.
    tls: bool | None = None
    # Memory only, re-learnt from reports: the LoRA adapters its engine has
    # loaded, and those its agent could not load (name -> why).
    loaded_adapters: frozenset[str] = frozenset()
    adapter_errors: dict[str, str] = field(default_factory=dict)
    # Memory only: the adapters the control plane wants loaded, least
    # recently used first (control.adapters); None until decided since this
    # instance began to lead (the loaded set is then taken as it is).
    adapters: tuple[str, ...] | None = None
    # Memory only: told to sleep (ReplicaAssignment.asleep), and whether its
    # agent reports the engine asleep. A replica is routed to only when
    # both are false: it sleeps before it is told awake, and wakes after.
    # None: not decided since this instance began to lead; its agent's report
    # is taken as it is (a new leader that told every sleeper "awake" would
    # wake them all at once, each to fall asleep again a pass later).
    asleep: bool | None = None
    sleeping: bool = False
    asleep_since: float | None = None

    @property
    def awake(self) -> bool:
        """Neither told to sleep nor reported asleep: it can serve."""
        return not (self.asleep or self.sleeping)

    @property
    def nodes(self) -> list[str]:
        return [s.node for s in self.shards]

    @property
    def leader_node(self) -> str:
        return self.shards[0].node

    @property
    def draining(self) -> bool:
        """Told to stop: the agent's instruction (ReplicaAssignment.draining) reads this."""
        return self.state is ReplicaState.DRAINING

    def can_move_to(self, target: ReplicaState) -> bool:
        return target in REPLICA_TRANSITIONS[self.state]

    def move_to(self, target: ReplicaState, reason: str | None = None) -> None:
        """Change state through the lifecycle table; TransitionError if it forbids it.

        ``reason`` replaces the last one (None clears it).
        """
        if target not in REPLICA_TRANSITIONS[self.state]:
            raise TransitionError(
                f"replica {self.id} is {self.state.value} and cannot become {target.value}",
                field="state",
            )
        self.state = target
        self.reason = reason

    def restart(self) -> None:
        """Start again under a new generation (the agent restarts its engine)."""
        self.move_to(ReplicaState.STARTING)
        self.generation += 1
        self.ready_at = None

    def gpu_count(self) -> int:
        return sum(len(s.device_numbers) for s in self.shards)

    def idle_seconds(self, now: float) -> float | None:
        """Seconds since the last request, or since it became ready; None before.

        0 while a gateway reports a request in flight: a request that streams
        for longer than the idle threshold is use, not idleness, and the
        scheduler (scheduler/demand.idle_for) already treats it so.
        """
        since = self.last_request_at or self.ready_at
        if since is None:
            return None
        return 0.0 if self.in_flight > 0 else max(0.0, now - since)


@dataclass
class FleetState:
    # A dict that counts its writes (nodetable.py); a plain dict given here
    # is kept as it is (readers then list it to see what came or went).
    nodes: dict[str, NodeRecord] = field(default_factory=NodeTable)
    # A dict that counts its writes (modeltable.py); a plain dict given
    # here is copied into one.
    models: dict[str, ModelRecord] = field(default_factory=ModelTable)
    # A dict that also keeps replicas by model and by node (replicatable.py);
    # a plain dict given here is copied into one.
    replicas: ReplicaTable[ReplicaRecord] = field(default_factory=ReplicaTable)
    # Bumped whenever what the gateway needs (ready endpoints, models, keys)
    # changes; long-polling gateways wake on it.
    routing_version: int = 0
    _changed: asyncio.Condition | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, ReplicaTable):
            self.replicas = ReplicaTable(self.replicas)
        if not isinstance(self.models, ModelTable):
            self.models = ModelTable(self.models)

    def changed(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def bump_routing(self) -> None:
        self.routing_version += 1
        cond = self.changed()
        async with cond:
            cond.notify_all()

    def replicas_of(self, model: str) -> list[ReplicaRecord]:
        return list(self.replicas.of_model(model))

    def unreachable_nodes(self, now: float) -> frozenset[str]:
        return frozenset(
            name for name, node in self.nodes.items() if node.state(now) is NodeState.UNREACHABLE
        )

    def reachable(self, replica: ReplicaRecord, now: float) -> bool:
        return replica_reachable(replica, self.nodes, now)

    def routable(self, replica: ReplicaRecord, now: float) -> bool:
        """Gateways may send it requests: ready, serving, and on reporting nodes.

        The one rule behind the gateway's routing table, the scheduler's
        "does this model still have a replica" and the summary's ready count.
        Asleep counts as serving on an engine that wakes itself for a request
        (llama-server's idle sleep): the gateway's table keeps it, and a
        model whose only replica dozes is not stranded.
        """
        if replica.state is not ReplicaState.READY or replica.draining:
            return False
        if not replica.awake:
            model = self.models.get(replica.model)
            if model is None or not sleeps_by_itself(model.spec):
                return False
        return self.reachable(replica, now)

    def resolve_model(self, name: str) -> ModelRecord | None:
        record = self.models.get(name)
        if record is not None:
            return record
        for candidate in self.models.values():
            if name in candidate.spec.aliases:
                return candidate
        return None


def replica_reachable(replica: ReplicaRecord, nodes: dict[str, NodeRecord], now: float) -> bool:
    """Every node the replica spans is known and reporting."""
    for shard in replica.shards:
        node = nodes.get(shard.node)
        if node is None or node.state(now) is NodeState.UNREACHABLE:
            return False
    return True
