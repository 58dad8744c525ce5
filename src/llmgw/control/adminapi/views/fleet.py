"""Every view of the fleet as lists: what the listings return.

The summary folds the same ``iter_*_views`` one view at a time instead
(summary.fleet_summary); building lists here and there from one set of
builders is what keeps the two in agreement.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.control.adminapi.views.models import ModelView, ReplicaTally, iter_model_views
from llmgw.control.adminapi.views.nodes import NodeView, iter_node_views
from llmgw.control.adminapi.views.replicas import ReplicaView, iter_replica_views
from llmgw.control.state import FleetState


@dataclass(slots=True)
class FleetViews:
    nodes: list[NodeView]
    replicas: list[ReplicaView]
    models: list[ModelView]


def fleet_views(state: FleetState, now: float, *, with_devices: bool = True) -> FleetViews:
    """Every view as lists: what the listings return."""
    replicas = list(iter_replica_views(state, now))
    return FleetViews(
        nodes=list(iter_node_views(state, now, with_devices=with_devices)),
        replicas=replicas,
        models=list(iter_model_views(state, now, ReplicaTally(replicas))),
    )
