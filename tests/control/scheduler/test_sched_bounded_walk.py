"""The placer's walk of the free-device buckets stops once nothing left can
change the answer, and its answer is the full walk's.

``Placer._place_single`` (the default scorers, written out) stops walking
the buckets when every holder of the weights was looked at and the best
``show_top`` candidates score at least what any node without the weights
can score. ``_place_single_scored`` (any other scorers; here the same
scorers under another type) walks as far as the candidate limit says, so
the two must agree on every pick and every candidate shown, whatever the
limit, the number shown, the nodes holding weights and what is already
placed.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from tests.control.scheduler.schedkit import passes_settings

from llmgw.control.scheduler.filters import Request
from llmgw.control.scheduler.placed import Placement, commit
from llmgw.control.scheduler.placement import Placer
from llmgw.control.scheduler.scorers import BinPack, Spread, WeightsLocal
from llmgw.control.scheduler.snapshot import PlacementSnapshot, build_snapshot
from llmgw.control.state import FleetState
from llmgw.sim.fleetgen import fleet, gpu_node, model
from llmgw.wire import NodeState

NOW = 1000.0
CLASSES = ["h100-80g", "a100-80g"]


class _SameBinPack(BinPack):
    """BinPack under another type: the placer then walks the full way."""


def _placers(limit: int, shown: int) -> tuple[Placer, Placer]:
    bounded = Placer(candidate_limit=limit, show_top=shown)
    full = Placer(candidate_limit=limit, show_top=shown)
    full.scorers = (WeightsLocal(10.0), Spread(2.0), _SameBinPack(1.0))
    return bounded, full


class _Counting(dict[str, Any]):
    """A snapshot's nodes that count the views looked up."""

    looked_up = 0

    def __getitem__(self, name: str) -> Any:
        self.looked_up += 1
        return super().__getitem__(name)


@st.composite
def fleets(draw: st.DrawFn) -> tuple[FleetState, list[tuple[str, int, str]]]:
    """Nodes of two classes, some holding m's weights, and devices already held."""
    nodes = []
    held: list[tuple[str, int, str]] = []
    for index in range(draw(st.integers(1, 30))):
        name = f"n{index:02d}"
        gpus = draw(st.sampled_from([1, 2, 4, 8, 8]))
        nodes.append(
            gpu_node(
                name,
                gpu_class=draw(st.sampled_from(CLASSES)),
                gpus=gpus,
                unhealthy=draw(st.sets(st.integers(0, gpus - 1), max_size=1)),
                weights=["m"] if draw(st.integers(0, 2)) == 0 else [],
                admin_state=draw(st.sampled_from([NodeState.READY] * 6 + [NodeState.CORDONED])),
                seen_at=NOW,
            )
        )
        used = draw(st.integers(0, gpus))
        if used:
            held.append((name, used, draw(st.sampled_from(["m", "other"]))))
    return fleet(nodes, []), held


def _snapshot(state: FleetState, held: list[tuple[str, int, str]]) -> PlacementSnapshot:
    snapshot = build_snapshot(state, NOW)
    for name, used, owner in held:
        view = snapshot.nodes[name]
        free = [n for numbers in view.free.values() for n in numbers][:used]
        if free:
            snapshot.allocate(name, free, owner)
    return snapshot


@given(
    drawn=fleets(),
    gpus=st.sampled_from([1, 2, 4, 8]),
    classes=st.lists(st.sampled_from(CLASSES), min_size=1, max_size=2, unique=True),
    limit=st.integers(1, 9),
    shown=st.integers(0, 4),
    avoid=st.sets(st.sampled_from([f"n{i:02d}" for i in range(30)]), max_size=3),
    replicas=st.integers(1, 6),
)
@passes_settings(max_examples=300)
def test_the_bounded_walk_picks_and_shows_what_the_full_walk_does(
    drawn: tuple[FleetState, list[tuple[str, int, str]]],
    gpus: int,
    classes: list[str],
    limit: int,
    shown: int,
    avoid: set[str],
    replicas: int,
) -> None:
    state, held = drawn
    bounded, full = _placers(limit, shown)
    ours, theirs = _snapshot(state, held), _snapshot(state, held)
    request = Request.for_spec(model("m", gpus=gpus, classes=classes))
    if avoid:
        request = Request(**{**_fields(request), "avoid": frozenset(avoid)})
    for _ in range(replicas):  # each placed before the next, as a pass does
        got, expected = bounded.place(ours, request), full.place(theirs, request)
        assert type(got) is type(expected)
        if not isinstance(got, Placement) or not isinstance(expected, Placement):
            break
        assert got.shards == expected.shards
        assert got.candidates == expected.candidates
        commit(ours, got)
        commit(theirs, expected)


def _fields(request: Request) -> dict[str, Any]:
    return {name: getattr(request, name) for name in Request.__slots__}


def test_a_holder_of_the_weights_that_fits_ends_the_walk() -> None:
    """Three holders with room: no node without the weights can outrank them,
    so none of the 40 others is looked at."""
    holders = [gpu_node(f"h{i}", weights=["m"], seen_at=NOW) for i in range(3)]
    others = [gpu_node(f"o{i:02d}", seen_at=NOW) for i in range(40)]
    snapshot = build_snapshot(fleet([*holders, *others], []), NOW)
    snapshot.nodes = counting = _Counting(snapshot.nodes)
    result = Placer().place(snapshot, Request.for_spec(model("m")))
    assert isinstance(result, Placement)
    assert [c.node for c in result.candidates] == ["h0", "h1", "h2"]
    assert counting.looked_up <= 3 + 1  # the holders, and the pick's view


def test_the_walk_stops_at_as_many_perfect_fits_as_are_shown() -> None:
    """Whole nodes for an 8-GPU replica all score the most a node without the
    weights can: the walk stops at the third (show_top) instead of the eighth
    (candidate_limit), and shows the three the full walk shows."""
    nodes = [gpu_node(f"n{i:02d}", seen_at=NOW) for i in range(20)]
    snapshot = build_snapshot(fleet(nodes, []), NOW)
    snapshot.nodes = counting = _Counting(snapshot.nodes)
    request = Request.for_spec(model("m", gpus=8))
    result = Placer().place(snapshot, request)
    assert isinstance(result, Placement)
    assert counting.looked_up <= 3 + 1
    _, full = _placers(8, 3)
    expected = full.place(build_snapshot(fleet(nodes, []), NOW), request)
    assert isinstance(expected, Placement)
    assert result.candidates == expected.candidates
    assert [c.node for c in result.candidates] == ["n00", "n01", "n02"]
