"""The simulated engine's KV cache: fixed blocks, prefix caching, LRU eviction.

This is the part of an engine that prefix-aware routing exists for, so it is
modelled the way vLLM's paged cache behaves rather than as a hit-rate knob:

- The cache holds ``capacity`` blocks of ``block_tokens`` tokens each.
- A full prompt block is known by its chained hash (see
  :func:`llmgw.sim.tokens.block_hashes`); a request whose leading block hashes
  are cached reuses those blocks and computes only the rest.
- A block referenced by a running request is pinned. When a request ends, its
  blocks stay cached but become evictable, and are evicted least recently
  used first when a new request needs room. A request's blocks are queued for
  eviction tail first, so a shared system prompt outlives the questions that
  followed it.
- Blocks being computed, and the room for the answer, are held without a hash
  ("anonymous") and are never hit; a prompt's blocks get their hashes when its
  prefill completes (two concurrent cold requests for one prefix both compute it,
  as in vLLM).

Usage, as vLLM reports it, is the fraction of blocks pinned by running
requests; cached-but-unreferenced blocks count as free because they can be
reclaimed at once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from llmgw.errors import ValidationError


@dataclass
class Allocation:
    """The blocks one request holds, returned to the cache by ``release``."""

    hit_blocks: int
    hashed: list[bytes] = field(default_factory=list)
    anonymous: int = 0


class KVCache:
    def __init__(self, capacity_blocks: int, block_tokens: int) -> None:
        if capacity_blocks < 1:
            raise ValidationError(f"kv_blocks must be >= 1, got {capacity_blocks}")
        if block_tokens < 1:
            raise ValidationError(f"block_tokens must be >= 1, got {block_tokens}")
        self.capacity = capacity_blocks
        self.block_tokens = block_tokens
        self._refs: dict[bytes, int] = {}
        # Unreferenced cached blocks, least recently released first.
        self._evictable: OrderedDict[bytes, None] = OrderedDict()
        self._anonymous = 0
        self.evictions = 0

    # -- sizes --------------------------------------------------------------

    @property
    def used_blocks(self) -> int:
        """Blocks pinned by running requests (hashed or not)."""
        return len(self._refs) + self._anonymous

    @property
    def cached_blocks(self) -> int:
        """Blocks that hold a prefix nobody is using: reusable or evictable."""
        return len(self._evictable)

    @property
    def free_blocks(self) -> int:
        """Blocks holding nothing at all."""
        return self.capacity - self.used_blocks - self.cached_blocks

    @property
    def usage(self) -> float:
        return self.used_blocks / self.capacity

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._refs or block_hash in self._evictable

    # -- operations ---------------------------------------------------------

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` are cached (no side effect)."""
        n = 0
        for h in hashes:
            if h not in self._refs and h not in self._evictable:
                break
            n += 1
        return n

    def allocate(
        self, hashes: Sequence[bytes], total_blocks: int, max_hit: int | None = None
    ) -> Allocation | None:
        """Pin the cached prefix of ``hashes`` and reserve the rest of ``total_blocks``.

        Returns None, changing nothing, when the blocks cannot be found even by
        evicting every unreferenced block: the request must wait for running
        ones to finish. ``max_hit`` caps the reuse (an engine always computes
        at least the last prompt token to produce the first output token).
        """
        if total_blocks < len(hashes):
            raise ValidationError(
                f"total_blocks ({total_blocks}) is less than the prompt's {len(hashes)} blocks"
            )
        candidates = hashes if max_hit is None else hashes[: max(0, max_hit)]
        hit = self.match(candidates)
        need = total_blocks - hit
        # Hits that sit in the evictable pool stop being reclaimable once pinned.
        revived = sum(1 for h in hashes[:hit] if h not in self._refs)
        if need > self.capacity - self.used_blocks - revived:
            return None
        for h in hashes[:hit]:
            self._pin(h)
        while self.free_blocks < need:
            self._evictable.popitem(last=False)
            self.evictions += 1
        self._anonymous += need
        return Allocation(hit_blocks=hit, hashed=list(hashes[:hit]), anonymous=need)

    def commit(self, alloc: Allocation, hashes: Sequence[bytes]) -> None:
        """Give the request's freshly computed prompt blocks their hashes.

        Each computed block turns one anonymous block into a cached one. If
        another request cached the same block meanwhile, that copy is shared
        and ours is freed, so a prefix is never stored twice.
        """
        for h in hashes[len(alloc.hashed) :]:
            if alloc.anonymous == 0:
                break
            alloc.anonymous -= 1
            self._anonymous -= 1
            self._pin(h)
            alloc.hashed.append(h)

    def release(self, alloc: Allocation) -> None:
        """Unpin everything ``alloc`` holds; its hashed blocks stay cached."""
        # Tail first into the LRU queue, so the tail is evicted before the head.
        for h in reversed(alloc.hashed):
            count = self._refs[h] - 1
            if count:
                self._refs[h] = count
            else:
                del self._refs[h]
                self._evictable[h] = None
        self._anonymous -= alloc.anonymous
        alloc.hashed = []
        alloc.anonymous = 0

    def _pin(self, h: bytes) -> None:
        if h in self._refs:
            self._refs[h] += 1
        else:
            self._evictable.pop(h, None)
            self._refs[h] = 1
