"""Choosing a replica for one request: the policies, and the per-model router.

The policies are plain functions of the candidates and their loads, so they
can be tested (and compared) without sockets. :class:`ModelRouter` is built
once per config version and model; the :class:`Replica` objects it points to
outlive config versions, so in-flight counts and cool-downs survive a config
update that merely adds or removes another replica.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

from llmgw import wire
from llmgw.gateway.dialect import mending_for
from llmgw.gateway.prefix import PrefixIndex, block_hashes, stable_key

_M64 = (1 << 64) - 1

# Prefix-routing outcomes, as exported in metrics.
HIT = "hit"  # longest cached prefix chosen
MISS = "miss"  # no replica holds any of it: rendezvous on the first block
OVERLOADED = "overloaded"  # a replica holds it but is too loaded: least loaded instead
UNROUTED = "none"  # policy did not look at prefixes (round-robin, least-loaded, no prompt)


def _mix(value: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread 64-bit mix, identical everywhere."""
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _M64
    return value ^ (value >> 31)


class Replica:
    """One endpoint as this gateway sees it: address, load, failure history."""

    __slots__ = (
        "cooled_until",
        "engine_key",
        "failures",
        "in_flight",
        "kv_capacity_tokens",
        "last_request_at",
        "mending",
        "pending_prefill",
        "replica_id",
        "requests",
        "seed",
        "url",
    )

    def __init__(self, endpoint: wire.Endpoint) -> None:
        self.replica_id = endpoint.replica_id
        self.url = endpoint.url.rstrip("/")
        self.kv_capacity_tokens = endpoint.kv_capacity_tokens
        self.mending = mending_for(endpoint.dialect)
        self.engine_key = endpoint.engine_key  # sent upstream, never to clients
        # Rendezvous seed from the id, so every gateway derives the same one.
        digest = hashlib.blake2b(self.replica_id.encode("utf-8"), digest_size=8).digest()
        self.seed = int.from_bytes(digest, "little")
        self.in_flight = 0
        # Uncached prompt tokens of in-flight requests not yet answered: the
        # prefill work queued on this replica, which request counts miss.
        self.pending_prefill = 0.0
        self.last_request_at: float | None = None
        self.requests = 0  # since the last load report
        self.failures = 0  # consecutive connection failures
        self.cooled_until = 0.0

    def update(self, endpoint: wire.Endpoint) -> None:
        self.url = endpoint.url.rstrip("/")
        self.kv_capacity_tokens = endpoint.kv_capacity_tokens
        self.mending = mending_for(endpoint.dialect)
        self.engine_key = endpoint.engine_key

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


# ---------------------------------------------------------------------------
# Pure policies
# ---------------------------------------------------------------------------


def least_loaded(replicas: Sequence[Replica], tokens_per_unit: float, start: int) -> Replica:
    """The least-loaded replica; ties go round-robin from ``start`` so idle replicas share."""
    count = len(replicas)
    best = replicas[start % count]
    best_load = best.load(tokens_per_unit)
    for offset in range(1, count):
        candidate = replicas[(start + offset) % count]
        load = candidate.load(tokens_per_unit)
        if load < best_load:
            best, best_load = candidate, load
    return best


def rendezvous(replicas: Sequence[Replica], key: int) -> Replica:
    """Highest-random-weight choice: stable per key, and moves only 1/n keys when n changes."""
    best = replicas[0]
    best_score = _mix(key ^ best.seed)
    for candidate in replicas[1:]:
        score = _mix(key ^ candidate.seed)
        if score > best_score:
            best, best_score = candidate, score
    return best


def prefix_choice(
    replicas: Sequence[Replica],
    holders: Sequence[Replica],
    key: int,
    threshold: float,
    tokens_per_unit: float,
    miss_slack: float,
) -> tuple[Replica, str]:
    """The prefix policy given who holds the longest prefix (``holders``, maybe empty).

    Affinity wins unless it would pile work on a replica: a holder more than
    ``threshold`` above the least-loaded replica loses to the least loaded
    (prefix-only routing collapses under skewed prefixes, see research/routing.md).
    A new prefix goes by rendezvous, so gateways that share no state still
    agree on where it lands -- but only among the replicas within
    ``miss_slack`` of the least loaded: a miss has nothing to gain from any
    particular replica, and with the wide affinity threshold a hash alone
    stacks cold prompts on busy replicas while others idle (in a cold start
    that made prefix routing slower than round-robin).
    """
    min_load = min(r.load(tokens_per_unit) for r in replicas)
    if holders:
        best = min(holders, key=lambda r: r.load(tokens_per_unit))
        if best.load(tokens_per_unit) - min_load <= threshold:
            return best, HIT
        return least_loaded(replicas, tokens_per_unit, key), OVERLOADED
    eligible = [r for r in replicas if r.load(tokens_per_unit) - min_load <= miss_slack]
    return rendezvous(eligible, key), MISS


# ---------------------------------------------------------------------------
# Per-model router
# ---------------------------------------------------------------------------


@dataclass(slots=True)
class Pick:
    replica: Replica
    outcome: str
    hashes: list[int]
    uncached_tokens: float


class ModelRouter:
    """Routing state of one model for one config version."""

    __slots__ = (
        "_block_chars",
        "_chars_per_token",
        "_counter",
        "_index",
        "_miss_slack",
        "_threshold",
        "_units",
        "policy",
        "replicas",
        "route",
    )

    def __init__(
        self,
        route: wire.ModelRoute,
        replicas: list[Replica],
        index: PrefixIndex,
        *,
        block_chars: int,
        chars_per_token: float,
        threshold: float,
        tokens_per_unit: float,
        miss_slack: float,
    ) -> None:
        self.route = route
        self.policy = route.routing
        self.replicas = replicas
        self._index = index
        self._block_chars = block_chars
        self._chars_per_token = chars_per_token
        self._threshold = threshold
        self._miss_slack = miss_slack
        self._units = tokens_per_unit
        self._counter = 0
        index.sync(
            {
                r.replica_id: int(r.kv_capacity_tokens * chars_per_token / block_chars)
                for r in replicas
            }
        )

    def candidates(
        self, exclude: Sequence[Replica] = (), *, fallback: bool = True
    ) -> list[Replica]:
        """Replicas that may take a request now: not excluded, not cooling down.

        If every replica is cooling down, all of them are offered again when
        ``fallback`` holds: a request that might fail is better than one
        refused for certain. An on-demand model passes False instead: its
        request waits for a replica (the cooled one's return or a
        replacement) rather than being sent where connections just failed.
        """
        now = 0.0
        out: list[Replica] = []
        for replica in self.replicas:
            if replica in exclude:
                continue
            if replica.cooled_until:
                now = now or time.monotonic()
                if replica.cooled_until > now:
                    continue
            out.append(replica)
        if not out and fallback:
            out = [r for r in self.replicas if r not in exclude]
        return out

    def cooling_ends(self) -> float | None:
        """When (time.monotonic()) the first replica now cooling down may be tried again."""
        now = time.monotonic()
        ends = [r.cooled_until for r in self.replicas if r.cooled_until > now]
        return min(ends) if ends else None

    def pick(
        self, prompt: str | None, exclude: Sequence[Replica] = (), *, fallback: bool = True
    ) -> Pick | None:
        replicas = self.candidates(exclude, fallback=fallback)
        if not replicas:
            return None
        self._counter += 1
        if len(replicas) == 1 and self.policy != "prefix":
            return Pick(replicas[0], UNROUTED, [], 0.0)
        if self.policy == "round-robin":
            return Pick(replicas[self._counter % len(replicas)], UNROUTED, [], 0.0)
        if self.policy == "least-loaded" or not prompt:
            return Pick(least_loaded(replicas, self._units, self._counter), UNROUTED, [], 0.0)
        hashes = block_hashes(prompt, self._block_chars)
        if len(replicas) == 1:
            # No choice to make, but the index is still kept: it is what sends
            # known prefixes back here once a second replica appears.
            replica = replicas[0]
            matched, _ = self._index.longest(hashes, {replica.replica_id: replica})
            outcome = HIT if matched else MISS
        else:
            allowed = {r.replica_id: r for r in replicas}
            matched, holder_ids = self._index.longest(hashes, allowed)
            holders = [allowed[r] for r in holder_ids]
            key = stable_key(prompt, self._block_chars)
            replica, outcome = prefix_choice(
                replicas, holders, key, self._threshold, self._units, self._miss_slack
            )
            if replica not in holders:
                matched = 0
        cached_chars = matched * self._block_chars
        uncached = max(0.0, (len(prompt) - cached_chars) / self._chars_per_token)
        self._index.record(replica.replica_id, hashes)
        return Pick(replica, outcome, hashes, uncached)
