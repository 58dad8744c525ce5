"""The placer's written-out default scoring places exactly as the scorer objects do.

``Placer._place_single`` computes WeightsLocal, Spread and BinPack inline
when those are its scorers; any other set goes through the objects
(``_place_single_scored``). A BinPack subclass that changes nothing forces
the second path, so the two must agree on every placement, every candidate
shown (scores and parts) and every event, over fleets that fill up across
passes.
"""

from __future__ import annotations

import pytest
from tests.control.scheduler.schedkit import apply

from llmgw.control.scheduler.decide import Scheduler
from llmgw.control.scheduler.placement import Placer
from llmgw.control.scheduler.scorers import BinPack, Spread, WeightsLocal
from llmgw.control.state import FleetState
from llmgw.sim import fleetgen
from llmgw.wire import ReplicaState


class _SameBinPack(BinPack):
    """BinPack under another type: the placer then scores through the objects."""


def _through_objects() -> Placer:
    placer = Placer()
    placer.scorers = (WeightsLocal(10.0), Spread(2.0), _SameBinPack(1.0))
    return placer


def _passes(state: FleetState, placer: Placer, passes: int) -> list[object]:
    """What each pass placed and showed, ids aside (they are random)."""
    scheduler = Scheduler(placer=placer)
    seen: list[object] = []
    for step in range(passes):
        now = 1000.0 + step
        decisions = scheduler.decide(state, now)
        seen.append(
            [
                (
                    name,
                    [(p.shards, p.candidates, p.fabric) for _, p in outcome.placed],
                    outcome.reason,
                )
                for name, outcome in sorted(decisions.outcomes.items())
            ]
        )
        seen.append(
            [(e.kind, e.subject, e.data.get("node"), e.data.get("score")) for e in decisions.events]
        )
        apply(state, decisions)
        for replica in state.replicas.values():  # started: the next pass sees them ready
            if replica.state is ReplicaState.STARTING:
                replica.state, replica.ready_at = ReplicaState.READY, now
        for node in state.nodes.values():
            node.last_seen = now
    return seen


@pytest.mark.parametrize(("nodes", "models", "seed"), [(40, 60, 1), (120, 90, 2), (300, 200, 3)])
def test_inline_scoring_places_as_the_scorers_do(nodes: int, models: int, seed: int) -> None:
    def fleet() -> FleetState:
        return fleetgen.generate(nodes=nodes, models=models, seed=seed, now=1000.0)

    inline = _passes(fleet(), Placer(), passes=3)
    scored = _passes(fleet(), _through_objects(), passes=3)
    assert inline == scored
    # Something was placed and shown, or the comparison proves nothing.
    assert any(placed for step in inline[::2] for _, placed, _ in step)  # type: ignore[attr-defined]
