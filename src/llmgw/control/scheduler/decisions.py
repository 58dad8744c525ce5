"""What one reconcile pass reads as knobs (Policy) and returns (Decisions).

The decision step itself is ``decide`` (decide.py). These types are shared
by the reconciler, which writes the decisions to the store and then to
memory, and the planner, which shows them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmgw.control.scheduler.node_failures import Avoided
from llmgw.control.scheduler.placed import Placement, Unplaceable
from llmgw.control.scheduler.snapshot import PlacementSnapshot
from llmgw.control.state import REPLACE_AFTER_S, ModelRecord, NodeFailure, ReplicaRecord
from llmgw.wire import Event

# A model's outcome status: one of these, or an Unplaceable's own status
# (explain.CANNOT_FIT_NOW, explain.CAN_NEVER_FIT) when placing it failed.
SATISFIED = "satisfied"
PLACING = "placing"
PARKED = "parked"
BACKING_OFF = "backing off"


@dataclass(frozen=True, slots=True)
class Policy:
    """The reconciler's knobs; the planner takes the same object."""

    # Parking: a model is parked after ``failure_limit`` consecutive failed
    # starts, once those failures have hit at least ``park_min_nodes``
    # distinct nodes (or every ready node that could hold it, when fewer):
    # one broken node failing every replica put on it says nothing about
    # the model, and must not park it while other nodes run it fine. See
    # triage.py (``_should_park``) and docs/catalog.md.
    failure_limit: int = 5
    park_min_nodes: int = 2
    backoff_base_s: float = 5.0
    backoff_max_s: float = 300.0
    # After a model fails on a node, placement avoids that node for this
    # model: a minute after the first failure there, doubling per failure,
    # at most an hour. Minutes, not the model's seconds: a node that fails
    # a start (driver, ECC, a wedged card) rarely heals in seconds, and the
    # avoidance only bites when another node can take the replica. Capped
    # so a repaired node is used again within the hour without an operator.
    node_backoff_base_s: float = 60.0
    node_backoff_max_s: float = 3600.0
    replace_after_s: float = REPLACE_AFTER_S
    # A replica marked draining is removed once no request is in flight and
    # gateways have had this long to see the new routing table ...
    drain_grace_s: float = 5.0
    # ... or after this long in any case (a gateway that went away keeps
    # reporting nothing, and its stale in-flight count must not pin a node).
    drain_timeout_s: float = 120.0
    # An on-demand replica is evicted for another model only after this long
    # unasked-for: two models taking turns on one card every pass would
    # reload weights forever and serve nothing.
    evict_min_idle_s: float = 60.0

    def backoff(self, failures: int) -> float:
        return _doubling(self.backoff_base_s, self.backoff_max_s, failures)

    def node_backoff(self, failures: int) -> float:
        """How long a model avoids a node after ``failures`` failures there."""
        return _doubling(self.node_backoff_base_s, self.node_backoff_max_s, failures)


def _doubling(base: float, cap: float, failures: int) -> float:
    if failures <= 0:
        return 0.0
    # The exponent is bounded: a model failing on one node only is never
    # parked, so its count keeps growing, and 2 ** 1100 overflows a float.
    return float(min(cap, base * 2.0 ** min(failures - 1, 60)))


@dataclass(slots=True)
class ModelUpdate:
    """New values of a model's failure bookkeeping (persisted)."""

    name: str
    failures: int
    parked: bool
    last_error: str | None
    backoff_until: float
    # By node (persisted with the model; see state.NodeFailure).
    node_failures: dict[str, NodeFailure] = field(default_factory=dict)


@dataclass(slots=True)
class Removal:
    replica: ReplicaRecord
    kind: str  # failed, replaced, scaled-down, unloaded, evicted, drained, orphaned


@dataclass(slots=True)
class ModelOutcome:
    """What the pass did or would do for one model (the planner shows it)."""

    name: str
    desired: int
    kept: list[ReplicaRecord] = field(default_factory=list)
    moving: list[ReplicaRecord] = field(default_factory=list)
    placed: list[tuple[ReplicaRecord, Placement]] = field(default_factory=list)
    status: str = SATISFIED
    reason: str | None = None
    unplaceable: Unplaceable | None = None
    # Nodes placement avoids for this model after failures there, and those
    # of them it used anyway because no other node fitted.
    avoided: tuple[Avoided, ...] = ()
    used_anyway: set[str] = field(default_factory=set)


@dataclass(slots=True)
class Decisions:
    now: float
    new: list[ReplicaRecord] = field(default_factory=list)
    removals: list[Removal] = field(default_factory=list)
    mark_draining: list[ReplicaRecord] = field(default_factory=list)
    models: dict[str, ModelUpdate] = field(default_factory=dict)
    # model -> unplaceable reason (None: placeable); memory only.
    reasons: dict[str, str | None] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    outcomes: dict[str, ModelOutcome] = field(default_factory=dict)
    # replica id -> when it was first seen draining (memory of the reconciler).
    draining_since: dict[str, float] = field(default_factory=dict)
    snapshot: PlacementSnapshot | None = None

    @property
    def changes_replicas(self) -> bool:
        return bool(self.new or self.removals or self.mark_draining)

    def event(
        self, kind: str, subject: str, message: str, **data: str | int | float | None
    ) -> None:
        self.events.append(
            Event(at=self.now, kind=kind, subject=subject, message=message, data=data)
        )


@dataclass(slots=True)
class ModelWork:
    """A model's pending placement work, between the two phases of a pass."""

    record: ModelRecord
    outcome: ModelOutcome
    to_place: int
    moving_ids: list[str]
