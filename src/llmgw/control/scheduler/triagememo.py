"""Steady models' triage answers, kept from one reconcile pass to the next.

A model whose replicas are all ready, of its shape, on settled nodes, as many
as it should have, with no failure counted (triage.steady_answer answered it), and
whose wanted count does not move with the clock (not on-demand, not
external), gets the same answer next pass unless something it was computed
from changed: its catalog entry or failure bookkeeping, its replicas (which
ones, their state, their shards), whether their nodes are settled, or their
nodes' devices. At 5,000 models that is nearly all of them, and answering
them again was half of a 10,000-node steady pass.

Changes are found by comparison, as the summary keeper finds them
(adminapi/summary_keeper.py): each pass reads those fields of every replica
and model into tuples (``operator.attrgetter``, in C) and compares them with
the last pass's; the replica table's write count says whether replicas came
or went; the settled nodes are compared as a set; the snapshot keeper says
which nodes' views it built again. A model touched by any of these is
triaged again. test_sched_shortcut.py decides random, changing fleets with
and without the memo and expects the same decisions.
"""

from __future__ import annotations

from collections.abc import Collection
from operator import attrgetter
from typing import Any

from llmgw.control.scheduler.decisions import SATISFIED, ModelWork
from llmgw.control.state import FleetState, ModelRecord, ReplicaRecord
from llmgw.wire import ReplicaState

# What an answer kept here was computed from, per replica and per model. A
# ready replica of a model that is not on-demand is read for its state and
# shards only (its use times matter to on-demand models alone).
_REPLICA = attrgetter("model", "state", "shards")
_MODEL = attrgetter(
    "spec.nodes", "spec.gpus", "spec.gpu_classes", "spec.min_replicas", "spec.max_replicas",
    "spec.on_demand", "spec.external", "failures", "parked", "node_failures", "load_demand",
)


class TriageMemo:
    def __init__(self) -> None:
        # model -> (its record, the answer)
        self._kept: dict[str, tuple[ModelRecord, ModelWork]] = {}
        self._replica_version = -1
        self._replica_inputs: list[tuple[Any, ...]] = []
        self._model_names: list[str] = []
        self._model_inputs: list[tuple[Any, ...]] = []
        self._settled: frozenset[str] = frozenset()

    def begin(
        self, state: FleetState, settled: frozenset[str], rebuilt: Collection[str] | None
    ) -> None:
        """Forget the answers that no longer hold; ``rebuilt``: nodes whose
        snapshot views were built again this pass (None: every node's)."""
        kept = self._kept
        replicas = state.replicas
        replica_inputs: list[tuple[Any, ...]] = list(map(_REPLICA, replicas.values()))
        models = state.models
        names = list(models)
        model_inputs: list[tuple[Any, ...]] = list(map(_MODEL, models.values()))
        if (
            rebuilt is None
            or replicas.version != self._replica_version
            or names != self._model_names
        ):
            kept.clear()
        elif kept:
            if replica_inputs != self._replica_inputs:
                for now_in, before in zip(replica_inputs, self._replica_inputs, strict=True):
                    if now_in != before:
                        kept.pop(str(now_in[0]), None)
                        kept.pop(str(before[0]), None)
            if model_inputs != self._model_inputs:
                for name, now_in, before in zip(names, model_inputs, self._model_inputs,
                                                strict=True):
                    if now_in != before:
                        kept.pop(name, None)
            touched = set(rebuilt)
            if settled != self._settled:
                touched |= settled.symmetric_difference(self._settled)
            for node in touched:
                for replica in replicas.on_node(node):
                    kept.pop(replica.model, None)
        self._replica_version = replicas.version
        self._replica_inputs, self._model_names, self._model_inputs = (
            replica_inputs, names, model_inputs)
        self._settled = settled

    def get(self, record: ModelRecord) -> ModelWork | None:
        found = self._kept.get(record.name)
        if found is None or found[0] is not record:
            return None
        return found[1]

    def keep(self, record: ModelRecord, replicas: list[ReplicaRecord], work: ModelWork) -> None:
        """Keep a steady answer (triage.steady_answer's) that the clock cannot change."""
        spec = record.spec
        if (
            work.to_place == 0
            and work.outcome.status == SATISFIED
            and len(work.outcome.kept) == len(replicas)
            and not spec.on_demand
            and spec.external is None
            and all(r.state is ReplicaState.READY for r in replicas)
        ):
            self._kept[record.name] = (record, work)
