"""The KV cache model: prefix hits, chained hashes, LRU eviction, capacity, pinning."""

from __future__ import annotations

import pytest

from llmgw.errors import ValidationError
from llmgw.sim import tokens
from llmgw.sim.kv import KVCache

BLOCK = 4  # tokens per block: 16 bytes


def words(*ws: str) -> bytes:
    """Each 3-letter word is one token, so four words are one block."""
    return "".join(w + " " for w in ws).encode()


def hashes(data: bytes) -> list[bytes]:
    return tokens.block_hashes(data, BLOCK)


def prompt(*blocks: str) -> bytes:
    """A prompt of whole blocks, each block named by one repeated word."""
    return b"".join(words(b, b, b, b) for b in blocks)


def run(kv: KVCache, data: bytes, total: int | None = None) -> int:
    """One request start to finish; returns the blocks it found cached."""
    hs = hashes(data)
    alloc = kv.allocate(hs, total or len(hs))
    assert alloc is not None
    kv.commit(alloc, hs)
    kv.release(alloc)
    return alloc.hit_blocks


def test_chained_hashes_depend_on_everything_before() -> None:
    a = hashes(prompt("aaa", "bbb", "ccc"))
    b = hashes(prompt("zzz", "bbb", "ccc"))
    assert len(a) == 3
    # Same second block, different first block: no shared hash anywhere.
    assert not set(a) & set(b)
    # Same prefix: same leading hashes, then divergence.
    c = hashes(prompt("aaa", "bbb", "xxx"))
    assert c[:2] == a[:2] and c[2] != a[2]


def test_partial_block_gets_no_hash() -> None:
    assert len(hashes(prompt("aaa") + words("bbb"))) == 1


def test_second_request_hits_shared_prefix_only() -> None:
    kv = KVCache(capacity_blocks=16, block_tokens=BLOCK)
    assert run(kv, prompt("sys", "sy2", "qa1")) == 0
    assert run(kv, prompt("sys", "sy2", "qb1")) == 2
    assert run(kv, prompt("sys", "sy2", "qa1")) == 3
    assert run(kv, prompt("oth", "sy2", "qa1")) == 0


def test_max_hit_caps_reuse() -> None:
    kv = KVCache(capacity_blocks=16, block_tokens=BLOCK)
    run(kv, prompt("aaa", "bbb"))
    hs = hashes(prompt("aaa", "bbb"))
    alloc = kv.allocate(hs, 2, max_hit=1)
    assert alloc is not None and alloc.hit_blocks == 1


def test_blocks_are_cached_only_after_commit() -> None:
    kv = KVCache(capacity_blocks=16, block_tokens=BLOCK)
    hs = hashes(prompt("aaa", "bbb"))
    first = kv.allocate(hs, 2)
    assert first is not None
    # A concurrent request for the same prefix while the first is still computing.
    second = kv.allocate(hs, 2)
    assert second is not None and second.hit_blocks == 0
    assert kv.used_blocks == 4
    kv.commit(first, hs)
    kv.commit(second, hs)
    # The duplicate copy was freed: the prefix is stored once, pinned twice.
    assert kv.used_blocks == 2
    kv.release(first)
    kv.release(second)
    assert kv.used_blocks == 0 and kv.cached_blocks == 2


def test_lru_evicts_least_recently_released_and_tail_first() -> None:
    kv = KVCache(capacity_blocks=4, block_tokens=BLOCK)
    run(kv, prompt("aaa", "bbb"))  # cached: a-tail (b) then a-head (a)
    run(kv, prompt("ccc", "ddd"))  # cache full: 4 cached blocks
    assert kv.cached_blocks == 4 and kv.free_blocks == 0
    # One new block evicts exactly one: the tail of the oldest prompt.
    run(kv, prompt("eee"))
    assert kv.evictions == 1
    assert kv.match(hashes(prompt("aaa", "bbb"))) == 1  # head kept, tail gone
    assert kv.match(hashes(prompt("ccc", "ddd"))) == 2
    # Touching ccc/ddd makes aaa the oldest, so it goes next.
    run(kv, prompt("ccc", "ddd"))
    run(kv, prompt("fff"))
    assert kv.match(hashes(prompt("aaa"))) == 0
    assert kv.match(hashes(prompt("ccc", "ddd"))) == 2


def test_pinned_blocks_are_never_evicted_and_capacity_holds() -> None:
    kv = KVCache(capacity_blocks=4, block_tokens=BLOCK)
    hs = hashes(prompt("aaa", "bbb"))
    held = kv.allocate(hs, 3)  # prompt plus one block for the answer
    assert held is not None
    kv.commit(held, hs)
    assert kv.used_blocks == 3 and kv.usage == pytest.approx(0.75)
    # Two more blocks do not fit beside three pinned ones: refused, nothing changed.
    other = hashes(prompt("ccc", "ddd"))
    assert kv.allocate(other, 2) is None
    assert kv.match(hs) == 2 and kv.evictions == 0
    # One block fits.
    small_hashes = hashes(prompt("eee"))
    small = kv.allocate(small_hashes, 1)
    assert small is not None
    kv.commit(small, small_hashes)
    assert kv.used_blocks == 4 and kv.free_blocks == 0
    kv.release(small)
    kv.release(held)
    assert kv.used_blocks == 0 and kv.cached_blocks == 3
    # Now the request fits by evicting unreferenced blocks.
    assert kv.allocate(other, 4) is not None
    assert kv.used_blocks == 4 and kv.evictions == 3


def test_hit_on_evictable_blocks_counts_them_when_sizing() -> None:
    kv = KVCache(capacity_blocks=4, block_tokens=BLOCK)
    run(kv, prompt("aaa", "bbb", "ccc", "ddd"))
    hs = hashes(prompt("aaa", "bbb", "ccc", "ddd"))
    # 4 hit + 1 new block = 5 > 4: must be refused even though 4 blocks are "free".
    assert kv.allocate(hs, 5) is None
    alloc = kv.allocate(hs, 4)
    assert alloc is not None and alloc.hit_blocks == 4 and alloc.anonymous == 0


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValidationError, match="kv_blocks"):
        KVCache(0, 16)
    with pytest.raises(ValidationError, match="block_tokens"):
        KVCache(16, 0)
    kv = KVCache(16, BLOCK)
    with pytest.raises(ValidationError, match="total_blocks"):
        kv.allocate(hashes(prompt("aaa", "bbb")), 1)
