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
hit rate 0.692 shrinking, 0.713 not). The same verdict tells whether a
timed prompt is a prefill-speed sample: not where it contradicts the index.
"""

from __future__ import annotations

from llmgw.gateway.routing.policy import HIT, MISS, Pick
from llmgw.gateway.routing.replica import Replica

CAPACITY_STEP = 1.125
CAPACITY_RANGE = 4.0


def cached_by_time(prompt_tokens: int, computed_s: float, tokens_per_s: float) -> int:
    """The prompt tokens an engine found cached, from how long it computed the prompt."""
    return max(0, round(prompt_tokens - computed_s * tokens_per_s))


# What an engine's word on a prompt says of the index's view of its replica.
AGREES = ""
FORGOT = "forgot"  # routed as new, found at least half cached: the index forgot too early
EVICTED = "evicted"  # routed as held, found less than half of that: the engine evicted it


def verdict(pick: Pick, prompt_tokens: int, cached_tokens: int, chars_per_token: float) -> str:
    """AGREES, FORGOT or EVICTED: the engine's ``cached_tokens`` of ``prompt_tokens``
    against what the index counted held when it picked."""
    if pick.outcome == MISS:
        return FORGOT if 2 * cached_tokens >= prompt_tokens else AGREES
    if pick.outcome == HIT:
        held_share = 1.0 - pick.uncached_tokens * chars_per_token / max(pick.prompt_chars, 1)
        held = prompt_tokens * min(max(held_share, 0.0), 1.0)
        return EVICTED if 2 * cached_tokens < held else AGREES
    return AGREES


def correct(replica: Replica, found: str, *, shrink: bool = True) -> bool:
    """Correct the replica's index capacity by the verdict ``found``; whether it moved.
    ``shrink``: whether a prompt found evicted may shrink it (not when timed)."""
    if found == FORGOT:
        return _rescale(replica, CAPACITY_STEP)
    if found == EVICTED and shrink:
        return _rescale(replica, 1.0 / CAPACITY_STEP)
    return False


def computed(pick: Pick, prompt_tokens: int, cached_tokens: int, found: str,
             reported: bool) -> float:  # fmt: skip
    """The prompt tokens the engine computed, as a prefill-speed sample; 0: none to take.

    Where the engine said what it found cached (``reported``), its count.
    Otherwise the index's view, unless the verdict ``found`` contradicts it:
    a prompt routed as new that was found cached took a cache load's time,
    one routed as held that was found evicted a whole prefill's, neither
    the time of the tokens the index counted.
    """
    if reported:
        return float(prompt_tokens - cached_tokens)
    if found:
        return 0.0
    return float(prompt_tokens) if pick.outcome == MISS else pick.uncached_tokens


def _rescale(replica: Replica, factor: float) -> bool:
    """Scale the replica's index capacity by ``factor`` within CAPACITY_RANGE; whether it moved."""
    scale = min(max(replica.capacity_scale * factor, 1.0 / CAPACITY_RANGE), CAPACITY_RANGE)
    moved = scale != replica.capacity_scale
    replica.capacity_scale = scale
    return moved
