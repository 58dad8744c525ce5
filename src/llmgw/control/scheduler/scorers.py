"""Rankers: among nodes that may take a shard, which is best?

Each scorer is named, pure and returns a number in [0, 1]; the placer
combines them as a weighted mean, so every score shown in a plan reads on
the same scale and a scorer's weight says exactly how much it counts.
"""

from __future__ import annotations

from typing import Protocol

from llmgw.control.scheduler.filters import Request
from llmgw.control.scheduler.placementnode import PlacementNode


class Scorer(Protocol):
    name: str
    weight: float

    def score(self, node: PlacementNode, request: Request) -> float: ...


class WeightsLocal:
    """1 when the node already holds the model's weights.

    Copying tens of GB over the management network is the slowest thing the
    system does (minutes against seconds for an engine start), so this
    carries the largest weight: it outranks every packing concern.
    """

    name = "weights-local"

    def __init__(self, weight: float = 10.0) -> None:
        self.weight = weight

    def score(self, node: PlacementNode, request: Request) -> float:
        return 1.0 if request.model in node.weights else 0.0


class BinPack:
    """Prefer nodes that are already partly used.

    Filling partly used nodes first keeps whole nodes free, and whole free
    nodes are the only thing a multi-node or tp=8 replica can use: spreading
    small replicas thinly strands capacity that looks free on paper.
    """

    name = "bin-pack"

    def __init__(self, weight: float = 1.0) -> None:
        self.weight = weight

    def score(self, node: PlacementNode, request: Request) -> float:
        if node.capacity_total <= 0:
            return 0.0
        after = node.used_total + request.per_node
        return min(1.0, after / node.capacity_total)


class Spread:
    """Prefer nodes without a replica of the same model.

    Replicas of one model exist for failure isolation as much as for load:
    two on one node die together. Weighted above bin-packing so a second
    replica goes elsewhere when it can, below weights so it does not copy
    tens of GB to get there.
    """

    name = "spread"

    def __init__(self, weight: float = 2.0) -> None:
        self.weight = weight

    def score(self, node: PlacementNode, request: Request) -> float:
        return 1.0 / (1.0 + node.replicas.get(request.model, 0))
