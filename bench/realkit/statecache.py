"""How many cache hits any router could reach on bench/routing_real.py's llama.cpp engines.

llama_cpp.server's RAM prompt cache (llama_cpp 0.3, ``LlamaRAMCache`` and
``Llama._create_completion``) keeps whole states, not tokens: a lookup
touches the stored state sharing the longest prefix with the prompt (the
oldest of equals, and any state shares the chat template's first tokens, so a
cold prompt touches the oldest state), and every generation then saves a
new state keyed by its prompt and answer, evicting the least recently used
beyond the cache's budget. The context the engine last computed answers too:
a prompt that starts with it needs no state. So a tenant served twice holds
two states, and an engine with a budget of four holds about two tenants in
turn; the third it serves is evicted before it comes back.

Here that cache is modelled per tenant (a state is its tenant: the questions
after a tenant's context are a few tokens) and the workload's tenant order
is replayed through two engines: ``sticky`` is a router that keeps each
tenant on the engine it first went to, new tenants spread evenly (what
sglang-router's ``cache_aware`` does at this scale: its tree never fills);
``best`` searches every assignment of requests to engines, knowing the
whole order in advance (a beam over the engines' states: an upper bound no
router reaches online). Timing is left out: each engine serves its requests
in arrival order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# States kept from one request to the next by the search; two engines of four
# states over six tenants have a few thousand distinct states, so this
# keeps nearly all of them.
BEAM = 4000


@dataclass(frozen=True, slots=True)
class Engine:
    """One engine's prompt cache: its states' tenants, least recent first, and the live one."""

    states: tuple[int, ...] = ()
    live: int | None = None

    def holds(self, tenant: int) -> bool:
        return self.live == tenant or tenant in self.states

    def serve(self, tenant: int, budget: int) -> tuple[Engine, bool]:
        """The engine after serving ``tenant``, and whether its context was found cached."""
        hit = self.holds(tenant)
        states = list(self.states)
        if states:
            # The lookup touches the tenant's oldest state, else the oldest of all.
            touched = tenant if tenant in states else states[0]
            states.remove(touched)
            states.append(touched)
        states.append(tenant)
        return Engine(tuple(states[-budget:]), tenant), hit


def sticky_hits(order: Sequence[int], budget: int, engines: int = 2) -> int:
    """Hits when each tenant stays where it first went, new ones to the engine with fewest."""
    caches = [Engine()] * engines
    home: dict[int, int] = {}
    hits = 0
    for tenant in order:
        if tenant not in home:
            homed = [list(home.values()).count(e) for e in range(engines)]
            home[tenant] = homed.index(min(homed))
        at = home[tenant]
        caches[at], hit = caches[at].serve(tenant, budget)
        hits += hit
    return hits


def best_hits(order: Sequence[int], budget: int, engines: int = 2, beam: int = BEAM) -> int:
    """The most hits any assignment of the requests to engines gets, knowing the order."""
    layer: dict[tuple[Engine, ...], int] = {(Engine(),) * engines: 0}
    for tenant in order:
        following: dict[tuple[Engine, ...], int] = {}
        for caches, hits in layer.items():
            for at in range(engines):
                served, hit = caches[at].serve(tenant, budget)
                after = (*caches[:at], served, *caches[at + 1 :])
                # Engines are alike: one order of their caches stands for all.
                key = tuple(sorted(after, key=repr))
                if following.get(key, -1) < hits + hit:
                    following[key] = hits + hit
        layer = dict(sorted(following.items(), key=lambda kv: -kv[1])[:beam])
    return max(layer.values())


def reachable(order: Sequence[int], budget: int) -> dict[str, int]:
    """The hits a sticky router and the best router would get on two engines."""
    return {"requests": len(order), "sticky": sticky_hits(order, budget),
            "best": best_hits(order, budget)}  # fmt: skip
