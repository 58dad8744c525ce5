"""Feasibility checks: may this node take a shard of this replica at all?

Each filter is small, named, pure and answers with a :class:`Rejection`
carrying a fixed reason, the dimension and the numbers, never a bare bool:
an unplaceable model is explained by counting rejections by reason
("0/2000 nodes fit: 1890 too few free h100-80g, 96 cordoned"), and a filter
that only said "no" would leave that sentence impossible to write.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from llmgw.control.scheduler.placementnode import PlacementNode
from llmgw.memory import RamNeed
from llmgw.wire import CPU_CLASS, ModelSpec, NodeState, is_mig_class

# Fixed reasons (the words of the unplaceable sentence; a test pins them).
UNREACHABLE = "unreachable"
CORDONED = "cordoned"
DRAINING = "draining"
NO_CLASS = "no-class"
MIG_ONE_INSTANCE = "mig-one-instance"
TOO_SMALL = "too-small"
TOO_FEW_HEALTHY = "too-few-healthy"
TOO_FEW_FREE = "too-few-free"
NOT_ENTIRELY_FREE = "not-entirely-free"
NO_FABRIC = "no-fabric"
FAILED_HERE = "failed-here"
TOO_LITTLE_RAM = "too-little-ram"


@dataclass(frozen=True, slots=True)
class Request:
    """The shape of one replica to place.

    ``classes`` are the accepted classes this shape can use, in the
    catalog's order of preference; MIG classes are dropped from it when the
    shape needs more than one device (``mig_refused``), since one process
    opens one MIG instance and instances share no NVLink.

    ``avoid`` names nodes where this model failed recently
    (node_failures.py); placement uses them only when nothing else fits.
    """

    model: str
    classes: tuple[str, ...]
    per_node: int
    nodes: int = 1
    mig_refused: tuple[str, ...] = ()
    avoid: frozenset[str] = frozenset()
    # RAM one shard on CPU slots needs, by its node's CPU (llmgw.memory);
    # None: not placed on RAM.
    memory: RamNeed | None = None
    # The parallelism a catalog edited around validation asks beyond one
    # device ("tp 2"): without it a refusal of tp 2 on one device could only
    # say "needs 1 device", which names nothing the operator can change.
    split: tuple[str, ...] = ()

    @classmethod
    def for_spec(cls, spec: ModelSpec, memory: RamNeed | None = None) -> Request:
        per_node = max(1, spec.gpus // max(1, spec.nodes))
        sharded = spec.gpus > 1 or spec.tp > 1 or spec.pp > 1 or spec.nodes > 1
        usable = tuple(c for c in spec.gpu_classes if not (sharded and is_mig_class(c)))
        refused = tuple(c for c in spec.gpu_classes if c not in usable)
        split = tuple(
            f"{name} {value}"
            for name, value in (("tp", spec.tp), ("pp", spec.pp), ("nodes", spec.nodes))
            if value > 1
        )
        return cls(
            spec.name, usable, per_node, spec.nodes, refused, memory=memory, split=split
        )

    def relaxed(self) -> Request:
        """The same shape with no node avoided."""
        return replace(self, avoid=frozenset()) if self.avoid else self

    @property
    def all_classes(self) -> tuple[str, ...]:
        return self.classes + self.mig_refused

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1

    def class_phrase(self) -> str:
        """``h100-80g`` or ``h100-80g or a100-80g`` for sentences."""
        return " or ".join(self.classes or self.mig_refused)


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why one node cannot take one shard, with the numbers behind it."""

    filter: str
    reason: str  # one of the fixed reasons above
    dimension: str  # "node state", a device class, "fabric", "node"
    requested: int | None = None
    available: int | None = None
    capacity: int | None = None


class Filter(Protocol):
    """A feasibility check. One with ``indexed = True`` holds for every node the
    snapshot lists as having at least the request's per-node count free of a
    class the request accepts (PlacementSnapshot.buckets): placement does not run it
    on candidates taken from there (Placer._place_single)."""

    name: str

    def applies(self, request: Request) -> bool:
        """Whether ``check`` can refuse any node for this request at all.

        The placer asks once per request and runs only the filters that can,
        since it runs them on about ten nodes per replica it places: most
        filters guard shapes (multi-node, MIG, RAM, avoided nodes) that most
        requests do not have.
        """
        ...

    def check(self, node: PlacementNode, request: Request) -> Rejection | None: ...


class IndexedFilter:
    """A check every request needs (it applies to all of them) and that the snapshot's
    buckets already hold (``indexed``): the placer runs it only on candidates found
    outside them."""

    indexed = True

    def applies(self, request: Request) -> bool:
        return True


class NodeReady(IndexedFilter):
    """Cordoned, draining and unreachable nodes take nothing new (DESIGN §3)."""

    name = "node-ready"

    def check(self, node: PlacementNode, request: Request) -> Rejection | None:
        if node.state is NodeState.READY:
            return None
        reason = {
            NodeState.UNREACHABLE: UNREACHABLE,
            NodeState.CORDONED: CORDONED,
            NodeState.DRAINING: DRAINING,
        }[node.state]
        return Rejection(self.name, reason, "node state")


class ClassAccepted(IndexedFilter):
    """The node has at least one device of a class the model accepts."""

    name = "class-accepted"

    def check(self, node: PlacementNode, request: Request) -> Rejection | None:
        for gpu_class in request.all_classes:
            if node.total.get(gpu_class):
                return None
        return Rejection(self.name, NO_CLASS, request.class_phrase())


class MigSingleInstance:
    """A sharded replica never lands on MIG instances, in placement as in the
    catalog: a catalog edited around validation must still not start a
    process that can open only one of the devices it was given."""

    name = "mig-single-instance"

    def applies(self, request: Request) -> bool:
        return bool(request.mig_refused)

    def check(self, node: PlacementNode, request: Request) -> Rejection | None:
        if not request.mig_refused:
            return None
        if any(node.total.get(c) for c in request.classes):
            return None
        if any(node.total.get(c) for c in request.mig_refused):
            return Rejection(
                self.name,
                MIG_ONE_INSTANCE,
                " or ".join(request.mig_refused),
                requested=request.per_node * request.nodes,
                capacity=1,
            )
        return None


class EnoughFreeDevices(IndexedFilter):
    """Enough free, healthy, placeable devices of one accepted class."""

    name = "enough-free-devices"

    def check(self, node: PlacementNode, request: Request) -> Rejection | None:
        need = request.per_node
        best: tuple[int, int, int, str] | None = None  # (free, capacity, total, class)
        for gpu_class in request.classes:
            total = node.total.get(gpu_class, 0)
            if not total:
                continue
            free = node.free_count(gpu_class)
            if free >= need:
                return None
            candidate = (free, node.capacity.get(gpu_class, 0), total, gpu_class)
            if best is None or candidate > best:
                best = candidate
        if best is None:
            # ClassAccepted or MigSingleInstance has already said why.
            return Rejection(self.name, NO_CLASS, request.class_phrase(), requested=need)
        free, capacity, total, gpu_class = best
        if total < need:
            reason = TOO_SMALL
        elif capacity < need:
            reason = TOO_FEW_HEALTHY
        else:
            reason = TOO_FEW_FREE
        return Rejection(self.name, reason, gpu_class, need, free, capacity)


class EnoughMemory:
    """A CPU replica fits the node's RAM: its need (llmgw.memory) against
    what the node has left after the CPU replicas already placed there.

    Without it a node with four CPU slots takes four engines whatever their
    size, and the fifth gigabyte is found by the kernel's OOM killer. Only
    CPU slots are checked: a node that offers the model a GPU class (or
    does not report its RAM) is not refused here.
    """

    name = "enough-memory"

    def applies(self, request: Request) -> bool:
        return request.memory is not None

    def check(self, node: PlacementNode, request: Request) -> Rejection | None:
        need = request.memory.on(node.cpu_bf16) if request.memory is not None else 0
        free = node.memory_free_mib
        if not need or free is None or free >= need:
            return None
        if any(c != CPU_CLASS and node.free_count(c) >= request.per_node for c in request.classes):
            return None
        return Rejection(
            self.name, TOO_LITTLE_RAM, "ram", need, max(0, free), node.memory_total_mib
        )


class MultiNodeFilter:
    """A check that only a multi-node replica's placement needs."""

    def applies(self, request: Request) -> bool:
        return request.multi_node


class WholeNode(MultiNodeFilter):
    """A multi-node replica takes nodes nothing else runs on: its shards talk
    over the fabric at full rate, and a neighbour's traffic or memory
    pressure on a shared node slows every shard to the slowest one."""

    name = "whole-node"

    def check(self, node: PlacementNode, request: Request) -> Rejection | None:
        if not request.multi_node or node.entirely_free:
            return None
        return Rejection(
            self.name,
            NOT_ENTIRELY_FREE,
            "node",
            requested=node.capacity_total,
            available=node.capacity_total - node.used_total,
            capacity=node.capacity_total,
        )


class InFabric(MultiNodeFilter):
    """A multi-node replica needs nodes on a high-speed fabric at all; which
    fabric (one for all shards) is the placement's choice, not a filter's."""

    name = "in-fabric"

    def check(self, node: PlacementNode, request: Request) -> Rejection | None:
        if not request.multi_node or node.fabrics:
            return None
        return Rejection(self.name, NO_FABRIC, "fabric")


class AvoidFailedNodes:
    """Not a node where this model failed recently (``Request.avoid``).

    A filter rather than a negative score: no score can outweigh holding
    the weights without also outweighing everything else, and a bad node
    that holds the weights would win again. It is the one soft filter:
    ``Placer.try_place`` drops it when no other node fits, so a one-node
    fleet (or a model that only fits there) still retries, at the model's
    own backoff.
    """

    name = "avoid-failed-nodes"

    def applies(self, request: Request) -> bool:
        return bool(request.avoid)

    def check(self, node: PlacementNode, request: Request) -> Rejection | None:
        if not request.avoid or node.name not in request.avoid:
            return None
        return Rejection(self.name, FAILED_HERE, "node")


def usable_class(node: PlacementNode, request: Request) -> str | None:
    """The first accepted class (catalog order) with enough free devices."""
    for gpu_class in request.classes:
        if node.free_count(gpu_class) >= request.per_node:
            return gpu_class
    return None
