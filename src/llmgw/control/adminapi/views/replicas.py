"""Replica views: where each replica runs, its state, and how far a start has got."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from llmgw.control.adminapi.views.memo import Memo, forget_gone
from llmgw.control.state import FleetState, NodeRecord, ReplicaRecord, replica_reachable
from llmgw.wire import CPU_CLASS, DownloadProgress, ReplicaState, device_label

# The state a view shows for a replica that would be starting or ready but
# has a node that stopped reporting: it is not routed to, so counting it as
# ready would make a model with a dead node look satisfied.
UNREACHABLE = "unreachable"
_HIDDEN_BY_NODE = frozenset({ReplicaState.READY, ReplicaState.STARTING})


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
    # Whole seconds since the last request (or since ready); None before ready,
    # 0 while requests are in flight (ReplicaRecord.idle_seconds).
    idle_seconds: int | None
    gpus: int
    in_flight: int
    # From the agent's latest status: weights download and the engine's log.
    download: DownloadProgress | None
    log_tail: list[str] = field(default_factory=list)
    # Told to sleep or reported asleep (control.sleep): not routed to.
    asleep: bool = False
    # LoRA adapters its engine has loaded (control.adapters), and those it
    # refused with why.
    adapters: list[str] = field(default_factory=list)
    adapter_errors: dict[str, str] = field(default_factory=dict)


_LABELS: dict[tuple[int, bool], str] = {}


def _labels(numbers: list[int], node: NodeRecord | None) -> list[str]:
    # A CPU slot's number alone reads as a card's ("0" for "cpu0"), so the
    # label needs the node's kind. A node offers CPU slots only when it has
    # no GPU (agent/discovery/inventory.py), so its first device tells.
    # Labels are a handful of distinct strings fleet-wide; formatting each
    # once keeps a 16,000-device listing from formatting 16,000 times.
    devices = node.inventory.devices if node is not None and node.inventory is not None else []
    cpu = bool(devices) and devices[0].gpu_class == CPU_CLASS
    labels = []
    for number in numbers:
        label = _LABELS.get((number, cpu))
        if label is None:
            label = _LABELS[(number, cpu)] = device_label(number, CPU_CLASS if cpu else None)
        labels.append(label)
    return labels


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
        node = nodes.get(shard.node)
        shards.append(ShardView(shard.node, shard.rank, _labels(numbers, node), numbers))
        # The leader shard (first) is looked at first: it is the one that
        # serves, and its log is the one that explains a failed start.
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
    idle = replica.idle_seconds(now)
    state: str = replica.state
    if replica.state in _HIDDEN_BY_NODE and not replica_reachable(replica, nodes, now):
        state = UNREACHABLE
    return ReplicaView(
        id=rid,
        model=replica.model,
        state=state,
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
        idle_seconds=None if idle is None else int(idle),
        gpus=gpus,
        in_flight=replica.in_flight,
        download=download,
        log_tail=log_tail,
        asleep=not replica.awake,
        adapters=sorted(replica.loaded_adapters) if detail else [],
        adapter_errors=dict(replica.adapter_errors) if detail else {},
    )


# replica id -> its last detail-less view, the summary's (see memo.py). Only
# the idle time moves with the clock; it is set on the reused view.
_REPLICA_VIEWS: Memo[ReplicaView] = {}


def _replica_count_view(replica: ReplicaRecord, nodes: dict[str, NodeRecord],
                        now: float) -> ReplicaView:
    inputs = (
        replica.state, replica.draining, replica.generation, replica.shards, replica.port,
        replica.reason, replica.created_at, replica.ready_at, replica.last_request_at,
        replica.in_flight, replica.model, replica_reachable(replica, nodes, now),
        replica.awake,
    )
    cached = _REPLICA_VIEWS.get(replica.id)
    if cached is None or cached[0] != inputs:
        view = replica_view(replica, nodes, now, detail=False)
        _REPLICA_VIEWS[replica.id] = (inputs, view)
        return view
    view = cached[1]
    idle = replica.idle_seconds(now)
    view.idle_seconds = None if idle is None else int(idle)
    return view


def iter_replica_views(
    state: FleetState, now: float, *, detail: bool = True
) -> Iterator[ReplicaView]:
    replicas, nodes = state.replicas, state.nodes
    if detail:
        for rid in sorted(replicas):
            yield replica_view(replicas[rid], nodes, now)
        return
    forget_gone(_REPLICA_VIEWS, replicas)
    for rid in sorted(replicas):
        yield _replica_count_view(replicas[rid], nodes, now)
