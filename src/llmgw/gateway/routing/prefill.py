"""A replica's charge for one request until its answer starts, and what the request teaches.

Uncached prompt tokens sent to a replica are prefill work queued there,
which request counts miss: they are charged to it (``pending_prefill``)
from the send until the answer's first chunk, and the router reads them,
counted down from when the engine began on them (``Replica.charge``,
``Replica.answered``). The send is also when the policy records the
prompt's prefix on the replica; the first chunk of a stream that queued
behind none of this gateway's other prefills is a measurement of the
model's prefill speed. On an engine that computes one request at a time,
the first chunk of a stream also tells how long its prompt took from the
gateway's turn (the engine idle then): with the engine's token count, what
it found cached and, where it computed the prompt, the speed.
"""

from __future__ import annotations

import asyncio

from llmgw.gateway.routing.policy import Pick
from llmgw.gateway.routing.router import ModelRouter

# How long after an answer's start the router takes its prefill-speed sample
# (Prefill.started): past the first token's relay.
LEARN_AFTER_S = 0.005
# How long after an answer's start the prefix index's word on its prompt
# stands beside the replica's KV-cache events (Replica.claims): the engine
# publishes the blocks as the step that computed them ends, about when the
# first token leaves, and the relay passes them on within milliseconds.
CLAIM_AFTER_START_S = 1.0


class Prefill:
    """Uncached prompt tokens charged to a replica until its answer starts."""

    __slots__ = ("ahead", "answered", "computed_s", "pick", "router", "sent_at", "tokens",
                 "turn_at")  # fmt: skip

    def __init__(self, router: ModelRouter, pick: Pick) -> None:
        self.router = router
        self.pick = pick
        self.tokens = pick.uncached_tokens
        replica = pick.replica
        self.ahead = replica.pending_prefill
        self.answered = False
        self.turn_at = 0.0
        # Seconds from the turn to a stream's first chunk (Turns): None where untimed.
        self.computed_s: float | None = None
        self.sent_at = router.clock()
        replica.charge(self.tokens, self.sent_at)
        if pick.by_prefix:
            # The prefix is the replica's from the send on (docs/routing.md),
            # recorded on the loop's next turn: after the request is written
            # to a pooled connection, so hashing and the index's update
            # (~50 us where the gateway's code runs cold) never delay it.
            asyncio.get_running_loop().call_soon(router.record, pick)

    def turn_taken(self) -> None:
        """This gateway's turn at an engine computing one request at a time began."""
        self.turn_at = self.router.clock()

    def started(self, streamed: bool) -> None:
        now = self.router.clock()
        pick = self.pick
        if streamed and self.turn_at:
            # The engine had nothing of this gateway's when the turn began: the
            # time since is this prompt's prefill (and a token). An answer
            # given whole took its decoding too, and tells nothing.
            self.computed_s = now - self.turn_at
        if pick.by_prefix:
            # A timed prompt is sampled with its usage (Policy.metered): only
            # the engine's count and time tell whether it computed the prompt
            # or found it cached, and a cached one read as computed is a
            # speed many times the engine's.
            untimed = self.computed_s is None
            sample = self.tokens if streamed and untimed and self.ahead < 1.0 else 0.0
            if sample or pick.replica.serial:
                # Learnt a little after the answer's first chunk is on its
                # way: at low load this code runs cold, and work before the
                # first token (or between a chat stream's role chunk and its
                # first token) delayed it (docs/routing.md).
                asyncio.get_running_loop().call_later(
                    LEARN_AFTER_S, self._learn, sample, now - self.sent_at
                )
        replica = pick.replica
        replica.answered(self.tokens, now)
        self.tokens = 0.0
        self.answered = True
        if replica.exact is not None and pick.hashes:
            # Computed: its events follow within the relay's delay.
            replica.claim(pick.hashes[0], CLAIM_AFTER_START_S, now)

    def _learn(self, sample: float, seconds: float) -> None:
        if sample:
            self.router.measured(sample, seconds)
        if self.pick.replica.serial:
            # Such an engine computes a prompt at its turn, maybe long after
            # the send, and keeps the latest states: the index's order of
            # recency follows, the prefix recorded again as its answer starts.
            self.router.record(self.pick)

    def metered(self, prompt_tokens: int, cached_tokens: int) -> None:
        """The answer's usage, for what it tells the router of the prompt (Policy.metered)."""
        if self.pick.prompt_chars:
            self.router.metered(self.pick, prompt_tokens, cached_tokens, self.computed_s)

    def done(self) -> None:
        """The request's end; nothing to do once its answer started, or on a second call."""
        if self.answered:
            return
        self.answered = True
        replica = self.pick.replica
        if self.tokens:
            replica.pending_prefill -= self.tokens
            self.tokens = 0.0
        if replica.exact is not None and self.pick.hashes:
            # Whether its engine computed any of it, a full hit's included,
            # its events tell: the claim would only stand in their way.
            replica.claims.pop(self.pick.hashes[0], None)
