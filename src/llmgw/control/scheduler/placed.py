"""What placing one replica answers: the shards picked, or why none could be.

A :class:`Placement` is what the placer (placement.py) would do, not done:
:func:`commit` applies it to the snapshot, so the next decisions of the
same pass see those devices taken, and writing the replica is the
reconciler's separate step. An :class:`Unplaceable` carries the sentence
and the counts explain.py made of the refusals.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmgw.control.scheduler.filters import Request
from llmgw.control.scheduler.placementnode import PlacementNode
from llmgw.control.scheduler.snapshot import PlacementSnapshot
from llmgw.wire import ShardAssignment


@dataclass(frozen=True, slots=True)
class Candidate:
    """A scored node: the total (weighted mean) and each scorer's part."""

    node: str
    gpu_class: str
    score: float
    scores: tuple[tuple[str, float], ...]


@dataclass(frozen=True, slots=True)
class ShardPick:
    node: str
    gpu_class: str
    numbers: tuple[int, ...]
    uuids: tuple[str, ...]


@dataclass(slots=True)
class Placement:
    request: Request
    shards: list[ShardPick]
    fabric: str | None = None
    # The best candidates considered, best first (shown by the planner).
    candidates: list[Candidate] = field(default_factory=list)

    def shard_assignments(self) -> list[ShardAssignment]:
        return [
            ShardAssignment(
                node=s.node,
                rank=rank,
                device_numbers=list(s.numbers),
                device_uuids=list(s.uuids),
            )
            for rank, s in enumerate(self.shards)
        ]


@dataclass(slots=True)
class Unplaceable:
    request: Request
    status: str  # CANNOT_FIT_NOW or CAN_NEVER_FIT
    reason: str  # a sentence a person can act on
    # Nodes by the first reason that refused them, e.g. {"cordoned": 96}.
    counts: dict[str, int] = field(default_factory=dict)


def pick_shard(view: PlacementNode, gpu_class: str, count: int) -> ShardPick:
    """The node's first ``count`` free devices of the class."""
    numbers = tuple(view.free[gpu_class][:count])
    return ShardPick(view.name, gpu_class, numbers, tuple(view.uuids[n] for n in numbers))


def commit(snapshot: PlacementSnapshot, placement: Placement) -> None:
    """Apply a placement to the snapshot so the next decisions see it."""
    for shard in placement.shards:
        snapshot.allocate(shard.node, shard.numbers, placement.request.model)
