"""The prefix policy: the replica estimated to start answering soonest, holders of the prompt first.

Two parts: :class:`SoonestStart`, the pure choice among replicas given
which blocks of the prompt each holds, and :class:`PrefixPolicy`, which
keeps what that choice needs across requests (the prefix index, the
measured prefill speed, the share of idle replicas) and learns from each
answer. Why each rule is what it is, with the measurements behind it:
docs/routing.md.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from llmgw.gateway.routing.cachesize import AGREES, cached_by_time, computed, correct, verdict
from llmgw.gateway.routing.kvmatch import exact_matches
from llmgw.gateway.routing.leastloaded import least_loaded
from llmgw.gateway.routing.measured import LOW_LOAD_IDLE_SHARE, IdleShare, PrefillSpeed
from llmgw.gateway.routing.policy import HIT, MISS, OVERLOADED, UNROUTED, Pick, Policy
from llmgw.gateway.routing.prefixindex import (
    PrefixIndex,
    block_hashes,
    first_block_hash,
    stable_key,
)
from llmgw.gateway.routing.replica import CLAIM_UNANSWERED_S, Replica, mix

# The index's capacities follow the measured characters per token once the
# estimate has moved by this share since they were last set.
CHARS_RESYNC = 0.1
# A holder that computes one request at a time (Replica.serial) keeps a
# prompt while its queue exceeds the soonest start by less than this share
# of the prefill it holds (SoonestStart.copy_cost, at least): such an
# engine's prompt cache keeps a few whole states, so a copy of the prefix
# elsewhere evicts another prefix there, a whole prefill again later.
SERIAL_COPY_COST = 1.0
# A new prefix on such engines (or one held nowhere, as events tell) goes to
# the replica home to the fewest prefixes among those whose queued prefill
# exceeds the least queued by at most this share of the prompt's own
# prefill (SoonestStart.spread_new).
SPREAD_WAIT = 1.0


def rendezvous(replicas: Sequence[Replica], key: int) -> Replica:
    """Highest-random-weight choice: stable per key, and moves only 1/n keys when n changes."""
    best = replicas[0]
    best_score = mix(key ^ best.seed)
    for candidate in replicas[1:]:
        score = mix(key ^ candidate.seed)
        if score > best_score:
            best, best_score = candidate, score
    return best


@dataclass(frozen=True, slots=True, kw_only=True)
class SoonestStart:
    """The choice: the replica estimated to start answering soonest.

    A replica's estimated time to first token is the prefill queued on it
    (uncached prompt tokens of this gateway's requests not yet answered, less
    what the engine computed of them since it began, at the measured speed)
    plus the part of this prompt it does not hold, over the measured prefill
    speed: holding a prefix counts only as the tokens it saves.

    * A holder within ``slack_s`` of the soonest keeps the prompt (the
      longest holder first): a cache hit saves a whole prefill, and the
      slack is small so a hit never waits behind another prompt's cold one.
      ``copy_cost`` widens it by a share of the prefill each holder saves
      (SERIAL_COPY_COST at least for a replica computing one request at a
      time).
    * Otherwise (a new prefix, or every holder too busy) the prompt goes to
      the highest rendezvous score of its first block among the replicas
      holding none of it that are estimated within ``wait_ratio`` of the
      soonest: wide, so gateways that share no state still agree on where a
      prefix lives; below 1, so a prompt never waits a prefill of its size.
    * At low load (on average over the recent picks, at least
      ``low_load_share`` of the replicas idle: LOW_LOAD_IDLE_SHARE for one
      gateway, its N-th root for each of N), a new prefix whose replica by
      hash is busy goes to the first idle one in hash order instead.
    * A ``lone`` gateway (the routing table counts it alone) has nobody to
      agree with: a prompt no close holder takes goes to the soonest start
      outright, then the fewest requests in flight, then by hash.
    * ``spread`` bounds in-flight requests above the least busy replica: the
      estimate sees prefill only, and a hot prefix always cached would
      otherwise pile decode work on one engine without limit.
    """

    block_chars: int
    chars_per_token: float
    slack_s: float
    wait_ratio: float
    spread: float
    lone: bool = False
    low_load_share: float = LOW_LOAD_IDLE_SHARE
    copy_cost: float = 0.0

    def choose(
        self,
        replicas: Sequence[Replica],
        matched: dict[str, int],
        prompt_chars: int,
        key: int,
        tokens_per_s: float,
        idle_share: IdleShare,
        now: float,
    ) -> tuple[Replica, str, float]:
        """(replica, outcome, its uncached prompt tokens).

        ``matched`` maps a replica id to the blocks of this prompt it holds;
        ``tokens_per_s`` is the replicas' prefill speed. Estimates are kept
        in tokens of prefill, the tolerances turned into tokens at that speed.
        ``idle_share`` is this gateway's average for the model, updated here
        with this pick; ``now``: the router's clock, which replicas' queues
        are counted down to.
        """
        if self.lone and not matched:
            return self.place_new(replicas, key), MISS, prompt_chars / self.chars_per_token
        estimates, soonest, idle = self._estimates(
            replicas, matched, prompt_chars, now, tokens_per_s
        )
        # Every pick counts toward the average, whatever this one needs (a lone
        # gateway's new prefixes never read it: place_new skips it).
        low_load = idle_share.observe(idle, len(replicas)) >= self.low_load_share
        slack = self.slack_s * tokens_per_s
        best: Replica | None = None
        best_blocks = 0
        if matched:
            best, best_blocks = self._holder(replicas, estimates, matched, soonest + slack, key)
        if best is None:
            # No holder is close to the soonest, so the soonest holds nothing
            # and is among the others: holders would make a hit wait.
            if self.lone:
                best = self._soonest(replicas, estimates, matched, key)
            else:
                limit = soonest * (1.0 + self.wait_ratio) + slack
                idle_first = not matched and low_load
                best = self._by_hash(replicas, estimates, matched, limit, key, idle_first)
        longest = max(matched.values(), default=0)
        outcome = MISS if not longest else HIT if best_blocks == longest else OVERLOADED
        cached = best_blocks * self.block_chars
        return best, outcome, max(0, prompt_chars - cached) / self.chars_per_token

    def _estimates(
        self, replicas: Sequence[Replica], matched: dict[str, int], prompt_chars: int,
        now: float, tokens_per_s: float,
    ) -> tuple[list[float], float, int]:  # fmt: skip
        """(each replica's estimate in tokens, the soonest, how many are idle).

        A replica above the spread ceiling is estimated at infinity. Its
        queue counts down from when the engine began on it
        (Replica.prefill_since): counted whole until the first token, a
        holder a few milliseconds from done with a cold prefill looked a
        whole prefill busier than an idle replica, and its group's next
        prompts went to a non-holder (bench/routing.py at 16 req/s: 19
        of them). Not on a replica that computes one request at a time:
        after an answer's first token its engine decodes that answer
        before the next prompt's prefill begins.
        """
        ceiling = min(r.in_flight for r in replicas) + self.spread
        block_chars = self.block_chars
        per_token = self.chars_per_token
        estimates: list[float] = []
        soonest = math.inf
        idle = 0
        for replica in replicas:
            if not replica.in_flight:
                idle += 1
            if replica.in_flight > ceiling:
                estimates.append(math.inf)
                continue
            cached = matched.get(replica.replica_id, 0) * block_chars
            uncached = max(0, prompt_chars - cached) / per_token
            queued = replica.pending_prefill
            if queued and not replica.serial:
                queued = max(0.0, queued - (now - replica.prefill_since) * tokens_per_s)
            estimate = queued + uncached
            estimates.append(estimate)
            if estimate < soonest:
                soonest = estimate
        return estimates, soonest, idle

    def _holder(
        self, replicas: Sequence[Replica], estimates: list[float], matched: dict[str, int],
        limit: float, key: int,
    ) -> tuple[Replica | None, int]:  # fmt: skip
        """The longest holder within ``limit`` (ties by hash), and its blocks; None: none is."""
        block_tokens = self.block_chars / self.chars_per_token
        copy = self.copy_cost * block_tokens
        serial_copy = max(self.copy_cost, SERIAL_COPY_COST) * block_tokens
        best: Replica | None = None
        best_blocks = 0
        best_score = -1
        for replica, estimate in zip(replicas, estimates, strict=True):
            blocks = matched.get(replica.replica_id, 0)
            saved = blocks * (serial_copy if replica.serial else copy)
            if estimate > limit + saved or blocks < max(best_blocks, 1):
                continue
            score = mix(key ^ replica.seed)
            if blocks > best_blocks or score > best_score:
                best, best_blocks, best_score = replica, blocks, score
        return best, best_blocks

    @staticmethod
    def _soonest(
        replicas: Sequence[Replica], estimates: list[float], matched: dict[str, int], key: int
    ) -> Replica:
        """A lone gateway's choice among non-holders: soonest, fewest in flight, then hash."""
        best: Replica | None = None
        best_rank = (math.inf, 0, 0)
        for replica, estimate in zip(replicas, estimates, strict=True):
            if estimate == math.inf or replica.replica_id in matched:
                continue
            rank = (estimate, replica.in_flight, -mix(key ^ replica.seed))
            if best is None or rank < best_rank:
                best, best_rank = replica, rank
        assert best is not None
        return best

    @staticmethod
    def _by_hash(
        replicas: Sequence[Replica], estimates: list[float], matched: dict[str, int],
        limit: float, key: int, idle_first: bool,
    ) -> Replica:  # fmt: skip
        """The highest hash among non-holders within ``limit`` (``idle_first``: an idle one)."""
        best: Replica | None = None
        best_score = -1
        first_idle: Replica | None = None
        idle_score = -1
        for replica, estimate in zip(replicas, estimates, strict=True):
            if estimate > limit or replica.replica_id in matched:
                continue
            score = mix(key ^ replica.seed)
            if score > best_score:
                best, best_score = replica, score
            if idle_first and not replica.in_flight and score > idle_score:
                first_idle, idle_score = replica, score
        assert best is not None
        if best.in_flight and first_idle is not None:
            return first_idle
        return best

    def place_new(
        self, replicas: Sequence[Replica], key: int, home: str | None = None, tokens: float = 0.0
    ) -> Replica:
        """A lone gateway's replica for a prompt nobody holds.

        Every replica would prefill all of it, so the soonest start is the
        least prefill queued (counted whole: counted down as the general
        path does, it changed none of the replay's figures on seeds 0 and
        1, for a clock read per pick), then the fewest requests in flight,
        then the highest rendezvous score: what the general path chooses then,
        without its estimates and tuples (ties by score, never by the
        prompt's place in the list). Its own path because it is what a lone
        gateway does for most prompts at low load, where the gateway's cold
        code is most of what it adds.
        """
        ceiling = min(r.in_flight for r in replicas) + self.spread
        best: Replica | None = None
        best_pending = math.inf
        best_in_flight = 0
        best_score = -1  # computed only once a tie needs it
        for replica in replicas:
            in_flight = replica.in_flight
            if in_flight > ceiling:
                continue
            pending = replica.pending_prefill
            if best is not None and pending == best_pending and in_flight == best_in_flight:
                if best_score < 0:
                    best_score = mix(key ^ best.seed)
                score = mix(key ^ replica.seed)
                if score > best_score:
                    best, best_score = replica, score
            elif pending < best_pending or (pending == best_pending and in_flight < best_in_flight):
                best, best_pending, best_in_flight, best_score = replica, pending, in_flight, -1
        assert best is not None  # the least busy replica is never above the ceiling
        if home is not None and home != best.replica_id:
            # The prefix was recorded on ``home`` and forgotten since by the
            # index, whose capacity is an estimate: the engine may well hold
            # it still. Worth a wait of up to wait_ratio of its prefill there.
            for replica in replicas:
                if replica.replica_id == home:
                    if (
                        replica.in_flight <= ceiling
                        and replica.pending_prefill <= best_pending + self.wait_ratio * tokens
                    ):
                        return replica
                    break
        return best

    def spread_new(
        self, replicas: Sequence[Replica], key: int, index: PrefixIndex, home: str | None,
        tokens: float,
    ) -> Replica:  # fmt: skip
        """A lone gateway's replica for a new prompt, on engines that compute one at a time,
        and for a prompt held nowhere as replicas' events tell.

        Such an engine keeps a few whole prompt states, so how many distinct
        prefixes it serves decides its hit rate more than which one starts
        first: the replica home to the fewest prefixes takes a new one,
        among those whose queued prefill is within SPREAD_WAIT of this
        prompt's own of the least queued (then the fewest blocks held, then
        by hash). A prefix the index forgot goes back home within the same
        bound: the engine may hold it still, and a copy elsewhere would
        unbalance the split for good.
        """
        ceiling = min(r.in_flight for r in replicas) + self.spread
        least = min(r.pending_prefill for r in replicas if r.in_flight <= ceiling)
        bound = least + SPREAD_WAIT * tokens
        best: Replica | None = None
        best_rank: tuple[int, int, int] = (0, 0, 0)
        for replica in replicas:
            if replica.in_flight > ceiling or replica.pending_prefill > bound:
                continue
            if replica.replica_id == home:
                return replica
            rank = (index.homed(replica.replica_id), index.blocks(replica.replica_id),
                    -mix(key ^ replica.seed))  # fmt: skip
            if best is None or rank < best_rank:
                best, best_rank = replica, rank
        assert best is not None  # the least queued is within the bound
        return best


class PrefixPolicy(Policy):
    """Routing by prompt prefix for one model and config version.

    ``replicas`` are all of the model's (the index tracks each of them, also
    while a route's router offers only some); ``index`` and ``speed`` are the
    model's, carried across config versions by the snapshot; the idle share
    starts afresh with each version ("all idle" detours only prompts that
    find an idle replica, and under load the average is down again within a
    few dozen picks).
    """

    __slots__ = ("_block_chars", "_clock", "_idle_share", "_replicas", "_synced_chars", "_units",
                 "index", "soonest", "speed")  # fmt: skip

    reads_prompt = True

    def __init__(
        self, replicas: list[Replica], index: PrefixIndex, speed: PrefillSpeed,
        soonest: SoonestStart, tokens_per_unit: float,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:  # fmt: skip
        self._replicas = replicas
        self._clock = clock
        self.index = index
        self.speed = speed
        self.soonest = soonest
        self._block_chars = soonest.block_chars
        self._units = tokens_per_unit
        self._idle_share = IdleShare()
        self._synced_chars = 0.0
        self._sync_index()

    def _sync_index(self) -> None:
        """The index's capacity per replica: its KV tokens in characters, as measured."""
        chars = self._synced_chars = self.speed.chars_per_token
        block_chars = self._block_chars
        self.index.sync(
            {
                r.replica_id: int(r.kv_capacity_tokens * r.capacity_scale * chars / block_chars)
                for r in self._replicas
            }
        )

    def choose(
        self, replicas: Sequence[Replica], prompt: str | None, turn: int,
        tokens: Sequence[int] | None = None,
    ) -> Pick:  # fmt: skip
        if not prompt:
            return Pick(least_loaded(replicas, self._units, turn), UNROUTED, [], 0.0)
        block_chars = self._block_chars
        soonest = self.soonest
        index = self.index
        if tokens is not None:
            # Some replicas publish what they hold: their holdings read from
            # their events (exact_matches), the rest as estimated.
            hashes = block_hashes(prompt, block_chars)
            now = self._clock()  # one reading for the claims and the estimates
            matched = exact_matches(
                replicas, index.matches(hashes, {r.replica_id: r for r in replicas}), tokens,
                self.speed.chars_per_token / block_chars, hashes[0], now,
            )
            if soonest.lone and not matched:
                # Held nowhere now, as exactly known: home first (where it was
                # last recorded) within a whole prefill's wait, as the estimate's
                # holder rule keeps a prefix it still counts there, else the
                # replica home to the fewest (spread_new). By load, each return
                # of an evicted prefix made a copy that evicted another's (hit
                # rate 0.41 against the estimate's 0.60: docs/routing.md).
                estimate = len(prompt) / soonest.chars_per_token
                key = stable_key(prompt, block_chars)
                replica = soonest.spread_new(replicas, key, index, index.home(hashes[0]), estimate)
                return Pick(replica, MISS, hashes, estimate, None, len(prompt))
            return self._general(replicas, prompt, hashes, matched, now)
        if soonest.lone and not index.holds(first := first_block_hash(prompt, block_chars)):
            # Nobody holds even its first block, so a lone gateway places it
            # by load alone (what choose does for it, without the index's
            # walk), and the prompt's hashes wait until it is sent (record):
            # at low load this is most prompts, the gateway's code runs cold
            # there, and the client waits every microsecond before the send.
            chars = len(prompt)
            estimate = chars / soonest.chars_per_token
            home = index.home(first)
            key = stable_key(prompt, block_chars)
            if replicas[0].serial:
                replica = soonest.spread_new(replicas, key, index, home, estimate)
            else:
                replica = soonest.place_new(replicas, key, home, estimate)
            return Pick(replica, MISS, [], estimate, prompt, chars)
        hashes = block_hashes(prompt, block_chars)
        if len(replicas) == 1:
            # One replica left of several (the others excluded or cooling
            # down) is no choice, but its index is still kept: it is what
            # sends known prefixes back here once the others return.
            # SoonestStart.choose of one replica picks it, a hit if it holds
            # any of the prompt (its slack is never negative), without the
            # estimates (tests/gateway/test_routing_unit.py compares the two).
            only = replicas[0]
            blocks = index.depth(hashes, only.replica_id)
            uncached = max(0, len(prompt) - blocks * block_chars) / soonest.chars_per_token
            return Pick(only, HIT if blocks else MISS, hashes, uncached, None, len(prompt))
        allowed = {r.replica_id: r for r in replicas}
        matched = index.matches(hashes, allowed)
        return self._general(replicas, prompt, hashes, matched, self._clock())

    def _general(self, replicas: Sequence[Replica], prompt: str, hashes: list[int],
                 matched: dict[str, int], now: float) -> Pick:  # fmt: skip
        """SoonestStart.choose over ``matched`` (each replica's blocks of the prompt) at ``now``."""
        replica, outcome, uncached = self.soonest.choose(
            replicas, matched, len(prompt), stable_key(prompt, self._block_chars),
            self.speed.tokens_per_s, self._idle_share, now,
        )  # fmt: skip
        return Pick(replica, outcome, hashes, uncached, None, len(prompt))

    def metered(
        self, pick: Pick, prompt_tokens: int, cached_tokens: int, computed_s: float | None = None
    ) -> None:
        """What the engine's usage says of a prompt this policy placed.

        ``prompt_tokens``: the engine's count of it, which is what the
        model's characters per token are learnt from (the index's
        capacities are tokens, its blocks characters). ``cached_tokens``:
        the part the engine found cached (0 where it does not say), else
        what ``computed_s`` tells of it (cachesize.py: only a lone gateway
        has the engine to itself, and a time only grows it): corrects the
        index's capacity for the replica. A timed prompt is also a sample
        of the prefill speed where that agrees with the index. Called once
        per answer with usage, off the client's path.
        """
        speed = self.speed
        speed.counted(pick.prompt_chars, prompt_tokens)
        resync = abs(speed.chars_per_token / self._synced_chars - 1.0) > CHARS_RESYNC
        replica = pick.replica
        reported = cached_tokens > 0
        timed = False
        if reported:
            replica.reports_cached = True
        elif computed_s is not None and self.soonest.lone:
            # At the speed learnt before it: sampled first, a prompt loaded
            # from the engine's cache raised the speed until its own time
            # read as a whole prefill (while the first samples average).
            cached_tokens = cached_by_time(prompt_tokens, computed_s, speed.tokens_per_s)
            timed = True
        # A 0 from an engine that never says what it found cached means
        # nothing, nor does one from an engine told by its time where this
        # answer was not timed (given whole, or with other gateways).
        found = AGREES
        if replica.reports_cached or timed:
            found = verdict(pick, prompt_tokens, cached_tokens, speed.chars_per_token)
            resync |= correct(replica, found, shrink=not timed)
        if computed_s is not None:
            speed.observe(computed(pick, prompt_tokens, cached_tokens, found, reported), computed_s)
        if resync:
            self._sync_index()

    def measured(self, tokens: float, seconds: float) -> None:
        self.speed.observe(tokens, seconds)

    def record(self, pick: Pick) -> None:
        """Recorded as the request is sent (routing.prefill), not when its answer starts.

        A second prompt of the group sent meanwhile then goes to the replica
        computing the prefix, whose queue the estimate counts down as it is
        computed (SoonestStart): it starts sooner there than computing the
        whole prefix again elsewhere, and leaves no second copy to evict
        other prefixes (docs/routing.md).
        """
        hashes = pick.hashes
        if not hashes and pick.prompt is not None:
            hashes = pick.hashes = block_hashes(pick.prompt, self._block_chars)
        if hashes:
            replica = pick.replica
            self.index.record(replica.replica_id, hashes)
            if replica.exact is not None:  # its events show the prompt once computed
                replica.claim(hashes[0], CLAIM_UNANSWERED_S, self._clock())
