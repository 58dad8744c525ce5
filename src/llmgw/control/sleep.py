"""Sleep instead of stop: which idle on-demand replicas sleep, and which wake.

Stopping an idle on-demand replica gives its devices back, and its next
request pays a cold start: seconds on the simulator, minutes for a large
model on vLLM. An engine that can sleep (vLLM's sleep mode) instead moves
its weights to host RAM and frees the device memory, and wakes 18-200x
faster than it loads; llama-server frees its model when idle and reloads it
at the next request (llmgw.sleepmode). The price is the node's RAM, which the weights then
occupy: a replica sleeps only where the node's RAM not already charged
(CPU replicas' budgets, other sleepers' weights) holds its weights, and
otherwise is stopped as before. A sleeping replica keeps its devices in
placement (its engine keeps a little device memory, and waking needs the
rest back), is routed to by nobody, and is the first thing eviction takes
when another model needs the room (it is idle by definition).

A pure function of the fleet (``plan_sleep``), applied by the reconciler
before each pass, so the pass's triage keeps the sleepers (triage.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmgw import memory
from llmgw.control.scheduler.demand import asked_for, idle_for
from llmgw.control.state import FleetState, ReplicaRecord
from llmgw.sleepmode import can_sleep, sleeps_by_itself
from llmgw.wire import EngineKind, ModelSpec, ReplicaState


def sleeping_mib(state: FleetState, replica: ReplicaRecord, spec: ModelSpec) -> int:
    """Host RAM its weights take while it sleeps: the node's copy of the weights
    as its agent reported it, else the catalog's word. Nothing for llama-server: it
    frees its weights as it falls asleep and reads them from the file at wake."""
    if spec.engine is EngineKind.SIM and spec.sim is not None:
        return spec.sim.weights_mib
    if sleeps_by_itself(spec):
        return 0
    size = weights_bytes(state, replica.leader_node, spec.name)
    if size:
        return -(-size // memory.MIB)
    return spec.memory_mib or 0


def weights_bytes(state: FleetState, node_name: str, model: str) -> int | None:
    """The size of the model's weights as the node's agent reported them; None: not held."""
    node = state.nodes.get(node_name)
    if node is not None:
        for entry in node.weights:
            if entry.model == model and entry.size_bytes:
                return entry.size_bytes
    return None


def node_free_mib(state: FleetState, node_name: str) -> int | None:
    """RAM of the node not yet charged to CPU replicas or sleepers; None: not reported."""
    node = state.nodes.get(node_name)
    if node is None or node.inventory is None or node.inventory.memory_total_mib is None:
        return None
    free = memory.usable_mib(node.inventory.memory_total_mib)
    for replica in state.replicas.on_node(node_name):
        model = state.models.get(replica.model)
        if model is None or replica.state is ReplicaState.FAILED:
            continue
        if memory.places_on_ram(model.spec):
            # Charged as its agent budgets it: the weights it holds, twice
            # over where vLLM computes float32 on a CPU without bfloat16.
            need = memory.RamNeed.of(model.spec, weights_bytes(state, node_name, replica.model))
            free -= need.on(node.inventory.cpu_bf16)
        if replica.asleep:
            free -= sleeping_mib(state, replica, model.spec)
    return free


@dataclass
class SleepPlan:
    sleep: list[ReplicaRecord] = field(default_factory=list)
    wake: list[ReplicaRecord] = field(default_factory=list)
    # Replica id -> why it is stopped rather than put to sleep.
    no_room: dict[str, str] = field(default_factory=dict)


def plan_sleep(state: FleetState, now: float) -> SleepPlan:
    plan = SleepPlan()
    charged: dict[str, int] = {}
    # Every pass, over every model: the cheap test first, the sort only of those that can sleep.
    sleepers = [r for r in state.models.values() if r.spec.on_demand and can_sleep(r.spec)]
    for record in sorted(sleepers, key=lambda r: r.name):
        name, spec = record.name, record.spec
        wanted = asked_for(record, now)
        for replica in sorted(state.replicas_of(name), key=lambda r: r.id):
            if replica.state is not ReplicaState.READY or replica.draining:
                continue
            if replica.asleep:
                # Asked for since it fell asleep: woken (a wake is what
                # replaces the cold start).
                if record.demand_at is not None and record.demand_at > (replica.asleep_since or 0):
                    plan.wake.append(replica)
                continue
            if wanted or idle_for(replica, now) < spec.idle_timeout_s:
                continue
            need = sleeping_mib(state, replica, spec)
            node = replica.leader_node
            if node not in charged:
                free = node_free_mib(state, node)
                charged[node] = free if free is not None else need
            if charged[node] < need:
                plan.no_room[replica.id] = (
                    f"stopped, not put to sleep: its weights ({need} MiB) do not fit in"
                    f" node {node}'s free RAM ({max(0, charged[node])} MiB)"
                )
                continue
            charged[node] -= need
            plan.sleep.append(replica)
    return plan


def apply_sleep(plan: SleepPlan, now: float) -> bool:
    """Tell the replicas (memory only; their assignments carry it); True if any changed."""
    for replica in plan.sleep:
        replica.asleep = True
        replica.asleep_since = now
    for replica in plan.wake:
        replica.asleep = False
        replica.asleep_since = None
    return bool(plan.sleep or plan.wake)
