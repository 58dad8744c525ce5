"""A replica as this gateway sees it: its address, its load, its failures.

:class:`Replica` objects outlive config versions (the snapshot carries them
over by replica id), so in-flight counts and cool-downs survive a config
update that merely adds or removes another replica. :func:`mix` is the hash
every policy scores replicas with: identical in every gateway process, so
gateways that share no state agree on where a key goes.
"""

from __future__ import annotations

import hashlib
import time

from llmgw import wire
from llmgw.gateway.dialect import mending_for
from llmgw.gateway.routing.kvcache import ExactCache
from llmgw.gateway.routing.turns import Turns

_M64 = (1 << 64) - 1
# Claims a replica keeps (Replica.claims): far more prompts than one engine
# computes at once.
CLAIMS_KEPT = 256
# How long a prompt sent and not yet answered stays claimed (Replica.claims)
# at most: far beyond any prefill's wait, so that a claim whose end was never
# seen (a send that failed before it was recorded) cannot stand for good.
CLAIM_UNANSWERED_S = 300.0


def mix(value: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread 64-bit mix, identical everywhere."""
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _M64
    return value ^ (value >> 31)


class Replica:
    """One endpoint as this gateway sees it: address, load, failure history."""

    __slots__ = (
        "capacity_scale",
        "claims",
        "cooled_until",
        "engine_key",
        "exact",
        "failures",
        "in_flight",
        "kv_capacity_tokens",
        "kv_events",
        "last_request_at",
        "mending",
        "pending_prefill",
        "prefill_since",
        "replica_id",
        "reports_cached",
        "requests",
        "seed",
        "serial",
        "turns",
        "url",
    )

    def __init__(self, endpoint: wire.Endpoint) -> None:
        self.replica_id = endpoint.replica_id
        self.url = endpoint.url.rstrip("/")
        self.kv_capacity_tokens = endpoint.kv_capacity_tokens
        self.mending = mending_for(endpoint.dialect)
        self.serial = _serial(endpoint)
        self.turns = Turns()  # taken only while serial
        self.engine_key = endpoint.engine_key  # sent upstream, never to clients
        # Where its engine publishes its KV-cache events, and what they tell
        # of its cache (set by routing.kvfollow once followed; None: routed
        # by the prefix index's estimate).
        self.kv_events = endpoint.kv_events
        self.exact: ExactCache | None = None
        # Prompts sent to it whose blocks its events may not show yet (the
        # engine publishes a block once computed): the prefix index's first
        # block of each -> until when the index's word stands beside the
        # events (kvmatch.exact_matches). Kept only while ``exact`` is.
        self.claims: dict[int, float] = {}
        # Rendezvous seed from the id, so every gateway derives the same one.
        digest = hashlib.blake2b(self.replica_id.encode("utf-8"), digest_size=8).digest()
        self.seed = int.from_bytes(digest, "little")
        self.in_flight = 0
        # Uncached prompt tokens of in-flight requests not yet answered: the
        # prefill work queued on this replica, which request counts miss.
        self.pending_prefill = 0.0
        # When the engine began on that queue (the router's clock): its send
        # onto an empty queue, or the last answer's start, when the engine
        # moved on to the next prompt. The prefix policy counts the queue down
        # from then at the measured speed (queued).
        self.prefill_since = 0.0
        self.last_request_at: float | None = None
        self.requests = 0  # since the last load report
        self.failures = 0  # consecutive connection failures
        self.cooled_until = 0.0
        # The prefix index's capacity for it over the configured one, as the
        # engine's reports of cached prompt tokens corrected it; and whether
        # it has reported any in its usage (an engine that never does reads
        # as 0; its times are judged apart, answer by answer).
        self.capacity_scale = 1.0
        self.reports_cached = False

    def update(self, endpoint: wire.Endpoint) -> None:
        self.url = endpoint.url.rstrip("/")
        self.kv_capacity_tokens = endpoint.kv_capacity_tokens
        self.mending = mending_for(endpoint.dialect)
        self.serial = _serial(endpoint)
        self.engine_key = endpoint.engine_key
        self.kv_events = endpoint.kv_events

    def charge(self, tokens: float, now: float) -> None:
        """``tokens`` of uncached prompt sent to it at ``now``, queued until its answer starts."""
        if self.pending_prefill < 1.0:
            self.prefill_since = now
        self.pending_prefill += tokens

    def answered(self, tokens: float, now: float) -> None:
        """An answer charged ``tokens`` started at ``now``: its prefill is done, the next begins."""
        self.pending_prefill -= tokens
        self.prefill_since = now

    def claim(self, first_block: int, seconds: float, now: float) -> None:
        """The prompt with ``first_block`` counts as held here for ``seconds`` from ``now``
        (the router's clock), whatever the events say (see ``claims``)."""
        claims = self.claims
        claims[first_block] = now + seconds
        if len(claims) > CLAIMS_KEPT:
            for block in [b for b, t in claims.items() if t < now]:
                del claims[block]
            if len(claims) > CLAIMS_KEPT:  # (that many prompts in prefill at once)
                del claims[next(iter(claims))]

    def load(self, tokens_per_unit: float) -> float:
        return self.in_flight + self.pending_prefill / tokens_per_unit

    def connect_failed(self, cooldown_after: int, cooldown_s: float) -> None:
        self.failures += 1
        if self.failures >= cooldown_after:
            self.cooled_until = time.monotonic() + cooldown_s

    def connect_succeeded(self) -> None:
        if self.failures:
            self.failures = 0
            self.cooled_until = 0.0


def _serial(endpoint: wire.Endpoint) -> bool:
    """Whether the endpoint's engine computes one request at a time (EngineDialect.concurrent)."""
    return endpoint.dialect is not None and not endpoint.dialect.concurrent
