"""Prompt rendering, chained block hashes, the bounded index, and the policies alone.

The prefix policy is driven with made-up loads and durations, so every
choice it makes here is deterministic.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import pytest

from llmgw import wire
from llmgw.gateway.routing.leastloaded import least_loaded
from llmgw.gateway.routing.measured import (
    LOW_LOAD_IDLE_SHARE,
    IdleShare,
    PrefillSpeed,
    low_load_share,
)
from llmgw.gateway.routing.policy import HIT, MISS, OVERLOADED, UNROUTED, Pick
from llmgw.gateway.routing.prefill import LEARN_AFTER_S, Prefill
from llmgw.gateway.routing.prefix import PrefixPolicy, SoonestStart, rendezvous
from llmgw.gateway.routing.prefixindex import (
    PrefixIndex,
    block_hashes,
    render_chat,
    render_completion,
    stable_key,
)
from llmgw.gateway.routing.replica import Replica
from llmgw.gateway.routing.router import ModelRouter
from llmgw.gateway.settings import GatewaySettings
from llmgw.gateway.snapshot import ConfigView

BLOCK = 16  # characters per block in these tests
TPS = 1000.0  # prefill tokens/s of the made-up replicas: 4,000 characters a second
# A prompt of 64 blocks (1,024 characters, 256 tokens: 0.256 s of prefill at
# TPS); a "system prompt" holder has its first 48 blocks.
PROMPT = 64 * BLOCK
SYSTEM = "s" * PROMPT  # the system prompt one group of prompts shares


def replica(name: str, kv: int = 32768) -> Replica:
    return Replica(wire.Endpoint(replica_id=name, url=f"http://{name}", kv_capacity_tokens=kv))


def prefix_of(router: ModelRouter) -> PrefixPolicy:
    """The prefix policy ``router`` asks (its index and measured speed)."""
    assert isinstance(router.policy, PrefixPolicy)
    return router.policy


def router(
    names: list[str],
    policy: wire.RoutingPolicy = "prefix",
    kv: int = 32768,
    lone: bool = False,
    clock: Callable[[], float] = lambda: 0.0,
    **kw: float,
) -> ModelRouter:
    """A router on ``clock`` (frozen by default: queues set by hand are not counted down)."""
    route = wire.ModelRoute(name="m", served_name="m", routing=policy)
    return ModelRouter(
        route,
        [replica(n, kv) for n in names],
        PrefixIndex(),
        PrefillSpeed(kw.get("prefill_tps", TPS)),
        block_chars=BLOCK,
        chars_per_token=4.0,
        tokens_per_unit=2048.0,
        ttft_slack_s=kw.get("slack_s", 0.05),
        wait_ratio=kw.get("wait_ratio", 0.5),
        spread=kw.get("spread", 4.0),
        gateways=1 if lone else int(kw.get("gateways", 0)),
        clock=clock,
    )


async def second_while_first_prefills(prefix: ModelRouter) -> tuple[Pick, Pick | None]:
    """The first two prompts of one group (one system prompt, SYSTEM): the first picked (a
    miss) and sent (Prefill: its tokens queued on its replica, on the loop's next turn its
    prefix recorded) and still prefilling, then where the second goes meanwhile."""
    first = prefix.pick(SYSTEM + "question one")
    assert first is not None and first.outcome == MISS
    first.replica.in_flight += 1
    Prefill(prefix, first)
    await asyncio.sleep(0)
    return first, prefix.pick(SYSTEM + "question two")


class Policy:
    """SoonestStart at TPS, as the router calls it.

    ``idle_share``: the average share of idle replicas each call starts
    from (a router's running average; 1.0, a gateway that has sent nothing).
    """

    def __init__(
        self,
        slack_s: float = 0.05,
        wait_ratio: float = 0.5,
        spread: float = 4.0,
        idle_share: float = 1.0,
        lone: bool = False,
        copy_cost: float = 0.0,
    ):
        self.inner = SoonestStart(
            block_chars=BLOCK,
            chars_per_token=4.0,
            slack_s=slack_s,
            wait_ratio=wait_ratio,
            spread=spread,
            lone=lone,
            copy_cost=copy_cost,
        )
        self.idle_share = idle_share

    def choose(
        self, replicas: list[Replica], matched: dict[str, int], chars: int = PROMPT, key: int = 1
    ) -> tuple[Replica, str, float]:
        average = IdleShare()
        average.value = self.idle_share
        return self.inner.choose(replicas, matched, chars, key, TPS, average, 0.0)

    def landings(self, replicas: list[Replica], keys: int = 40) -> set[str]:
        """Where new prompts with ``keys`` different first blocks would go."""
        return {self.choose(replicas, {}, key=k)[0].replica_id for k in range(keys)}


def test_chat_rendering_is_canonical_and_flattens_parts() -> None:
    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    split = [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]
    parts = [
        {"role": "system", "content": split},
        {"role": "user", "content": "hi", "name": "ignored-extra-field"},
    ]
    assert render_chat(plain) == render_chat(parts)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}]
    assert "data:x" in (render_chat(image) or "")
    # A different role is a different prompt, even with the same text.
    assert render_chat([{"role": "user", "content": "be brief"}]) != render_chat(plain[:1])
    assert render_chat("not a list") is None
    assert render_chat([1, 2]) is None
    assert render_completion("abc") == "abc"
    assert render_completion(["first", "second"]) == "first"
    assert render_completion([1, 2, 3]) == "1,2,3"
    assert render_completion(None) is None


def test_block_hashes_chain_so_equal_blocks_after_different_starts_differ() -> None:
    a = block_hashes("AAAA" + "same", 4)
    b = block_hashes("BBBB" + "same", 4)
    assert len(a) == 2 and a[1] != b[1]
    longer = block_hashes("AAAAsameMORE", 4)
    assert longer[:2] == a
    assert stable_key("AAAAxyz", 4) == stable_key("AAAAqrs", 4)  # first block only
    assert stable_key("AAAA", 4) != stable_key("AAAB", 4)


def test_index_longest_match_and_lru_bound() -> None:
    index = PrefixIndex()
    index.sync({"r1": 4, "r2": 100})
    long_prompt = block_hashes("a" * 16 + "b" * 16 + "c" * 16, 16)
    index.record("r1", long_prompt[:1])
    index.record("r2", long_prompt)
    allowed = {"r1": 1, "r2": 1}
    # Every holder with how much it holds, not only the longest.
    assert index.matches(long_prompt, allowed) == {"r2": 3, "r1": 1}
    assert index.matches(long_prompt[:1], allowed) == {"r1": 1, "r2": 1}
    assert index.matches(long_prompt, {"r1": 1}) == {"r1": 1}
    assert index.matches(block_hashes("z" * 16, 16), allowed) == {}
    # r1 holds at most 4 blocks: older prompts fall out, their prefixes with them.
    for n in range(10):
        index.record("r1", block_hashes(f"{n:016d}", 16))
    assert index.blocks("r1") == 4
    assert index.matches(long_prompt, {"r1": 1}) == {}
    # A replica that leaves the config leaves the index.
    index.sync({"r1": 4})
    assert index.matches(long_prompt, allowed) == {}


def test_lru_evicts_a_prefix_from_its_end() -> None:
    index = PrefixIndex()
    index.sync({"r": 3})
    hashes = block_hashes("x" * 16 * 4, 16)  # 4 blocks, capacity 3
    index.record("r", hashes)
    assert index.matches(hashes, {"r": 1}) == {"r": 3}


def test_least_loaded_and_rendezvous() -> None:
    a, b, c = replica("a"), replica("b"), replica("c")
    a.in_flight, b.in_flight, c.in_flight = 5, 1, 1
    assert least_loaded([a, b, c], 2048.0, 0) in (b, c)
    # Ties rotate with the start index, so idle replicas share the work.
    assert {least_loaded([b, c], 2048.0, s).replica_id for s in range(2)} == {"b", "c"}
    # Rendezvous agrees with itself whatever the order and survives removing others.
    key = 12345
    chosen = rendezvous([a, b, c], key)
    assert rendezvous([c, b, a], key) is chosen
    others = [r for r in (a, b, c) if r is not chosen]
    assert rendezvous([chosen, others[0]], key) is chosen


def test_new_prefix_goes_by_hash_unless_it_would_wait_a_whole_prefill() -> None:
    policy = Policy()
    a, b, c = replica("a"), replica("b"), replica("c")
    for key in range(40):
        picked, outcome, uncached = policy.choose([a, b, c], {}, key=key)
        assert outcome == MISS and uncached == 256.0
        # The same key lands alike whatever the order: two gateways agree.
        assert policy.choose([c, a, b], {}, key=key)[0] is picked
        assert picked is rendezvous([a, b, c], key)
    # Busy everywhere (no idle replica to prefer), one with some prefill
    # queued (0.1 s against 0.256 s of its own): still within the wait
    # ratio, so the hash decides, and a gateway that cannot see that load
    # (another gateway's) chooses alike.
    a.in_flight = b.in_flight = c.in_flight = 1
    b.pending_prefill = 100.0
    assert policy.landings([a, b, c]) == {"a", "b", "c"}
    # A whole prefill of its size queued there (the first prompt of the same
    # new group, still prefilling): never waited behind.
    b.pending_prefill = 256.0
    assert policy.landings([a, b, c]) == {"a", "c"}
    # With a tighter ratio, any queue that is more than the slack counts.
    strict = Policy(wait_ratio=0.0)
    b.pending_prefill = 40.0  # 0.04 s: within the 0.05 s slack
    assert strict.landings([a, b, c]) == {"a", "b", "c"}
    b.pending_prefill = 100.0
    assert strict.landings([a, b, c]) == {"a", "c"}


def test_at_low_load_a_new_prefix_skips_a_busy_replica_for_the_next_idle_one() -> None:
    policy = Policy()
    fleet = [replica(n) for n in "abcd"]
    a, b, c, d = fleet
    a.in_flight = 1  # decoding: nothing queued, so just as soon by the estimate
    for key in range(40):
        picked = policy.choose(fleet, {}, key=key)[0]
        # The first idle replica in hash order (where the hash says, when that is idle).
        assert picked is rendezvous([b, c, d], key)
    assert "a" not in policy.landings(fleet)
    # Low load is the average over recent picks, not the share at this one:
    # a burst that leaves one replica of four idle still detours to it...
    b.in_flight = c.in_flight = 1
    assert policy.landings(fleet) == {"d"}
    # ...and under load (on average fewer than LOW_LOAD_IDLE_SHARE idle) a
    # lull with half the fleet idle does not: the hash alone decides, as a
    # gateway with another view of who is idle decides too.
    c.in_flight = 0
    loaded = Policy(idle_share=LOW_LOAD_IDLE_SHARE - 0.05)
    assert loaded.landings(fleet) == {"a", "b", "c", "d"}
    assert Policy(idle_share=LOW_LOAD_IDLE_SHARE + 0.05).landings(fleet) == {"c", "d"}
    # A prompt somebody holds is no new prefix: its holder too busy, it goes
    # by hash among the others, busy or not.
    b.in_flight = c.in_flight = 0
    holder = replica("holder")
    holder.pending_prefill = 1000.0
    spilled = {
        policy.choose([holder, *fleet], {"holder": 64}, key=k)[0].replica_id for k in range(40)
    }
    assert "a" in spilled


def test_a_lone_gateway_places_a_new_prefix_by_load_at_any_load() -> None:
    # Under load (the average share idle is low), where a gateway among
    # others places by hash, the only gateway takes the soonest start.
    loaded = LOW_LOAD_IDLE_SHARE - 0.3
    lone, shared = Policy(idle_share=loaded, lone=True), Policy(idle_share=loaded)
    fleet = [replica(n) for n in "abcd"]
    a, b, c, d = fleet
    a.in_flight = b.in_flight = 1  # decoding: just as soon by the prefill estimate
    assert lone.landings(fleet) == {"c", "d"}  # idle ones, by hash between them
    assert shared.landings(fleet) == {"a", "b", "c", "d"}
    # None idle: the fewest requests in flight (fewer answers decoding beside it).
    a.in_flight, b.in_flight, c.in_flight, d.in_flight = 3, 1, 2, 1
    assert lone.landings(fleet) == {"b", "d"}
    # ...but prefill queued counts first: a prompt would wait for all of it.
    b.pending_prefill = 30.0
    assert lone.landings(fleet) == {"d"}
    d.pending_prefill = 60.0
    assert lone.landings(fleet) == {"c"}  # a and c queue nothing; c has fewer in flight
    # A close holder still keeps its prefix (a hit saves a whole prefill)...
    holder = replica("holder")
    holder.in_flight = 5
    for key in range(10):
        picked, outcome, uncached = lone.choose([holder, *fleet], {"holder": 48}, key=key)
        assert (picked, outcome, uncached) == (holder, HIT, 64.0)
    # ...and a busy one loses it to the soonest start, not to the hash.
    holder.pending_prefill = 1000.0
    for key in range(10):
        picked, outcome, _ = lone.choose([holder, *fleet], {"holder": 48}, key=key)
        assert (picked, outcome) == (c, OVERLOADED)


def test_idle_share_averages_over_recent_picks() -> None:
    share = IdleShare()
    assert share.value == 1.0  # nothing sent yet: every replica idle
    # One pick with a quarter idle moves it 1/32 of the way, no more.
    assert share.observe(1, 4) == pytest.approx(1.0 - 0.75 / 32)
    # A sustained share is reached within a few multiples of 32 picks.
    for _ in range(300):
        share.observe(1, 4)
    assert share.value == pytest.approx(0.25, abs=1e-3)


def test_router_reads_low_load_from_its_own_recent_picks() -> None:
    # Through ModelRouter: its picks feed one average, so after a stretch
    # with every replica busy, half of them idle is no low load, and new
    # prefixes go where the hash says even when that is busy.
    fleet = router(["a", "b", "c", "d"])
    for busy in fleet.replicas:
        busy.in_flight = 1
    c, d = fleet.replicas[2:]
    for n in range(64):
        assert fleet.pick(f"{n:04d}" + "x" * PROMPT) is not None
    c.in_flight = d.in_flight = 0
    landed = set()
    for n in range(64, 104):
        pick = fleet.pick(f"{n:04d}" + "x" * PROMPT)
        assert pick is not None
        landed.add(pick.replica.replica_id)
    assert {"a", "b"} & landed
    # A fresh router (nothing sent: all idle on average) detours them, for
    # the 18 picks its average (from 1, toward 0.5) stays above the low-load
    # share of a gateway among several (0.775).
    fresh = router(["a", "b", "c", "d"])
    fresh.replicas[0].in_flight = fresh.replicas[1].in_flight = 1
    for n in range(16):
        pick = fresh.pick(f"{n:04d}" + "x" * PROMPT)
        assert pick is not None and pick.replica.replica_id in ("c", "d")


def test_holder_wins_while_its_saving_outweighs_its_queue() -> None:
    policy = Policy()
    holder, idle = replica("holder"), replica("idle")
    held = {"holder": 64}
    # Idle holder: the whole prompt is cached.
    assert policy.choose([holder, idle], held) == (holder, HIT, 0.0)
    # Busy with another prompt's prefill worth 0.2 s: still sooner than 0.256 s elsewhere.
    holder.pending_prefill = 200.0
    assert policy.choose([holder, idle], held)[:2] == (holder, HIT)
    # Worth 0.35 s (another group's cold prompt prefilling there): the idle
    # replica answers sooner by more than the slack, and a hit never waits
    # like that.
    holder.pending_prefill = 350.0
    picked, outcome, uncached = policy.choose([holder, idle], held)
    assert (outcome, uncached) == (OVERLOADED, 256.0) and picked is idle
    # Within the slack of the soonest, the cache wins: 0.35 s against 0.256 s
    # when the slack is 0.1 s.
    assert Policy(slack_s=0.1).choose([holder, idle], held)[:2] == (holder, HIT)


def test_a_busy_holders_prompt_goes_by_hash_like_a_new_one() -> None:
    policy = Policy()
    holder, b, c = replica("holder"), replica("b"), replica("c")
    holder.pending_prefill = 1000.0  # 1 s of queue: far beyond both tolerances
    held = {"holder": 64}
    spilled = {policy.choose([holder, b, c], held, key=k)[0].replica_id for k in range(40)}
    assert spilled == {"b", "c"}  # where another gateway would spill it too
    for k in range(40):
        picked, outcome, _ = policy.choose([holder, b, c], held, key=k)
        assert picked is rendezvous([b, c], k) and outcome == OVERLOADED


def test_a_partial_holder_counts_what_it_saves() -> None:
    policy = Policy()
    full, partial, cold = replica("full"), replica("partial"), replica("cold")
    held = {"full": 64, "partial": 48}
    full.pending_prefill = 500.0  # 0.5 s of queue: far later than the others
    picked, outcome, uncached = policy.choose([full, partial, cold], held, key=7)
    # The partial holder computes 16 blocks (64 tokens, 0.064 s); the cold one all 256.
    assert (picked, outcome, uncached) == (partial, OVERLOADED, 64.0)
    # A prompt shorter than what is held costs nothing, never less than nothing.
    assert policy.choose([partial], {"partial": 48}, chars=10 * BLOCK)[2] == 0.0


def test_tolerances_are_seconds_at_the_measured_speed() -> None:
    inner = SoonestStart(
        block_chars=BLOCK, chars_per_token=4.0, slack_s=0.05, wait_ratio=0.5, spread=4.0
    )
    holder, idle = replica("holder"), replica("idle")
    holder.pending_prefill = 300.0
    held = {"holder": 64}
    # 300 tokens queued against 256 to compute elsewhere: 44 tokens apart.
    # At 1,000 tokens/s that is 0.044 s, within the 0.05 s slack...
    fast = inner.choose([holder, idle], held, PROMPT, 1, 1000.0, IdleShare(), 0.0)
    assert fast[:2] == (holder, HIT)
    # ...at 500 tokens/s it is 0.088 s, beyond it.
    assert inner.choose([holder, idle], held, PROMPT, 1, 500.0, IdleShare(), 0.0)[0] is idle


def test_in_flight_spread_bounds_a_hot_prefix() -> None:
    # Fully cached where it is held, so the estimate is 0 on the holder
    # however many are in flight there; the spread is what stops the pile.
    policy = Policy(spread=2.0)
    holder, other = replica("holder"), replica("other")
    held = {"holder": 64}
    sent = []
    for _ in range(8):
        picked, outcome, uncached = policy.choose([holder, other], held, key=5)
        picked.in_flight += 1
        picked.pending_prefill += uncached
        sent.append((picked.replica_id, outcome))
    assert sent.count(("holder", HIT)) == 5
    assert sent.count(("other", OVERLOADED)) == 3


def test_prefill_speed_measurement() -> None:
    speed = PrefillSpeed(8192.0)
    speed.observe(100.0, 1.0)  # too few tokens to tell prefill from overhead
    assert speed.tokens_per_s == 8192.0 and speed.samples == 0
    speed.observe(1000.0, 1.0)  # the first sample replaces the prior outright
    assert speed.tokens_per_s == pytest.approx(1000.0)
    speed.observe(4000.0, 1.0)  # settling: the geometric mean of the samples so far
    assert speed.tokens_per_s == pytest.approx(2000.0)
    speed.observe(2000.0, 1.0)
    speed.observe(2000.0, 1.0)
    assert speed.tokens_per_s == pytest.approx(2000.0)
    # Settled: a wild sample (a prompt the engine had cached after all) counts
    # as 4x the estimate at most, and moves it a tenth of the way (in log terms).
    speed.observe(1_000_000.0, 1.0)
    assert speed.tokens_per_s == pytest.approx(2000.0 * 4.0**0.1)
    speed.observe(1000.0, 0.0)  # no duration: no sample
    assert speed.samples == 5


@pytest.mark.parametrize("lone", [False, True])
async def test_a_groups_second_prompt_during_the_firsts_prefill_goes_to_its_holder(
    lone: bool,
) -> None:
    # The prefix is its replica's from the send on: the second prompt starts
    # there about as soon as elsewhere (the prefix is computed meanwhile, and
    # the queue counts down as it is), and leaves no second copy of it.
    # Recorded at the first token instead, it found no holder: 19 prompts of
    # bench/routing.py at 16 req/s computed their group's prefix twice.
    prefix = router(["a", "b", "c"], lone=lone)
    first, second = await second_while_first_prefills(prefix)
    assert second is not None and second.outcome == HIT
    assert second.replica is first.replica
    assert second.uncached_tokens < first.uncached_tokens


def test_a_replicas_queue_counts_down_as_its_engine_computes_it() -> None:
    # A queued prefill counted whole until its first token made a holder a
    # few milliseconds from done look a whole prefill busier than an idle
    # replica, and its group's prompts went elsewhere.
    now = [0.0]
    fleet = router(["holder", "idle"], clock=lambda: now[0])
    holder, idle = fleet.replicas
    prefix_of(fleet).index.record("holder", block_hashes(SYSTEM, BLOCK))

    def pick() -> tuple[Replica, str]:
        chosen = fleet.pick(SYSTEM)
        assert chosen is not None
        return chosen.replica, chosen.outcome

    holder.charge(350.0, 0.0)  # another group's cold prompt: 0.35 s at TPS
    assert pick() == (idle, OVERLOADED)  # 0.35 s there, 0.256 s elsewhere
    now[0] = 0.2
    assert pick() == (holder, HIT)  # 0.15 s left of it
    # A second cold prompt queued behind it begins at the first one's answer.
    holder.charge(400.0, 0.25)
    now[0] = 0.35
    holder.answered(350.0, 0.35)
    assert pick() == (idle, OVERLOADED)  # all 0.4 s of it left
    now[0] = 0.45
    assert pick() == (holder, HIT)
    # A replica computing one request at a time decodes an answer before the
    # next prefill begins: its queue is counted whole.
    serial_fleet = router(["holder", "idle"], clock=lambda: now[0])
    serial_fleet.replicas[:] = [serial("holder"), serial("idle")]
    prefix_of(serial_fleet)._sync_index()
    prefix_of(serial_fleet).index.record("holder", block_hashes(SYSTEM, BLOCK))
    serial_fleet.replicas[0].charge(600.0, 0.0)
    now[0] = 0.5
    chosen = serial_fleet.pick(SYSTEM)
    assert chosen is not None and chosen.outcome == OVERLOADED


def test_gateways_sharing_the_traffic_read_low_load_from_the_nth_power_of_the_idle_share() -> None:
    # Each of N gateways sees only its own requests in flight: with the lone
    # threshold two gateways read 0.6-0.68 of the replicas idle at 8-12
    # req/s (bench/routing.py), detoured new prefixes to their own idle
    # replicas, placed them apart, and lost hits. Through the config, as a
    # gateway builds its routers.
    assert low_load_share(1) == LOW_LOAD_IDLE_SHARE
    assert low_load_share(2) == pytest.approx(LOW_LOAD_IDLE_SHARE**0.5)
    assert low_load_share(0) == low_load_share(2)  # a count not known yet: several

    def landings(replicas: int) -> set[str]:
        """Where new prefixes of one of two gateways go, one replica ("a") of ``replicas`` busy."""
        endpoints = [wire.Endpoint(replica_id=n, url=f"http://{n}") for n in "abcdefgh"[:replicas]]
        route = wire.ModelRoute(name="m", served_name="m", routing="prefix", endpoints=endpoints)
        table = wire.RoutingTable(version=1, models=[route], gateways=2)
        fleet = ConfigView(wire.GatewayConfig(routing=table), GatewaySettings(), None).routes["m"]
        fleet.replicas[0].in_flight = 1
        landed = set()
        for n in range(168):  # the first 128 bring the average to the share at every pick
            pick = fleet.pick(f"{n:04d}" + "x" * PROMPT)
            assert pick is not None
            if n >= 128:
                landed.add(pick.replica.replica_id)
        return landed

    assert "a" not in landings(8)  # 0.875 idle: low load, detoured (0.875^2 = 0.77)
    assert "a" in landings(4)  # 0.75 idle (0.56): by hash, as the other gateway does


def test_router_measures_one_speed_per_model_and_keeps_it() -> None:
    route = wire.ModelRoute(name="m", served_name="m", routing="prefix")
    speed = PrefillSpeed(8192.0)
    holder, other = replica("holder"), replica("other")

    def version() -> ModelRouter:  # a config version; the speed is carried over
        return ModelRouter(
            route, [holder, other], PrefixIndex(), speed, block_chars=BLOCK,
            chars_per_token=4.0, tokens_per_unit=2048.0, ttft_slack_s=0.05, wait_ratio=0.5,
            spread=4.0, gateways=0, clock=lambda: 0.0,
        )  # fmt: skip

    first = version()
    first.record(Pick(holder, MISS, block_hashes("h" * PROMPT, BLOCK), 256.0))
    holder.pending_prefill = 350.0  # 94 tokens later than computing it all elsewhere
    # At the 8,192 tokens/s prior, 94 tokens are 0.011 s: the holder keeps it.
    assert first.pick("h" * PROMPT).replica is holder  # type: ignore[union-attr]
    first.measured(1000.0, 1.0)
    # Measured at 1,000 tokens/s they are 0.094 s, beyond the 0.05 s slack, and
    # the next version of the config still knows it.
    later = version()
    later.record(Pick(holder, MISS, block_hashes("h" * PROMPT, BLOCK), 256.0))
    assert speed.tokens_per_s == pytest.approx(1000.0)
    again = later.pick("h" * PROMPT)
    assert again is not None and again.replica is other and again.outcome == OVERLOADED


def test_router_policies_and_cooldown() -> None:
    rr = router(["a", "b", "c"], "round-robin")
    assert len({rr.pick("x").replica.replica_id for _ in range(3)}) == 3  # type: ignore[union-attr]
    ll = router(["a", "b"], "least-loaded")
    ll.replicas[0].in_flight = 3
    assert ll.pick("x").replica.replica_id == "b"  # type: ignore[union-attr]
    prefix = router(["a", "b", "c"])
    first = prefix.pick("s" * 64 + "question one")
    assert first is not None
    prefix.record(first)
    again = prefix.pick("s" * 64 + "question two")
    assert again is not None
    assert first.outcome == MISS and again.outcome == HIT
    assert again.replica is first.replica
    # A cooled replica is skipped while others are available, and offered again when alone.
    chosen = first.replica
    chosen.connect_failed(cooldown_after=1, cooldown_s=60)
    third = prefix.pick("s" * 64 + "question three")
    assert third is not None and third.replica is not chosen
    others = [r for r in prefix.replicas if r is not chosen]
    assert prefix.pick("anything", exclude=others).replica is chosen  # type: ignore[union-attr]
    chosen.connect_succeeded()
    assert chosen.cooled_until == 0.0
    assert router([]).pick("x") is None
    # One replica left of two still keeps its index, for when the other returns.
    pair = router(["only", "other"])
    only, other = pair.replicas
    once = pair.pick("t" * 64, exclude=[other])
    assert once is not None and once.replica is only and once.outcome == MISS
    pair.record(once)
    assert pair.pick("t" * 64, exclude=[other]).outcome == HIT  # type: ignore[union-attr]


def test_a_lone_replica_gets_no_prefix_work(monkeypatch: pytest.MonkeyPatch) -> None:
    # A model with one replica: callers are told not to render the prompt, and
    # a prompt given anyway is neither hashed nor looked up nor recorded.
    alone = router(["only"])
    assert not alone.wants_prompt
    assert router(["a", "b"]).wants_prompt and router([]).wants_prompt
    assert not router(["a", "b"], "least-loaded").wants_prompt

    def forbidden(*args: object) -> None:
        raise AssertionError("prefix work for a lone replica")

    monkeypatch.setattr("llmgw.gateway.routing.prefix.block_hashes", forbidden)
    monkeypatch.setattr("llmgw.gateway.routing.prefix.stable_key", forbidden)
    for method in ("matches", "depth", "record"):
        monkeypatch.setattr(PrefixIndex, method, forbidden)
    for _ in range(3):
        pick = alone.pick("s" * PROMPT)
        assert pick == Pick(alone.replicas[0], UNROUTED, [], 0.0)
        alone.record(pick)
    # Cooling down changes nothing: it is offered again, being all there is.
    alone.replicas[0].connect_failed(cooldown_after=1, cooldown_s=60)
    assert alone.pick("s" * PROMPT) == Pick(alone.replicas[0], UNROUTED, [], 0.0)
    assert alone.pick("s" * PROMPT, fallback=False) is None
    # Once tried (excluded), there is nothing else to offer.
    assert alone.pick("s" * PROMPT, exclude=alone.replicas) is None


def test_two_replicas_route_by_prefix_as_before() -> None:
    # The same prompts through two replicas: prefix work is done, and the
    # choices are those SoonestStart makes from the index (miss, then hit).
    pair = router(["a", "b"])
    assert pair.wants_prompt
    system = "s" * PROMPT
    first = pair.pick(system + "one")
    assert first is not None and first.outcome == MISS
    assert first.hashes == block_hashes(system + "one", BLOCK)
    assert first.replica is rendezvous(pair.replicas, stable_key(system + "one", BLOCK))
    pair.record(first)
    again = pair.pick(system + "two")
    assert again is not None and (again.replica, again.outcome) == (first.replica, HIT)
    assert again.uncached_tokens < first.uncached_tokens


def test_one_replica_is_picked_as_the_policy_would_pick_it() -> None:
    # ModelRouter.pick answers for one candidate left (the other excluded)
    # without SoonestStart.choose: same replica, outcome and uncached tokens,
    # from every state of its index.
    rng = random.Random(7)
    for spread, slack_s in ((4.0, 0.05), (0.0, 0.0), (-1.0, 0.0)):
        lone = router(["a", "z"], spread=spread, slack_s=slack_s)
        policy = Policy(slack_s=slack_s, spread=spread)
        only, gone = lone.replicas
        index = PrefixIndex()
        index.sync({"a": 1 << 20})
        outcomes: set[str] = set()
        for _ in range(300):
            blocks = [rng.choice(("a", "b")) * BLOCK for _ in range(rng.randrange(4))]
            prompt = "".join(blocks) + "c" * rng.randrange(1, 2 * BLOCK)
            only.in_flight = rng.randrange(3)
            only.pending_prefill = rng.choice((0.0, 10.0, 1e6))
            pick = lone.pick(prompt, exclude=[gone])
            assert pick is not None and pick.hashes == block_hashes(prompt, BLOCK)
            matched = index.matches(pick.hashes, {"a": only})
            replica, outcome, uncached = policy.choose([only], matched, len(prompt))
            assert (pick.replica, pick.outcome) == (replica, outcome)
            assert pick.uncached_tokens == uncached
            outcomes.add(outcome)
            if rng.random() < 0.5:
                lone.record(pick)
                index.record("a", pick.hashes)
        assert outcomes == {HIT, MISS}


def test_only_a_table_that_counts_this_gateway_alone_makes_it_lone() -> None:
    # Through the config, as a gateway builds its routers: under load, two
    # of four replicas busy, a lone gateway's new prefixes avoid the busy
    # two; with others (or a count not known yet) the hash alone decides.
    endpoints = [wire.Endpoint(replica_id=n, url=f"http://{n}") for n in "abcd"]
    route = wire.ModelRoute(name="m", served_name="m", routing="prefix", endpoints=endpoints)

    def landings(gateways: int) -> set[str]:
        table = wire.RoutingTable(version=1, models=[route], gateways=gateways)
        view = ConfigView(wire.GatewayConfig(routing=table), GatewaySettings(), None)
        fleet = view.routes["m"]
        for busy in fleet.replicas:
            busy.in_flight = 1
        for n in range(64):  # a stretch under load brings the idle average down
            assert fleet.pick(f"{n:04d}" + "x" * PROMPT) is not None
        fleet.replicas[2].in_flight = fleet.replicas[3].in_flight = 0
        landed = set()
        for n in range(64, 104):
            pick = fleet.pick(f"{n:04d}" + "x" * PROMPT)
            assert pick is not None
            landed.add(pick.replica.replica_id)
        return landed

    assert landings(1) == {"c", "d"}
    assert {"a", "b"} & landings(2)
    assert {"a", "b"} & landings(0)


def test_a_lone_gateways_short_path_for_new_prefixes_chooses_as_the_general_one() -> None:
    # A prompt nobody holds goes down SoonestStart.place_new; a matched entry
    # for a replica not in the list sends the same prompt down the general
    # path, which ranks by (estimate, in flight, -hash) among non-holders.
    # Ties by hash, not by list order: order piled new prefixes on the
    # replicas after busy ones (the replay's seed 1 at 8 req/s, 0.358 -> 0.370 s).
    lone = Policy(lone=True)
    rng = random.Random(7)
    for trial in range(300):
        fleet = [replica(f"r{i}") for i in range(rng.randint(2, 9))]
        for r in fleet:
            r.in_flight = rng.choice((0, 0, 1, 2, 6))
            r.pending_prefill = rng.choice((0.0, 0.0, 100.0, 250.0))
        key = rng.getrandbits(32)
        short = lone.choose(fleet, {}, key=key)
        general = lone.choose(fleet, {"not-in-the-list": 3}, key=key)
        assert short[0] is general[0], trial
        assert short[1:] == (MISS, PROMPT / 4.0)


@pytest.mark.parametrize("lone", [False, True])
async def test_the_router_learns_off_the_path_to_the_send_and_to_the_first_token(
    lone: bool,
) -> None:
    # Where the gateway's code runs cold (low load, ~50 us) the prefix is
    # recorded on the loop's next turn after the send (the request written
    # to a pooled connection by then), and the speed sampled LEARN_AFTER_S
    # after the first chunk, past the loop turns that relay a first token
    # sent apart from the role chunk; the queued prefill is released at the
    # first chunk, so the next pick sees the replica free.
    now = [0.0]
    fleet = router(["a", "b"], lone=lone, clock=lambda: now[0])
    prompt = "p" * PROMPT
    hashes = block_hashes(prompt, BLOCK)
    pick = fleet.pick(prompt)
    assert pick is not None and pick.by_prefix
    prefill = Prefill(fleet, pick)
    assert pick.replica.pending_prefill > 0
    assert prefix_of(fleet).index.depth(hashes, pick.replica.replica_id) == 0
    await asyncio.sleep(0)
    assert prefix_of(fleet).index.depth(hashes, pick.replica.replica_id) == len(hashes)
    now[0] = 0.32
    prefill.started(streamed=True)
    assert pick.replica.pending_prefill == 0
    speed = prefix_of(fleet).speed
    for _ in range(3):  # the role chunk's turn, the first token's read, its relay
        await asyncio.sleep(0)
        assert speed.samples == 0
    await asyncio.sleep(LEARN_AFTER_S * 2)
    assert speed.samples == 1 and speed.tokens_per_s == pytest.approx(PROMPT / 4.0 / 0.32)


def test_a_lone_gateway_hashes_a_new_prompt_only_once_it_is_sent() -> None:
    # Nobody holds the first block: the pick is made from it alone, the rest
    # of the hashing waits for record (after the send). What is recorded
    # then is the whole prompt, and the next prompt with that prefix finds
    # it.
    fleet = router(["a", "b", "c"], lone=True)
    system = "s" * (PROMPT - 64)
    first = fleet.pick(system + "one")
    assert first is not None and first.outcome == MISS and first.by_prefix
    assert first.hashes == []  # not computed before the send
    assert first.uncached_tokens == len(system + "one") / 4.0
    fleet.record(first)
    assert first.hashes == block_hashes(system + "one", BLOCK)
    second = fleet.pick(system + "two")
    assert second is not None and second.outcome == HIT
    assert second.replica is first.replica
    assert second.hashes == block_hashes(system + "two", BLOCK)  # the general path hashes


def test_a_gateway_among_several_hashes_every_prompt_before_it_picks() -> None:
    # Only a lone gateway defers: the others place a new prefix by its
    # rendezvous among close replicas, which reads the estimates.
    fleet = router(["a", "b", "c"])
    pick = fleet.pick("n" * PROMPT)
    assert pick is not None and pick.outcome == MISS
    assert pick.hashes == block_hashes("n" * PROMPT, BLOCK)


def test_engine_token_counts_size_the_index_in_characters() -> None:
    # KV for 256 tokens: 64 blocks of 16 characters at the prior 4 characters a
    # token, one PROMPT. The engine counts 8 characters a token: the replica
    # holds two such prompts, and the index must not forget the first.
    one = router(["r0", "r1"], kv=256, lone=True)
    first, second = "a" * PROMPT, "b" * PROMPT
    pick = one.pick(first)
    assert pick is not None
    one.record(pick)
    one.metered(pick, prompt_tokens=PROMPT // 8, cached_tokens=0)
    assert prefix_of(one).speed.chars_per_token == 8.0
    for prompt in (first, second):
        one.record(Pick(one.replicas[0], MISS, block_hashes(prompt, BLOCK), 0.0))
    assert prefix_of(one).index.depth(block_hashes(first, BLOCK), "r0") == 64
    assert prefix_of(one).index.depth(block_hashes(second, BLOCK), "r0") == 64


def test_engine_cached_reports_correct_the_index_capacity() -> None:
    one = router(["r0", "r1"], kv=256)
    target = one.replicas[0]
    hashes = block_hashes("a" * PROMPT, BLOCK)
    # Routed as new, found mostly cached: the index forgot what the engine kept.
    one.metered(Pick(target, MISS, hashes, 256.0, None, PROMPT), 256, 200)
    assert target.capacity_scale == 1.125 and target.reports_cached
    assert prefix_of(one).index._capacity["r0"] == int(64 * 1.125)
    # Routed as held, found nothing: the engine evicted it, the index shrinks back.
    one.metered(Pick(target, HIT, hashes, 0.0, None, PROMPT), 256, 0)
    assert target.capacity_scale == 1.0
    # An engine that never reported cached tokens says nothing by its zeros.
    other = one.replicas[1]
    one.metered(Pick(other, HIT, hashes, 0.0, None, PROMPT), 256, 0)
    assert other.capacity_scale == 1.0
    # Found a little of what the index counted held: it still holds too much.
    one.metered(Pick(target, HIT, hashes, 0.0, None, PROMPT), 256, 100)
    assert target.capacity_scale == 1.0 / 1.125


def test_a_lone_gateway_tells_a_hit_from_a_miss_by_the_engines_time() -> None:
    # An engine computing one request at a time that says nothing cached
    # (llama_cpp.server): from the gateway's turn to the first chunk it
    # computed this prompt alone, at the measured speed (TPS).
    one = router(["r0", "r1"], kv=256, lone=True)
    target = one.replicas[0]
    hashes = block_hashes("a" * PROMPT, BLOCK)
    whole_s = 256 / TPS
    # Routed as new and answered at once: the index forgot too early.
    one.metered(Pick(target, MISS, hashes, 256.0, None, PROMPT), 256, 0, whole_s / 20)
    assert target.capacity_scale == 1.125 and not target.reports_cached  # (told by time)
    # Routed as held and answered at once: held; nothing to correct.
    one.metered(Pick(target, HIT, hashes, 0.0, None, PROMPT), 256, 0, whole_s / 20)
    assert target.capacity_scale == 1.125
    # Routed as held and it took the whole prompt's time: evicted, but such
    # an engine evicts whole states in its own order, so a smaller index
    # would forget what it still holds (cachesize.py): kept.
    one.metered(Pick(target, HIT, hashes, 0.0, None, PROMPT), 256, 0, whole_s)
    assert target.capacity_scale == 1.125
    # An engine that says what it found cached shrinks it.
    one.metered(Pick(target, HIT, hashes, 0.0, None, PROMPT), 256, 10, whole_s)
    assert target.capacity_scale == 1.0
    # Untimed (an answer given whole), or timed by a gateway among several
    # (another's request may have been at the engine): nothing is inferred.
    other = one.replicas[1]
    one.metered(Pick(other, HIT, hashes, 0.0, None, PROMPT), 256, 0, None)
    assert not other.reports_cached and other.capacity_scale == 1.0
    several = router(["r0", "r1"], kv=256)
    shared = several.replicas[0]
    several.metered(Pick(shared, HIT, hashes, 0.0, None, PROMPT), 256, 0, whole_s)
    assert not shared.reports_cached and shared.capacity_scale == 1.0


async def test_a_timed_prompt_is_a_speed_sample_only_where_the_engine_computed_it() -> None:
    # Serial engines that say nothing cached, timed from the gateway's turn
    # (at half TPS: a whole prompt takes 0.512 s). A prompt routed as new
    # that comes back in 0.4 of that was loaded from the engine's cache:
    # taken as a sample at its first chunk it raised the speed (averaged
    # with the one before it) until its own time read as a whole prefill,
    # and the capacity never grew (a real-engine test failed 2 runs in 19).
    now = [0.0]
    lone = _serial_pair(now)
    speed = prefix_of(lone).speed
    whole_s = 2 * 256 / TPS

    async def answer(prompt: str, seconds: float, outcome: str = MISS) -> Replica:
        prefill = _answered(lone, now, prompt, seconds, outcome, streamed=True)
        await asyncio.sleep(LEARN_AFTER_S * 2)
        prefill.metered(len(prompt) // 4, 0)
        return prefill.pick.replica

    await answer("a" * PROMPT, whole_s)  # computed: the first sample replaces the prior
    assert speed.samples == 1 and speed.tokens_per_s == pytest.approx(TPS / 2)
    loaded = await answer("b" * PROMPT, 0.4 * whole_s)
    assert speed.samples == 1 and speed.tokens_per_s == pytest.approx(TPS / 2)
    assert loaded.capacity_scale == 1.125
    await answer("c" * PROMPT, whole_s)  # computed again: a sample
    assert speed.samples == 2 and speed.tokens_per_s == pytest.approx(TPS / 2)
    # Held in half, and it took the whole prompt's time: evicted, so the
    # time is not that of the half the index counted uncached.
    await answer("a" * PROMPT + "z" * PROMPT, 2 * whole_s, HIT)
    assert speed.samples == 2 and speed.tokens_per_s == pytest.approx(TPS / 2)
    await answer("a" * PROMPT + "y" * PROMPT, whole_s, HIT)  # held in half, as timed: a sample
    assert speed.samples == 3 and speed.tokens_per_s == pytest.approx(TPS / 2)


async def test_an_untimed_answer_from_an_engine_told_by_its_time_judges_nothing() -> None:
    # An engine declared serial (dialect ``concurrent: false``) that says
    # nothing of what it found cached tells it only by a stream a lone
    # gateway timed from its turn. An answer given whole (such an engine
    # that stops unstreamed requests itself is not asked for a stream), once
    # any answer had been timed, read its 0 as "found nothing" and shrank
    # the index at every hit.
    now = [1.0]  # (a turn taken at 0 reads as none)
    lone = _serial_pair(now)
    whole_s = 2 * 256 / TPS

    def answer(prompt: str, streamed: bool, outcome: str) -> Replica:
        prefill = _answered(lone, now, prompt, whole_s, outcome, streamed=streamed)
        lone.record(prefill.pick)
        prefill.metered(len(prompt) // 4, 0)
        return prefill.pick.replica

    held = answer("a" * PROMPT, True, MISS)
    for question in "xyz":
        assert answer("a" * PROMPT + question * 40, False, HIT) is held
    assert held.capacity_scale == 1.0
    # Timed, the same hit computed whole is an eviction the time shows, and
    # still only grows the capacity it never shrinks (cachesize.py).
    assert answer("a" * PROMPT + "w" * 40, True, HIT) is held
    assert held.capacity_scale == 1.0


def test_a_holder_keeps_what_a_detour_would_compute_twice() -> None:
    holder, idle = replica("holder"), replica("idle")
    held = {"holder": 64}
    # Another group's cold prompt prefilling on the holder (0.35 s): the idle
    # replica would start 0.094 s sooner, but only by computing the whole
    # held prefix again (0.256 s) and leaving a copy that evicts another.
    holder.pending_prefill = 350.0
    assert Policy(copy_cost=0.0).choose([holder, idle], held)[:2] == (idle, OVERLOADED)
    assert Policy(copy_cost=1.0).choose([holder, idle], held) == (holder, HIT, 0.0)
    # Queued beyond the prompt's own prefill twice over: the detour is the sooner start.
    holder.pending_prefill = 600.0
    assert Policy(copy_cost=1.0).choose([holder, idle], held)[:2] == (idle, OVERLOADED)


def test_a_lone_gateway_sends_a_forgotten_prefix_back_where_it_was() -> None:
    # KV for one PROMPT per replica in the index; the engines hold more.
    lone = router(["r0", "r1", "r2"], kv=256, lone=True)
    prompts = ["p" * PROMPT, "q" * PROMPT]
    for prompt in prompts:
        lone.record(Pick(lone.replicas[1], MISS, block_hashes(prompt, BLOCK), 0.0))
    first = prompts[0] + " and a question"
    assert not prefix_of(lone).index.holds(block_hashes(first, BLOCK)[0])  # forgotten by the index
    # Wherever its key alone would put it, it goes back to r1 while r1 is not
    # busier than half its prefill...
    picks = {lone.pick(first).replica.replica_id for _ in range(3)}  # type: ignore[union-attr]
    assert picks == {"r1"}
    lone.replicas[1].pending_prefill = 0.4 * PROMPT / 4
    assert lone.pick(first).replica.replica_id == "r1"  # type: ignore[union-attr]
    # ...and by load when it is.
    lone.replicas[1].pending_prefill = 0.6 * PROMPT / 4
    assert lone.pick(first).replica.replica_id != "r1"  # type: ignore[union-attr]


def _serial_pair(now: list[float]) -> ModelRouter:
    """A lone gateway's router over two serial replicas, on the clock ``now[0]``."""
    lone = router(["a", "b"], lone=True, clock=lambda: now[0])
    lone.replicas[:] = [serial("a"), serial("b")]
    prefix_of(lone)._sync_index()
    return lone


def _answered(lone: ModelRouter, now: list[float], prompt: str, seconds: float, outcome: str,
              *, streamed: bool) -> Prefill:  # fmt: skip
    """``prompt`` routed as ``outcome``, its turn taken and its answer started ``seconds`` later."""
    pick = lone.pick(prompt)
    assert pick is not None and pick.outcome == outcome
    prefill = Prefill(lone, pick)
    prefill.turn_taken()
    now[0] += seconds
    prefill.started(streamed=streamed)
    return prefill


def serial(name: str, kv: int = 32768) -> Replica:
    """A replica whose engine computes one request at a time (llama_cpp.server)."""
    dialect = wire.EngineDialect(concurrent=False)
    return Replica(wire.Endpoint(replica_id=name, url=f"http://{name}", kv_capacity_tokens=kv,
                                 dialect=dialect))  # fmt: skip


@pytest.mark.parametrize("lone", [False, True])
async def test_a_serial_engine_keeps_a_group_whose_first_prompt_it_is_computing(
    lone: bool,
) -> None:
    # As test_a_groups_second_prompt_during_the_firsts_prefill_goes_to_its_holder,
    # on engines that compute one request at a time: the second prompt would
    # compute the whole prefix again elsewhere, and leave a copy evicting
    # another prefix from that engine's few cached states. It waits for the
    # first one's turn instead, and finds the prefix then.
    prefix = router(["a", "b", "c"], lone=lone)
    prefix.replicas[:] = [serial(name) for name in ("a", "b", "c")]
    prefix_of(prefix)._sync_index()
    first, second = await second_while_first_prefills(prefix)
    assert second is not None and second.outcome == HIT
    assert second.replica is first.replica
    assert second.uncached_tokens < first.uncached_tokens


def test_a_serial_holder_keeps_what_a_detour_would_compute_twice() -> None:
    # test_a_holder_keeps_what_a_detour_would_compute_twice with copy_cost 0:
    # for a serial holder the copy is always counted.
    holder, idle = serial("holder"), serial("idle")
    held = {"holder": 64}
    holder.pending_prefill = 350.0
    assert Policy(copy_cost=0.0).choose([holder, idle], held) == (holder, HIT, 0.0)
    holder.pending_prefill = 600.0
    assert Policy(copy_cost=0.0).choose([holder, idle], held)[:2] == (idle, OVERLOADED)


def test_the_index_counts_the_prefixes_each_replica_is_home_to() -> None:
    index = PrefixIndex()
    index.sync({"a": 1000, "b": 1000})
    prompts = [f"{n}" * PROMPT for n in range(3)]
    for prompt in prompts:
        index.record("a", block_hashes(prompt, BLOCK))
    index.record("a", block_hashes(prompts[0] + " again", BLOCK))  # the same first block
    assert (index.homed("a"), index.homed("b")) == (3, 0)
    index.record("b", block_hashes(prompts[1], BLOCK))  # last recorded elsewhere: moves
    assert (index.homed("a"), index.homed("b")) == (2, 1)


def test_a_lone_gateway_spreads_new_prefixes_over_serial_engines_by_how_many_each_serves() -> None:
    # Such an engine keeps a few whole prompt states: six groups on two
    # engines hit most often three and three, whatever the hashes say
    # (bench/routing_real_replay.py: splits of 4 and 2 on 5 of 12 seeds
    # before, each costing hits and queueing on the engine with four).
    lone = router(["a", "b"], lone=True)
    lone.replicas[:] = [serial("a"), serial("b")]
    prefix_of(lone)._sync_index()
    homes = []
    for group in range(6):
        pick = lone.pick(f"group {group} " + "x" * PROMPT)
        assert pick is not None and pick.outcome == MISS
        lone.record(pick)
        homes.append(pick.replica.replica_id)
    assert sorted(homes) == ["a", "a", "a", "b", "b", "b"]
    # Not at any price: the engine home to fewer prefixes is skipped while
    # its queue exceeds the other's by more than this prompt's own prefill.
    index = prefix_of(lone).index
    more, fewer = lone.replicas
    more.pending_prefill = 0.0
    lone.record(Pick(more, MISS, block_hashes("group 6 " + "x" * PROMPT, BLOCK), 0.0))
    assert index.homed(more.replica_id) == index.homed(fewer.replica_id) + 1
    fewer.pending_prefill = 1.5 * PROMPT / 4
    pick = lone.pick("group 7 " + "x" * PROMPT)
    assert pick is not None and pick.replica is more
    # A group it serves stays there.
    fewer.pending_prefill = 0.0
    again = lone.pick("group 0 " + "x" * PROMPT + " and a question")
    assert again is not None and again.outcome == HIT
    assert again.replica.replica_id == homes[0]
