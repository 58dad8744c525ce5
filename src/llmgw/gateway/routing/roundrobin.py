"""Round-robin: each model's replicas in turn, whatever their load or the prompt.

The baseline the other policies are measured against (bench/routing.py):
at low load it rarely puts two requests on one engine, and it needs no
state beyond the model's turn.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmgw.gateway.routing.policy import UNROUTED, Pick, Policy
from llmgw.gateway.routing.replica import Replica


class RoundRobin(Policy):
    __slots__ = ()

    def choose(
        self, replicas: Sequence[Replica], prompt: str | None, turn: int,
        tokens: Sequence[int] | None = None,
    ) -> Pick:  # fmt: skip
        return Pick(replicas[turn % len(replicas)], UNROUTED, [], 0.0)
