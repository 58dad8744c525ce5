"""Choosing a replica for one request: the policies, and the per-model router.

The policies are plain functions of the candidates and their loads, so they
can be tested (and compared) without sockets. :class:`ModelRouter` is built
once per config version and model; the :class:`Replica` objects it points to
outlive config versions, so in-flight counts and cool-downs survive a config
update that merely adds or removes another replica.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from llmgw import wire
from llmgw.gateway.dialect import mending_for
from llmgw.gateway.prefix import PrefixIndex, block_hashes, first_block_hash, stable_key

_M64 = (1 << 64) - 1

# Prefix-routing outcomes, as exported in metrics.
HIT = "hit"  # a replica holding the longest cached prefix chosen
MISS = "miss"  # no replica holds any of it: rendezvous on the first block
OVERLOADED = "overloaded"  # a replica holds it, but another was estimated to answer sooner
UNROUTED = "none"  # prefixes not looked at (round-robin, least-loaded, no prompt, one replica)

# Prefill-speed measurement. A sample below this many tokens is mostly network
# and a decode step, not prefill, and would read as a slow engine.
MIN_SAMPLE_TOKENS = 256.0
# The first samples are averaged as they come (geometric mean), so a wrong
# prior is gone after a handful of requests; after that a sample moves the
# estimate by SAMPLE_WEIGHT of the way in log terms, and counts as at most a
# factor of SAMPLE_CLAMP off: a sample is wrong whenever the gateway's guess
# of the cached part was (another gateway warmed the engine, the engine
# evicted early), and such outliers must not swing every later choice.
SETTLING_SAMPLES = 4
SAMPLE_WEIGHT = 0.1
SAMPLE_CLAMP = 4.0

# Characters per token, learnt from the engines' prompt token counts (the
# gateway cuts prompts by characters, the engines count tokens): counted
# over about the last CHARS_WINDOW_TOKENS prompt tokens, and the index's
# capacities follow once the estimate has moved by CHARS_RESYNC.
CHARS_WINDOW_TOKENS = 262_144.0
CHARS_RESYNC = 0.1
# What an engine's report of the prompt tokens it found cached tells the
# index about its size (the KV capacity it was given is only what the engine
# was started with: a prompt cache beside the context holds more, a pool
# shared with long answers less). A prompt routed as new that the engine had
# at least half cached: the index forgot too early, its capacity for that
# replica grows by CAPACITY_STEP; a prompt routed as held that the engine
# found nothing of (on an engine known to report): it shrinks. Kept within
# CAPACITY_RANGE of the configured size either way.
CAPACITY_STEP = 1.125
CAPACITY_RANGE = 4.0

# Low load, for the prefix policy's idle-first rule: on average over about
# the last 1/IDLE_SHARE_WEIGHT picks, at least this share of the replicas
# had nothing in flight. Averaged because the share at one pick swings with
# every Poisson burst: read at the pick, "half the replicas idle" switched
# the rule off in a burst at 4 req/s on 8 replicas (cold prompts then
# prefilled next to another's decode, 11-25 ms slower, where round-robin
# co-locates none) and on in a lull under load (second copies of prefixes
# when gateways' views differ, which is what costs hits). bench/routing.py's
# lowest rate keeps ~0.64 of the replicas idle on average; its next one
# keeps ~0.3, and two gateways sharing it each see ~0.6 from their own
# requests: a lower threshold detours their prefixes there too and widens
# their hit-rate gap (the replay's 12 seeds: 0.5 gives a mean gap of 6.0
# points, 0.6 gives 4.0, the per-pick rule 3.2).
IDLE_SHARE_WEIGHT = 1.0 / 32.0
LOW_LOAD_IDLE_SHARE = 0.6


def _mix(value: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread 64-bit mix, identical everywhere."""
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _M64
    return value ^ (value >> 31)


class Replica:
    """One endpoint as this gateway sees it: address, load, failure history."""

    __slots__ = (
        "capacity_scale",
        "cooled_until",
        "engine_key",
        "failures",
        "in_flight",
        "kv_capacity_tokens",
        "last_request_at",
        "mending",
        "pending_prefill",
        "replica_id",
        "reports_cached",
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
        # The prefix index's capacity for it over the configured one, as the
        # engine's reports of cached prompt tokens corrected it; and whether
        # it has reported any (an engine that never does reads as 0).
        self.capacity_scale = 1.0
        self.reports_cached = False

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


class PrefillSpeed:
    """A model's measured prefill speed (prompt tokens per second), from its replicas,
    and its measured characters per token.

    One estimate per model, not per replica: replicas of a model mostly run
    on alike hardware, each replica would see an eighth of the samples, and
    with per-replica estimates their noise -- not their load -- decided
    between idle replicas, so two gateways stopped agreeing on where new
    prefixes go. What it is for is turning queued prefill into seconds,
    which is what the policy's tolerances are in.
    """

    __slots__ = ("chars_per_token", "prompt_chars", "prompt_tokens", "samples", "tokens_per_s")

    def __init__(self, prior: float, chars_per_token: float = 4.0) -> None:
        self.tokens_per_s = prior
        self.samples = 0
        # The prior until an engine has counted a prompt's tokens.
        self.chars_per_token = chars_per_token
        self.prompt_chars = 0.0
        self.prompt_tokens = 0.0

    def counted(self, chars: int, tokens: int) -> None:
        """Fold in one prompt: ``chars`` characters that the engine counted as ``tokens``."""
        if chars <= 0 or tokens <= 0:
            return
        self.prompt_chars += chars
        self.prompt_tokens += tokens
        self.chars_per_token = self.prompt_chars / self.prompt_tokens
        if self.prompt_tokens > CHARS_WINDOW_TOKENS:
            self.prompt_chars *= 0.5
            self.prompt_tokens *= 0.5

    def observe(self, tokens: float, seconds: float) -> None:
        """Fold in one prefill: ``tokens`` uncached prompt tokens answered in ``seconds``.

        Only a prefill that queued behind none of this gateway's others on
        its replica is a sample (the caller checks), so the time is its own.
        """
        if tokens < MIN_SAMPLE_TOKENS or seconds <= 0.0:
            return
        ratio = tokens / seconds / self.tokens_per_s
        self.samples += 1
        if self.samples <= SETTLING_SAMPLES:
            # The first replaces the prior; the next ones make a geometric mean.
            self.tokens_per_s *= ratio ** (1.0 / self.samples)
        else:
            ratio = min(max(ratio, 1.0 / SAMPLE_CLAMP), SAMPLE_CLAMP)
            self.tokens_per_s *= ratio**SAMPLE_WEIGHT


class IdleShare:
    """The share of a model's replicas with nothing in flight, averaged over this gateway's picks.

    Starts at 1 (a gateway that has sent nothing sees every replica idle);
    each pick moves it IDLE_SHARE_WEIGHT of the way to the share at that pick.
    """

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 1.0

    def observe(self, idle: int, count: int) -> float:
        """Fold in one pick's share (``idle`` of ``count`` replicas); the average after it."""
        self.value += IDLE_SHARE_WEIGHT * (idle / count - self.value)
        return self.value


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


@dataclass(frozen=True, slots=True, kw_only=True)
class SoonestStart:
    """The prefix policy: the replica estimated to start answering soonest.

    A replica's estimated time to first token is the prefill queued on it
    (uncached prompt tokens of this gateway's requests not yet answered) plus
    the part of this prompt it does not hold, over its measured prefill
    speed. Holding a prefix only counts as the tokens it saves, so a holder
    busy with another prompt's prefill loses to an idle replica when the
    saved tokens are worth less than the wait -- "held prefix unless
    overloaded" sent the second prompt of a new group to wait behind the
    first one's prefill while other engines idled, slower than round-robin at
    low load.

    Two tolerances, because the two choices cost different things:

    * A holder within ``slack_s`` of the soonest keeps the prompt (the
      longest holder first): a few tens of milliseconds buy a cache hit
      that saves the engine a whole prefill. Kept small, so a hit never
      waits behind another prompt's cold prefill.
    * Otherwise (a new prefix, or every holder too busy) the prompt goes to
      the highest rendezvous score of its first block among the replicas
      holding none of it that are estimated within ``wait_ratio`` of the
      soonest (which is one of them): gateways that share no
      state see different loads, and only a tolerance this wide keeps them
      agreeing on where a prefix lives -- when they disagree, both copies
      share the engines' caches while each gateway's index counts on all of
      it, and the hit rate collapses under load. Still below 1, so a prompt
      never waits behind a whole prefill of its own size.
    * At low load (``idle_share``: on average over the recent picks, at
      least LOW_LOAD_IDLE_SHARE of the replicas had nothing in flight), a
      new prefix whose replica by hash is busy (decoding, say) goes to the
      first idle one in hash order instead: decode steps slow a prefill
      started next to them, round-robin rarely puts two requests together
      at low load, and hash placement alone did often enough to lose to it.
      Only then, and only for prefixes nobody holds: where gateways' views
      of who is idle differ most, each detour is a second copy of a prefix,
      and under load those copies cost more hits than the detours save time.

    * A ``lone`` gateway (the routing table says it is the only one) has
      nobody to agree with: a prompt no close holder takes goes to the
      soonest start outright, the replica with fewest requests in flight
      among equals (an idle one rather than one decoding another answer),
      then by hash. At 8 req/s on bench/routing.py's workload every
      policy's p90 was a cold prompt prefilled beside another's decode;
      placed by hash, prefix routing had as many of those as round-robin
      and lost to least-loaded by 1-3 ms, placed by load it has half as
      many (the replay's 12 seeds: at or below both at every rate on all
      of them).

    ``spread`` bounds in-flight requests above the least busy replica: the
    estimate sees prefill only, and a hot prefix that is always cached would
    otherwise pile decode work on one engine without limit.
    """

    block_chars: int
    chars_per_token: float
    slack_s: float
    wait_ratio: float
    spread: float
    lone: bool = False
    copy_cost: float = 0.0

    def choose(
        self,
        replicas: Sequence[Replica],
        matched: dict[str, int],
        prompt_chars: int,
        key: int,
        tokens_per_s: float,
        idle_share: IdleShare,
    ) -> tuple[Replica, str, float]:
        """(replica, outcome, its uncached prompt tokens).

        ``matched`` maps a replica id to the blocks of this prompt it holds;
        ``tokens_per_s`` is the replicas' prefill speed. Estimates are kept
        in tokens of prefill, the tolerances turned into tokens at that speed.
        ``idle_share`` is this gateway's average for the model, updated here
        with this pick.
        """
        if self.lone and not matched:
            return self.place_new(replicas, key), MISS, prompt_chars / self.chars_per_token
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
            estimate = replica.pending_prefill + uncached
            estimates.append(estimate)
            if estimate < soonest:
                soonest = estimate
        # Every pick counts toward the average, whatever this one needs (a lone
        # gateway's new prefixes never read it: place_new skips it).
        low_load = idle_share.observe(idle, len(replicas)) >= LOW_LOAD_IDLE_SHARE
        slack = self.slack_s * tokens_per_s
        best: Replica | None = None
        best_blocks = 0
        best_score = -1
        if matched:
            limit = soonest + slack
            copy = self.copy_cost * block_chars / per_token
            for replica, estimate in zip(replicas, estimates, strict=True):
                blocks = matched.get(replica.replica_id, 0)
                if estimate > limit + blocks * copy or blocks < max(best_blocks, 1):
                    continue
                score = _mix(key ^ replica.seed)
                if blocks > best_blocks or score > best_score:
                    best, best_blocks, best_score = replica, blocks, score
        if best is None and self.lone:
            # No holder is close to the soonest, so the soonest holds nothing.
            best_rank = (math.inf, 0, 0)
            for replica, estimate in zip(replicas, estimates, strict=True):
                if estimate == math.inf or replica.replica_id in matched:
                    continue
                rank = (estimate, replica.in_flight, -_mix(key ^ replica.seed))
                if best is None or rank < best_rank:
                    best, best_rank = replica, rank
            assert best is not None
        elif best is None:
            # No holder is close to the soonest, so the soonest holds nothing
            # and is among these: holders here would make a hit wait.
            limit = soonest * (1.0 + self.wait_ratio) + slack
            idle_first = not matched and low_load
            first_idle: Replica | None = None
            idle_score = -1
            for replica, estimate in zip(replicas, estimates, strict=True):
                if estimate > limit or replica.replica_id in matched:
                    continue
                score = _mix(key ^ replica.seed)
                if score > best_score:
                    best, best_score = replica, score
                if idle_first and not replica.in_flight and score > idle_score:
                    first_idle, idle_score = replica, score
            assert best is not None
            if best.in_flight and first_idle is not None:
                best = first_idle
        longest = max(matched.values(), default=0)
        outcome = MISS if not longest else HIT if best_blocks == longest else OVERLOADED
        cached = best_blocks * block_chars
        return best, outcome, max(0, prompt_chars - cached) / per_token

    def place_new(
        self, replicas: Sequence[Replica], key: int, home: str | None = None, tokens: float = 0.0
    ) -> Replica:
        """A lone gateway's replica for a prompt nobody holds.

        Every replica would prefill all of it, so the soonest start is the
        least prefill queued, then the fewest requests in flight, then the
        highest rendezvous score: what the general path chooses then,
        without its estimates and tuples. Ties must go by the score: taking
        the first idle replica from the prompt's place in the list instead
        piles new prefixes on the replicas that follow busy ones (the
        replay, seed 1, 8 req/s: p90 0.370 s against 0.358). Its own path
        because it is what a lone gateway does for most prompts at low load,
        where the gateway's own time is most of what it adds: code that has
        not run for a while runs ~10x slower than in a loop
        (bench/routing.py at 4 req/s), and with 50 ms between picks the
        general path took ~75 us against ~45 for this one.
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
                    best_score = _mix(key ^ best.seed)
                score = _mix(key ^ replica.seed)
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


# ---------------------------------------------------------------------------
# Per-model router
# ---------------------------------------------------------------------------


def _rescale(replica: Replica, factor: float) -> bool:
    """Scale the replica's index capacity by ``factor`` within CAPACITY_RANGE; whether it moved."""
    scale = min(max(replica.capacity_scale * factor, 1.0 / CAPACITY_RANGE), CAPACITY_RANGE)
    moved = scale != replica.capacity_scale
    replica.capacity_scale = scale
    return moved


@dataclass(slots=True)
class Pick:
    replica: Replica
    outcome: str
    hashes: list[int]
    uncached_tokens: float
    # A prompt routed by prefix whose hashes were left for record to compute
    # (None: routed without its prompt, or its hashes are already here).
    prompt: str | None = None
    # Its length, for what the engine's usage says of it (0: not routed by prefix).
    prompt_chars: int = 0

    @property
    def by_prefix(self) -> bool:
        """Whether the pick read the prompt: then its answer is recorded and timed."""
        return bool(self.hashes) or self.prompt is not None


class ModelRouter:
    """Routing state of one model for one config version."""

    __slots__ = (
        "_block_chars",
        "_counter",
        "_idle_share",
        "_index",
        "_policy",
        "_speed",
        "_synced_chars",
        "_units",
        "policy",
        "replicas",
        "route",
        "wants_prompt",
    )

    def __init__(
        self,
        route: wire.ModelRoute,
        replicas: list[Replica],
        index: PrefixIndex,
        speed: PrefillSpeed,
        *,
        block_chars: int,
        chars_per_token: float,
        tokens_per_unit: float,
        ttft_slack_s: float,
        wait_ratio: float,
        spread: float,
        lone: bool = False,
        copy_cost: float = 0.0,
    ) -> None:
        self.route = route
        self.policy = route.routing
        self.replicas = replicas
        # Whether pick looks at the prompt, so callers render it only then. A
        # lone replica is no choice, and prefix work for it (render, hash,
        # index: ~200 opcodes a request, issue 16) bought nothing until a
        # second replica appeared. That one starts with an index cold for the
        # prefixes served meanwhile, which costs little: the first replica
        # still holds them and new prompts are placed by hash, as are
        # prefixes the index forgot. The prefill speed is not measured
        # meanwhile either (nothing charges uncached tokens): the estimate
        # settles within SETTLING_SAMPLES once there is a choice. Zero
        # replicas (an on-demand model asleep) still render: the router
        # built after the wake-up decides.
        self.wants_prompt = self.policy == "prefix" and len(replicas) != 1
        self._index = index
        self._block_chars = block_chars
        self._units = tokens_per_unit
        self._policy = SoonestStart(
            block_chars=block_chars,
            chars_per_token=chars_per_token,
            slack_s=ttft_slack_s,
            wait_ratio=wait_ratio,
            spread=spread,
            lone=lone,
            copy_cost=copy_cost,
        )
        self._counter = 0
        # Per config version, unlike the speed: a new router starts at "all
        # idle", which detours only prompts that find an idle replica, and
        # under load the average is down again within a few dozen picks.
        self._idle_share = IdleShare()
        self._speed = speed
        self._synced_chars = 0.0
        self._sync_index()

    def _sync_index(self) -> None:
        """The index's capacity per replica: its KV tokens in characters, as measured."""
        chars = self._synced_chars = self._speed.chars_per_token
        block_chars = self._block_chars
        self._index.sync(
            {
                r.replica_id: int(r.kv_capacity_tokens * r.capacity_scale * chars / block_chars)
                for r in self.replicas
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
        if not exclude and len(self.replicas) == 1:
            # The usual first try at a one-replica model, without candidates'
            # list: the replica unless it cools down and there is no fallback.
            only = self.replicas[0]
            if only.cooled_until and not fallback and only.cooled_until > time.monotonic():
                return None
            self._counter += 1
            return Pick(only, UNROUTED, [], 0.0)
        replicas = self.candidates(exclude, fallback=fallback)
        if not replicas:
            return None
        self._counter += 1
        if len(replicas) == 1 and not self.wants_prompt:
            return Pick(replicas[0], UNROUTED, [], 0.0)
        if self.policy == "round-robin":
            return Pick(replicas[self._counter % len(replicas)], UNROUTED, [], 0.0)
        if self.policy == "least-loaded" or not prompt:
            return Pick(least_loaded(replicas, self._units, self._counter), UNROUTED, [], 0.0)
        block_chars = self._block_chars
        policy = self._policy
        if policy.lone and not self._index.holds(first := first_block_hash(prompt, block_chars)):
            # Nobody holds even its first block, so a lone gateway places it
            # by load alone (what choose does for it, without the index's
            # walk), and the prompt's hashes wait until its answer has
            # started (record): at low load this is most prompts, the
            # gateway's code runs cold there, and every microsecond before
            # the send is one the client waits.
            chars = len(prompt)
            tokens = chars / policy.chars_per_token
            home = self._index.home(first)
            replica = policy.place_new(replicas, stable_key(prompt, block_chars), home, tokens)
            return Pick(replica, MISS, [], tokens, prompt, chars)
        hashes = block_hashes(prompt, block_chars)
        if len(replicas) == 1:
            # One replica left of several (the others excluded or cooling
            # down) is no choice, but its index is still kept: it is what
            # sends known prefixes back here once the others return.
            # SoonestStart.choose of one replica picks it, a hit if it holds
            # any of the prompt (its slack is never negative), without the
            # estimates (tests/gateway/test_routing_unit.py compares the two).
            only = replicas[0]
            blocks = self._index.depth(hashes, only.replica_id)
            uncached = max(0, len(prompt) - blocks * block_chars) / self._policy.chars_per_token
            return Pick(only, HIT if blocks else MISS, hashes, uncached, None, len(prompt))
        allowed = {r.replica_id: r for r in replicas}
        matched = self._index.matches(hashes, allowed)
        replica, outcome, uncached = self._policy.choose(
            replicas, matched, len(prompt), stable_key(prompt, block_chars),
            self._speed.tokens_per_s, self._idle_share,
        )  # fmt: skip
        return Pick(replica, outcome, hashes, uncached, None, len(prompt))

    def metered(self, pick: Pick, prompt_tokens: int, cached_tokens: int) -> None:
        """What the engine's usage says of a prompt this router placed by prefix.

        ``prompt_tokens``: the engine's count of it, which is what the
        model's characters per token are learnt from (the index's
        capacities are tokens, its blocks characters). ``cached_tokens``:
        the part the engine found cached (0 where it does not say): a prompt
        routed as new that the engine had cached, or routed as held that it
        had not, corrects the index's capacity for the replica. Called once
        per answer with usage, off the client's path (after its end).
        """
        speed = self._speed
        speed.counted(pick.prompt_chars, prompt_tokens)
        replica = pick.replica
        resync = abs(speed.chars_per_token / self._synced_chars - 1.0) > CHARS_RESYNC
        if cached_tokens > 0:
            replica.reports_cached = True
            if pick.outcome == MISS and 2 * cached_tokens >= prompt_tokens:
                resync |= _rescale(replica, CAPACITY_STEP)
        elif pick.outcome == HIT and replica.reports_cached:
            resync |= _rescale(replica, 1.0 / CAPACITY_STEP)
        if resync:
            self._sync_index()

    def measured(self, tokens: float, seconds: float) -> None:
        """A replica answered a prefill of ``tokens`` in ``seconds`` (see PrefillSpeed)."""
        self._speed.observe(tokens, seconds)

    def record(self, pick: Pick) -> None:
        """The pick's replica has computed the prompt: it holds the prefix from now on.

        Recorded when the answer starts, not when the request is sent: until
        then the engine holds nothing, and a second prompt of the same group
        sent after the first would wait behind its prefill instead of
        starting at once on an idle replica.
        """
        hashes = pick.hashes
        if not hashes and pick.prompt is not None:
            hashes = pick.hashes = block_hashes(pick.prompt, self._block_chars)
        if hashes:
            self._index.record(pick.replica.replica_id, hashes)
