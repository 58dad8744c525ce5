"""bench/realkit/statecache.py: the engines' prompt cache in whole states, the hits reachable."""

from __future__ import annotations

import random
import sys

from tests.benchscripts import BENCH, load

sys.path.insert(0, str(BENCH))
from realkit import statecache

replay = load("routing_real_replay")


def served(order: list[int], budget: int) -> list[bool]:
    engine, hits = statecache.Engine(), []
    for tenant in order:
        engine, hit = engine.serve(tenant, budget)
        hits.append(hit)
    return hits


def test_an_engine_of_four_states_keeps_two_tenants_in_turn_not_three() -> None:
    a, b, c = 0, 1, 2
    assert served([a, b, a, b], 4) == [False, False, True, True]
    # The third tenant's miss touches the oldest state (a's), so its save
    # evicts a's second one; a and b then save twice more and c is gone.
    assert served([a, b, a, b, c, a, b, c], 4) == [False, False, True, True,
                                                   False, True, True, False]  # fmt: skip
    # The context the engine last computed answers with no state at all.
    assert served([a, a], 1) == [False, True]


def test_the_model_agrees_with_the_replays_token_level_engine() -> None:
    # bench/routing_real_replay.py keeps llama_cpp.server's states as token
    # sequences and finds prefixes token by token: the tenant-level model
    # must find the same hits on any order.
    rng = random.Random(7)
    for trial in range(50):
        budget = rng.choice((2, 3, 4))
        order = [rng.randrange(5) for _ in range(40)]
        engine = replay.LlamaCppServer(cache_states=budget, timing=replay.Timing())
        found = []
        for index, tenant in enumerate(order):
            tokens = (("h", 0), *(("c", tenant, i) for i in range(10)), ("q", index, 0))
            flight = replay.Flight(index, tenant, 0.0, 0, None, None, 0.0, len(tokens), 2)
            generation = replay.Generation(flight, tokens)
            engine.begin(generation)
            engine.end(generation)
            found.append(generation.found > len(tokens) // 2)
        assert served(order, budget) == found, (trial, budget, order)


def test_the_best_router_is_at_least_the_sticky_one_and_misses_each_tenant_once() -> None:
    rng = random.Random(3)
    for _ in range(10):
        order = [rng.randrange(6) for _ in range(30)]
        sticky = statecache.sticky_hits(order, 4)
        best = statecache.best_hits(order, 4)
        assert sticky <= best <= len(order) - len(set(order))
    # Four tenants in turn: two an engine, each engine holds both; a sticky
    # router misses each tenant once, and so does the best.
    order = [0, 1, 2, 3] * 6
    assert statecache.sticky_hits(order, 4) == statecache.best_hits(order, 4) == 24 - 4


def test_the_best_router_beats_sticky_where_a_tenant_is_better_moved() -> None:
    # Three tenants on two engines of two states: sticky puts two on one
    # engine, which can then keep only the one it served last.
    order = [0, 1, 2, 0, 2, 0, 2, 0, 2, 0, 2, 1]
    assert statecache.sticky_hits(order, 2) < statecache.best_hits(order, 2)
