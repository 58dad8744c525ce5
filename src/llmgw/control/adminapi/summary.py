"""The whole fleet in one answer (``GET /admin/v1/summary``).

A per-node listing is the right tool for four nodes and the wrong one for two
hundred: the questions that matter at that size -- how full am I, what is
broken, what is holding cards it is not using -- are aggregates, and reading
them off a long table is a chore that gets skipped. Everything here is
computed from the same views the listings return (the views package), in
one pass, so it can never disagree with them; it is a different question
asked of the same facts.

The fields and their rules are fixed by the reference (shared/seed/). Lists
are always present (empty where the reference leaves them out, or sends null
for ``gpus``) and ``store_error`` is null when there is none; each class also
carries ``free`` (total - used - unhealthy), which the reference computes on
demand. Both on purpose: a
client never has to tell "absent" from "none", and ``free`` is the number
every reader wants. Said to users in docs/install.md and in the OpenAPI
description (the Summary model's docstring).

``unplaceable`` follows the reference's rule to the letter:
``unplaceable or (total <= ready and not parked)``. A parked model is
exempt from the second half only; it is listed when the scheduler's last
pass called it unplaceable, which a pass after parking no longer does (a
parked model is not placed at all), so in a steady fleet a parked model is
under ``parked`` alone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field

from llmgw.control.adminapi.patroni import StoreMember, StoreStatus
from llmgw.control.adminapi.views.fleet import FleetViews
from llmgw.control.adminapi.views.models import ModelView, ReplicaTally, iter_model_views
from llmgw.control.adminapi.views.nodes import NodeView, iter_node_views
from llmgw.control.adminapi.views.replicas import ReplicaView, iter_replica_views
from llmgw.control.state import FleetState

# How long a replica must go unasked-for to be worth naming. Minutes rather
# than seconds, because a replica that flaps in and out of this list is
# noise, and because unloading one throws away its KV cache -- the thing
# prefix routing spent its effort filling.
IDLE_THRESHOLD_S = 10 * 60


class NodeTotals(BaseModel):
    """Nodes by the states that need different responses."""

    total: int = 0
    ready: int = 0
    cordoned: int = 0
    draining: int = 0
    unreachable: int = 0


class ClassUse(BaseModel):
    """How much of one kind of device is in use (MIG classes and ``cpu`` included)."""

    model_config = ConfigDict(
        validate_by_name=True, validate_by_alias=True, serialize_by_alias=True
    )

    gpu_class: str = Field(alias="class")
    total: int = 0
    used: int = 0
    # Unhealthy GPUs are neither used nor available, and counting them as
    # free is how a cluster looks like it has room it does not have.
    unhealthy: int = 0
    # What can still be allocated: total - used - unhealthy.
    free: int = 0


class FabricUse(BaseModel):
    """Capacity within one fabric.

    Per fabric because that is the unit at which the answer is actionable:
    fabrics are not connected to one another, so weights in one are not
    weights in another, and a multi-node replica never spans two.
    """

    fabric: str
    nodes: int = 0
    # Nodes here holding any weights, and distinct models among them: one
    # copy on a shared filer and twenty local copies are the same answer to
    # "can this fabric serve it".
    nodes_with_weights: int = 0
    models_present: int = 0
    # Ready nodes here with every device free, which is the number that
    # decides whether a multi-node replica can land.
    largest_free_block: int = 0


class ReplicaTotal(BaseModel):
    ready: int = 0
    starting: int = 0
    draining: int = 0
    failed: int = 0
    # Would be ready or starting, but a node of theirs stopped reporting:
    # not routed to, and replaced (scheduler/triage.py).
    unreachable: int = 0


class ModelTotals(BaseModel):
    """Models by whether they have what they should have now."""

    total: int = 0
    satisfied: int = 0
    short: int = 0


class ParkedModel(BaseModel):
    """A model no longer retried, and why."""

    model: str
    failures: int
    # The last error, always a string as the reference sends it: "" when
    # none was recorded.
    reason: str


class IdleReplica(BaseModel):
    """A replica holding hardware nothing is asking for."""

    id: str
    model: str
    idle_seconds: int
    gpus: int


class Summary(BaseModel):
    """The whole fleet in one answer: the reference llmgw's summary, with differences.

    Every field is always present: lists are ``[]`` when empty (``gpus``
    too, where the reference sends null) and ``store_error`` is null when the
    store was read, where the reference omits empty fields (a client should
    treat absent, null and empty alike). Each
    ``gpus`` entry also carries ``free`` (total - used - unhealthy), which the
    reference computes on demand, and ``replicas`` counts ``unreachable``
    ones too (a node stopped reporting). ``unplaceable`` is the reference's rule:
    short models the scheduler could not place, or with nothing starting
    unless parked; sorted by name. A replica with a request in flight is
    never in ``idle_replicas``. A fleet whose catalog has LoRA adapters also
    gets ``adapters``: per base model, the adapters loaded on each replica and
    those asked for and loaded nowhere, with why (control.adapters'
    ``AdapterPlacement``); absent otherwise, so the reference's fields stay
    exactly the reference's.
    """

    nodes: NodeTotals = Field(default_factory=NodeTotals)
    gpus: list[ClassUse] = Field(default_factory=list)
    fabrics: list[FabricUse] = Field(default_factory=list)
    replicas: ReplicaTotal = Field(default_factory=ReplicaTotal)
    models: ModelTotals = Field(default_factory=ModelTotals)
    # Models the scheduler cannot satisfy now: the line that turns
    # "something is wrong" into a place to look.
    unplaceable: list[str] = Field(default_factory=list)
    # Models that failed every time they started and are no longer retried.
    parked: list[ParkedModel] = Field(default_factory=list)
    # Serving replicas nothing has asked for in a while, longest first: on a
    # fleet with more models than GPUs, the first place to find room.
    idle_replicas: list[IdleReplica] = Field(default_factory=list)
    # The store's cluster members when it is replicated, and why they could
    # not be read; empty and null for a single database.
    store: list[StoreMember] = Field(default_factory=list)
    store_error: str | None = None


class SummaryBuilder:
    """Folds views into a summary one at a time (see the views package on why one at a time).

    Counts are plain ints until ``finish``: attribute writes on pydantic
    models cost about a microsecond each, thousands of times per summary.
    Every ``add_*`` takes ``sign=-1`` to take a view back out, which is how
    the route's summary is kept up to date between calls (summary_keeper.py)
    under the very rules that build it from scratch here.
    """

    def __init__(self, store: StoreStatus, *, collect_idle: bool = True) -> None:
        self._store = store
        # Off: the idle list is given whole (``set_idle``), not folded.
        self._collect_idle = collect_idle
        self._nodes: Counter[str] = Counter()
        self._replicas: Counter[str] = Counter()
        # class -> [total, used, unhealthy]
        self._classes: dict[str, list[int]] = {}
        # fabric -> [nodes, nodes_with_weights, largest_free_block]
        self._fabrics: dict[str, list[int]] = {}
        # fabric -> model -> nodes holding it (a count, so a node can leave).
        self._fabric_models: dict[str, Counter[str]] = {}
        # replica id -> (-idle seconds, id, model, gpus)
        self._idle: dict[str, tuple[int, str, str, int]] = {}
        self._models = [0, 0, 0]  # total, satisfied, short
        self._unplaceable: set[str] = set()
        self._parked: dict[str, ParkedModel] = {}

    def add_node(self, node: NodeView, sign: int = 1) -> None:
        self._nodes[node.state] += sign
        # Each class its own devices, which a node with a card in MIG mode
        # needs: its instances are one class or several, and any whole card
        # beside them another.
        for c in node.classes:
            row = self._classes.get(c.gpu_class)
            if row is None:
                row = self._classes[c.gpu_class] = [0, 0, 0]
            row[0] += sign * c.total
            row[1] += sign * (c.total - c.free - c.unhealthy)
            row[2] += sign * c.unhealthy
            if not any(row):
                del self._classes[c.gpu_class]
        # Entirely free, which is what a multi-node replica needs: a node
        # with one card in use cannot contribute a full-width shard.
        free_block = node.state == "ready" and 0 < node.gpu_total == node.gpu_free
        for fabric in node.fabrics:
            row = self._fabrics.get(fabric)
            if row is None:
                row = self._fabrics[fabric] = [0, 0, 0]
                self._fabric_models[fabric] = Counter()
            row[0] += sign
            if node.models:
                row[1] += sign
                # Distinct models per fabric: one copy on a shared filer and
                # twenty local copies are the same answer to "can this
                # fabric serve it".
                held = self._fabric_models[fabric]
                if sign > 0:
                    held.update(node.models)
                else:
                    held.subtract(node.models)
                    for model in node.models:
                        if held[model] <= 0:
                            del held[model]
            if free_block:
                row[2] += sign
            if not row[0]:
                del self._fabrics[fabric], self._fabric_models[fabric]

    def add_replica(self, replica: ReplicaView, sign: int = 1) -> None:
        state = replica.state
        self._replicas[state] += sign
        if state == "ready" and sign > 0 and self._collect_idle:
            idle = replica.idle_seconds
            if idle is not None and idle >= IDLE_THRESHOLD_S:
                self._idle[replica.id] = (-idle, replica.id, replica.model, replica.gpus)

    def set_idle(self, idle: list[tuple[int, str, str, int]]) -> None:
        """The idle replicas as (-idle seconds, id, model, gpus), replacing any added."""
        self._idle = {entry[1]: entry for entry in idle}

    def add_model(self, model: ModelView, sign: int = 1) -> None:
        counts = self._models
        counts[0] += sign
        if model.parked:
            if sign > 0:
                self._parked[model.name] = ParkedModel(
                    model=model.name, failures=model.failures, reason=model.reason or "")
            else:
                self._parked.pop(model.name, None)
        # Against what it should have now, not its minimum: an on-demand
        # model's minimum is 0, so one that was asked for and fitted nowhere
        # would count as satisfied.
        if model.ready >= model.desired and not model.parked:
            counts[1] += sign
            return
        counts[2] += sign
        # Short of replicas and unable to place more is the actionable case;
        # short and still starting is just a cluster doing its job. An
        # external model is short of URLs that are up: nothing to place.
        if model.external is not None:
            return
        if model.unplaceable or (model.total <= model.ready and not model.parked):
            if sign > 0:
                self._unplaceable.add(model.name)
            else:
                self._unplaceable.discard(model.name)

    def finish(self, store: StoreStatus | None = None) -> Summary:
        store = store or self._store
        nodes, replicas = self._nodes, self._replicas
        ready, cordoned, draining = nodes["ready"], nodes["cordoned"], nodes["draining"]
        total = sum(nodes.values())
        idle = sorted(self._idle.values())
        return Summary(
            store=list(store.members),
            store_error=store.error,
            nodes=NodeTotals(total=total, ready=ready, cordoned=cordoned, draining=draining,
                             unreachable=total - ready - cordoned - draining),
            gpus=[
                ClassUse(gpu_class=name, total=t, used=u, unhealthy=b, free=t - u - b)
                for name, (t, u, b) in sorted(self._classes.items())
            ],
            fabrics=[
                FabricUse(fabric=name, nodes=n, nodes_with_weights=w,
                          models_present=len(self._fabric_models[name]),
                          largest_free_block=b)
                for name, (n, w, b) in sorted(self._fabrics.items())
            ],
            replicas=ReplicaTotal(
                ready=replicas["ready"], draining=replicas["draining"],
                failed=replicas["failed"], unreachable=replicas["unreachable"],
                starting=sum(replicas.values()) - replicas["ready"] - replicas["draining"]
                - replicas["failed"] - replicas["unreachable"],
            ),
            models=ModelTotals(total=self._models[0], satisfied=self._models[1],
                               short=self._models[2]),
            unplaceable=sorted(self._unplaceable),
            # By name, the order the models are folded in from scratch.
            parked=[self._parked[name] for name in sorted(self._parked)],
            # Plain construction: validating in pydantic's core is twice as
            # fast as model_construct's Python loop (3.8 against 8.1 ms for
            # 1,556 idle replicas, measured).
            idle_replicas=[IdleReplica(id=rid, model=model, idle_seconds=-neg, gpus=gpus)
                           for neg, rid, model, gpus in idle],
        )


def summarize(views: FleetViews, store: StoreStatus) -> Summary:
    """The summary of listed views (what the listings returned)."""
    builder = SummaryBuilder(store)
    for node in views.nodes:
        builder.add_node(node)
    for replica in views.replicas:
        builder.add_replica(replica)
    for model in views.models:
        builder.add_model(model)
    return builder.finish()


def fleet_summary(
    state: FleetState, now: float, store: StoreStatus,
    on_model: Callable[[ModelView], None] | None = None,
) -> Summary:
    """The summary of the fleet as it is now: the same views, folded as they are built.

    ``on_model`` sees each model view as it is folded: the control plane's
    per-model metrics (llmgw.control.metrics) come from the very views the
    summary counts, so the two cannot disagree.
    """
    builder = SummaryBuilder(store)
    for node in iter_node_views(state, now, with_devices=False):
        builder.add_node(node)
    tally = ReplicaTally()
    for replica in iter_replica_views(state, now, detail=False):
        builder.add_replica(replica)
        tally.add(replica)
    for model in iter_model_views(state, now, tally):
        builder.add_model(model)
        if on_model is not None:
            on_model(model)
    return builder.finish()
