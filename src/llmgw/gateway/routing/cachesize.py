"""What an engine's word on the prompt tokens it found cached tells the prefix index of its size.

The KV capacity a replica was started with is only a start: a prompt cache
beside the context holds more, a pool shared with long answers less, and an
engine that keeps whole prompt states (llama_cpp.server) keeps one per
answer, so a group it serves often holds several. A prompt routed as new
that the engine had at least half cached: the index forgot too early, its
capacity for that replica grows by CAPACITY_STEP; a prompt routed as held
that the engine found less than half of what the index counted held
(on an engine known to tell): it shrinks. Kept within CAPACITY_RANGE of the
configured size either way.

Engines that report cached tokens (vLLM's ``cached_tokens``, llama-server's
timings) tell it in their usage. One that computes one request at a time
and says nothing tells it by its time: the gateway sends it one request at
a time (Turns), so from the turn to the stream's first chunk the engine
computed this prompt alone, and at the measured prefill speed a hit (a
question's few tokens, ~0.1 s on bench/routing_real.py's engines) and a
miss (the whole context, ~2.8 s) are twenty-fold apart. From the time the
capacity only grows: such an engine (llama_cpp.server) keeps whole prompt
states, one per answer, and evicts the least recently used state, which is
not the index's least recently used prefix; a smaller index forgets the
prefixes the engine still holds, routes them as new and counts their
queues a whole prefill long (bench/routing_real_replay.py over 20 seeds:
hit rate 0.692 shrinking, 0.713 not).
"""

from __future__ import annotations

from llmgw.gateway.routing.policy import HIT, MISS, Pick
from llmgw.gateway.routing.replica import Replica

CAPACITY_STEP = 1.125
CAPACITY_RANGE = 4.0


def cached_by_time(prompt_tokens: int, computed_s: float, tokens_per_s: float) -> int:
    """The prompt tokens an engine found cached, from how long it computed the prompt."""
    return max(0, round(prompt_tokens - computed_s * tokens_per_s))


def computed(pick: Pick, prompt_tokens: int, cached_tokens: int, reported: bool) -> float:
    """The prompt tokens the engine computed, as a prefill-speed sample; 0: none to take.

    ``cached_tokens``: what the engine reported (``reported``) or its time
    told. A prompt routed as new that was found mostly cached took a cache
    load's time, not a prefill's: no sample. Otherwise the engine's count
    where it said what it found, else the index's view: the whole prompt
    for one routed as new, the part it did not hold for a hit.
    """
    if reported:
        return float(prompt_tokens - cached_tokens)
    if pick.outcome == MISS:
        return 0.0 if 2 * cached_tokens >= prompt_tokens else float(prompt_tokens)
    return pick.uncached_tokens


def correct(pick: Pick, prompt_tokens: int, cached_tokens: int, told: bool,
            chars_per_token: float, *, shrink: bool = True) -> bool:  # fmt: skip
    """Correct the capacity of the pick's replica by what its engine found cached;
    whether it moved. ``told``: the engine said (a 0 from one that never does means nothing);
    ``shrink``: whether a prompt found evicted may shrink it (not when timed)."""
    replica = pick.replica
    if told:
        replica.reports_cached = True
    if not replica.reports_cached:
        return False
    if pick.outcome == MISS:
        return 2 * cached_tokens >= prompt_tokens and _rescale(replica, CAPACITY_STEP)
    if pick.outcome == HIT and shrink:
        held_share = 1.0 - pick.uncached_tokens * chars_per_token / max(pick.prompt_chars, 1)
        held = prompt_tokens * min(max(held_share, 0.0), 1.0)
        return 2 * cached_tokens < held and _rescale(replica, 1.0 / CAPACITY_STEP)
    return False


def _rescale(replica: Replica, factor: float) -> bool:
    """Scale the replica's index capacity by ``factor`` within CAPACITY_RANGE; whether it moved."""
    scale = min(max(replica.capacity_scale * factor, 1.0 / CAPACITY_RANGE), CAPACITY_RANGE)
    moved = scale != replica.capacity_scale
    replica.capacity_scale = scale
    return moved
