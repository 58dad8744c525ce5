"""A replica's charge for one request until its answer starts, and what the start teaches.

Uncached prompt tokens sent to a replica are prefill work queued there,
which request counts miss: they are charged to it (``pending_prefill``)
from the send until the answer's first chunk, and the router reads them.
The first chunk is also when the replica holds the prompt's prefix (the
policy records it then) and, for a stream that queued behind none of this
gateway's other prefills, a measurement of the model's prefill speed.
"""

from __future__ import annotations

import asyncio
import time

from llmgw.gateway.routing.policy import Pick
from llmgw.gateway.routing.router import ModelRouter

# How long after an answer's start the router records its prefix and prefill
# speed (Prefill.started): past the first token's relay, well before a
# second prompt of the same group usually comes.
LEARN_AFTER_S = 0.005


class Prefill:
    """Uncached prompt tokens charged to a replica until its answer starts."""

    __slots__ = ("ahead", "pick", "router", "sent_at", "tokens")

    def __init__(self, router: ModelRouter, pick: Pick) -> None:
        self.router = router
        self.pick = pick
        self.tokens = pick.uncached_tokens
        self.ahead = pick.replica.pending_prefill
        pick.replica.pending_prefill += self.tokens
        self.sent_at = time.perf_counter()

    def started(self, streamed: bool) -> None:
        if self.pick.by_prefix:  # else nothing to record or measure
            # Learnt a little after the answer's first chunk is on its way:
            # at low load this code runs cold, and learning before the first
            # token (or between a chat stream's role chunk and its first
            # token) delayed it (docs/routing.md). A prompt routed meanwhile
            # misses only this one's blocks.
            sample = self.tokens if streamed and self.ahead < 1.0 else 0.0
            asyncio.get_running_loop().call_later(
                LEARN_AFTER_S, self._learn, sample, time.perf_counter()
            )
        self.done()

    def _learn(self, sample: float, answered_at: float) -> None:
        if sample:
            self.router.measured(sample, answered_at - self.sent_at)
        self.router.record(self.pick)

    def metered(self, prompt_tokens: int, cached_tokens: int) -> None:
        """The answer's usage, for what it tells the router of the prompt (Policy.metered)."""
        if self.pick.prompt_chars:
            self.router.metered(self.pick, prompt_tokens, cached_tokens)

    def done(self) -> None:
        if self.tokens:
            self.pick.replica.pending_prefill -= self.tokens
            self.tokens = 0.0
