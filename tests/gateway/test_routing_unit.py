"""Prompt rendering, chained block hashes, the bounded index, and the policies alone."""

from __future__ import annotations

from llmgw import wire
from llmgw.gateway.prefix import (
    PrefixIndex,
    block_hashes,
    render_chat,
    render_completion,
    stable_key,
)
from llmgw.gateway.routing import (
    HIT,
    MISS,
    OVERLOADED,
    ModelRouter,
    Replica,
    least_loaded,
    prefix_choice,
    rendezvous,
)


def replica(name: str, kv: int = 32768) -> Replica:
    return Replica(wire.Endpoint(replica_id=name, url=f"http://{name}", kv_capacity_tokens=kv))


def router(
    names: list[str], policy: wire.RoutingPolicy = "prefix", kv: int = 32768, **kw: float
) -> ModelRouter:
    route = wire.ModelRoute(name="m", served_name="m", routing=policy)
    return ModelRouter(
        route,
        [replica(n, kv) for n in names],
        PrefixIndex(),
        block_chars=int(kw.get("block_chars", 16)),
        chars_per_token=4.0,
        threshold=kw.get("threshold", 2.0),
        tokens_per_unit=2048.0,
        miss_slack=kw.get("miss_slack", 1.0),
    )


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
    assert index.longest(long_prompt, allowed) == (3, ["r2"])
    assert index.longest(long_prompt[:1], allowed)[0] == 1
    assert sorted(index.longest(long_prompt[:1], allowed)[1]) == ["r1", "r2"]
    assert index.longest(long_prompt, {"r1": 1}) == (1, ["r1"])
    # r1 holds at most 4 blocks: older prompts fall out, their prefixes with them.
    for n in range(10):
        index.record("r1", block_hashes(f"{n:016d}", 16))
    assert index.blocks("r1") == 4
    assert index.longest(long_prompt, {"r1": 1}) == (0, [])
    # A replica that leaves the config leaves the index.
    index.sync({"r1": 4})
    assert index.longest(long_prompt, allowed) == (0, [])


def test_lru_evicts_a_prefix_from_its_end() -> None:
    index = PrefixIndex()
    index.sync({"r": 3})
    hashes = block_hashes("x" * 16 * 4, 16)  # 4 blocks, capacity 3
    index.record("r", hashes)
    assert index.longest(hashes, {"r": 1}) == (3, ["r"])


def test_policies() -> None:
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
    # Prefix: a holder within the threshold wins; beyond it, the least loaded.
    assert prefix_choice([a, b, c], [b], key, 2.0, 2048.0, 1.0) == (b, HIT)
    assert prefix_choice([a, b, c], [a], key, 2.0, 2048.0, 1.0)[1] == OVERLOADED
    assert prefix_choice([a, b, c], [a], key, 10.0, 2048.0, 1.0) == (a, HIT)
    # New prefixes never go to a replica above the miss slack, even one that
    # a holder could be at (inside the affinity threshold).
    a.in_flight = 3
    for k in range(50):
        picked, outcome = prefix_choice([a, b, c], [], k, 10.0, 2048.0, 1.0)
        assert outcome == MISS and picked is not a
    # ...and spread by the hash among those that are not.
    assert {prefix_choice([a, b, c], [], k, 10.0, 2048.0, 1.0)[0] for k in range(50)} == {b, c}
    # Pending prefill counts as load.
    b.pending_prefill = 4096 * 4
    assert prefix_choice([a, b, c], [b], key, 2.0, 2048.0, 1.0)[1] == OVERLOADED
    assert prefix_choice([a, b, c], [], key, 10.0, 2048.0, 1.0)[0] is c


def test_router_policies_and_cooldown() -> None:
    rr = router(["a", "b", "c"], "round-robin")
    assert len({rr.pick("x").replica.replica_id for _ in range(3)}) == 3  # type: ignore[union-attr]
    ll = router(["a", "b"], "least-loaded")
    ll.replicas[0].in_flight = 3
    assert ll.pick("x").replica.replica_id == "b"  # type: ignore[union-attr]
    prefix = router(["a", "b", "c"])
    first = prefix.pick("s" * 64 + "question one")
    again = prefix.pick("s" * 64 + "question two")
    assert first is not None and again is not None
    assert first.outcome == MISS and again.outcome == HIT
    assert again.replica is first.replica
    assert again.uncached_tokens < first.uncached_tokens
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
