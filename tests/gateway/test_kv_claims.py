"""Routing on exact cache state between a send and its events, and for prefixes held nowhere.

The engine publishes a prompt's blocks once it computed them: until then
its events read as if nobody held the prefix, and the prefix index's word
(recorded at the send) stands for the replica computing it
(Replica.claims). A prefix the events say is held nowhere -- new, or back
after an eviction -- goes home within a whole prefill's wait, as the
estimate's holder rule would keep it there, and a new one to the replica
home to the fewest prefixes (bench/routing_real.py --engine vllm).
"""

from __future__ import annotations

import asyncio

from llmgw import wire
from llmgw.gateway.routing.kvcache import ExactCache
from llmgw.gateway.routing.measured import PrefillSpeed
from llmgw.gateway.routing.policy import HIT, MISS, Pick
from llmgw.gateway.routing.prefill import CLAIM_AFTER_START_S, Prefill
from llmgw.gateway.routing.prefixindex import PrefixIndex
from llmgw.gateway.routing.replica import CLAIM_UNANSWERED_S, CLAIMS_KEPT, Replica
from llmgw.gateway.routing.router import ModelRouter

PROMPT = "tenant seven's record: " + "x" * 233  # 256 characters: 64 tokens at 4 a token
TOKENS = list(range(64))


def _router(now: list[float]) -> ModelRouter:
    route = wire.ModelRoute(name="m", served_name="m")
    replicas = [
        Replica(wire.Endpoint(replica_id=n, url=f"http://{n}",
                              kv_events=wire.kv_events_url(f"http://{n}")))
        for n in ("a", "b")
    ]  # fmt: skip
    router = ModelRouter(route, replicas, PrefixIndex(), PrefillSpeed(1000.0, 4.0),
                         block_chars=16, chars_per_token=4.0, tokens_per_unit=2048.0,
                         ttft_slack_s=0.05, wait_ratio=0.5, spread=4.0, gateways=1,
                         clock=lambda: now[0])  # fmt: skip
    for replica in replicas:
        replica.exact = ExactCache()
        replica.exact.apply([])  # followed, holding nothing
    return router


def _pick(router: ModelRouter, prompt: str = PROMPT) -> Pick:
    pick = router.pick(prompt, tokens=TOKENS)
    assert pick is not None
    return pick


async def test_a_prompt_in_prefill_is_held_where_it_is_computed_until_its_events_can_tell() -> None:
    now = [100.0]
    router = _router(now)
    first = _pick(router)
    assert first.outcome == MISS
    prefill = Prefill(router, first)
    await asyncio.sleep(0)  # recorded on the loop's next turn
    holder = first.replica
    # Its events say nothing yet; the second prompt of the group still goes
    # to the replica computing the prefix, as a hit.
    second = _pick(router)
    assert second.replica is holder and second.outcome == HIT
    now[0] += 0.5
    prefill.started(streamed=True)
    now[0] += CLAIM_AFTER_START_S - 0.1
    assert _pick(router).outcome == HIT  # the events may still be on their way
    now[0] += 0.2
    # Past that the events rule: they never showed it, so nobody holds it (it
    # still goes home: the replica it was sent to).
    late = _pick(router)
    assert late.outcome == MISS and late.replica is holder


async def test_a_send_that_failed_claims_nothing() -> None:
    now = [100.0]
    router = _router(now)
    first = _pick(router)
    prefill = Prefill(router, first)
    await asyncio.sleep(0)
    assert first.replica.claims
    prefill.done()  # never answered
    assert not first.replica.claims
    assert _pick(router).outcome == MISS


async def test_a_full_hit_that_failed_drops_its_claim() -> None:
    now = [100.0]
    router = _router(now)
    first = _pick(router)
    Prefill(router, first).started(streamed=True)
    await asyncio.sleep(0)
    again = _pick(router)  # within the claim: a full hit, no prefill charged
    assert again.outcome == HIT and not again.uncached_tokens
    prefill = Prefill(router, again)
    await asyncio.sleep(0)
    prefill.done()  # never answered
    prefill.done()  # the relay's second call is a no-op
    assert not again.replica.claims
    assert _pick(router).outcome == MISS  # the events (which show nothing) rule


async def test_an_answered_send_keeps_its_claim_past_its_end() -> None:
    now = [100.0]
    router = _router(now)
    prefill = Prefill(router, first := _pick(router))
    await asyncio.sleep(0)
    prefill.started(streamed=True)
    prefill.done()
    assert first.replica.claims  # until a second past its start
    assert _pick(router).outcome == HIT


async def test_a_claim_never_answered_ends_on_its_own() -> None:
    now = [100.0]
    router = _router(now)
    first = _pick(router)
    Prefill(router, first)  # sent; neither answered nor ended, as if its end were lost
    await asyncio.sleep(0)
    now[0] += CLAIM_UNANSWERED_S - 1.0
    assert _pick(router).outcome == HIT
    now[0] += 2.0
    assert _pick(router).outcome == MISS


def test_a_replica_keeps_a_bounded_number_of_claims() -> None:
    replica = _router([0.0]).replicas[0]
    for block in range(CLAIMS_KEPT):
        replica.claim(block, 1.0, 0.0)  # ended at 1.0
    replica.claim(-1, 60.0, 5.0)  # past the bound at 5.0: the ended ones go
    assert replica.claims == {-1: 65.0}
    for block in range(CLAIMS_KEPT + 10):
        replica.claim(block, 60.0, 5.0)  # all in prefill: the oldest go
    assert len(replica.claims) == CLAIMS_KEPT
    assert -1 not in replica.claims


def test_an_evicted_prefix_goes_home_within_a_whole_prefill() -> None:
    now = [100.0]
    router = _router(now)
    home = _pick(router)
    router.record(home)  # sent there once, answered long ago, evicted since
    home.replica.claims.clear()
    other = next(r for r in router.replicas if r is not home.replica)
    tokens = len(PROMPT) / 4.0
    home.replica.pending_prefill = 0.8 * tokens  # the estimate's wait_ratio is 0.5
    back = _pick(router)
    assert back.replica is home.replica and back.outcome == MISS
    home.replica.pending_prefill = 1.2 * tokens
    assert _pick(router).replica is other


def test_a_new_prefix_goes_to_the_replica_home_to_the_fewest() -> None:
    now = [100.0]
    router = _router(now)
    crowded, spare = router.replicas
    for n in range(2):
        pick = _pick(router, f"another tenant {n}: " + "y" * 240)
        pick.replica = crowded
        router.record(pick)
    crowded.claims.clear()
    # Each of these would go by hash alone; every one lands on the spare replica.
    landed = {_pick(router, f"new tenant {n}: " + "z" * 240).replica for n in range(6)}
    assert landed == {spare}
