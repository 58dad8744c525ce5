"""What a prompt looks like to a KV cache: canonical text, chained block hashes, an index.

An engine reuses the KV cache of the longest prefix it has already seen, so
the gateway wants to send a prompt to the replica that most likely still holds
its beginning. It has no tokenizer and no view into the engines' caches, so it
approximates (the approach of SGLang's router, AIBrix and production-stack):

* the request is rendered to one canonical string (chat messages as role and
  flattened content, in order), so two requests that share a conversation
  start share a string prefix;
* the string is cut into fixed-size character blocks, and each block's hash
  is chained to the previous one's, so a hit on block *i* implies the whole
  prefix up to *i* matched (no per-block comparison of what came before);
* every routing decision is recorded in a per-replica LRU of block hashes,
  sized from the replica's KV capacity, so the index forgets roughly when the
  engine would have evicted.

The chain uses Python's ``hash``: it is process-local (randomised per
process), which is fine for an index that never leaves the process and is
much cheaper than a cryptographic hash. What must agree *between* gateway
processes (the rendezvous key of a new prefix) uses :func:`stable_key`.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from typing import Any

_SEPARATOR = "\x1e"  # record separator: cannot be confused with message text in practice


def _flatten_content(content: Any) -> str:
    """A message's content as text: parts flattened, non-text parts by reference.

    An image part contributes its URL (or data URL): two requests with the
    same image share a prefix, which is what the engine's cache sees too.
    """
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces: list[str] = []
        for part in content:
            if isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str):
                    pieces.append(text)
                    continue
                for value in part.values():
                    if isinstance(value, dict):
                        url = value.get("url") or value.get("data")
                        if isinstance(url, str):
                            pieces.append(url)
            elif isinstance(part, str):
                pieces.append(part)
        return "".join(pieces)
    if content is None:
        return ""
    return str(content)


def render_chat(messages: Any) -> str | None:
    """Canonical text of a chat request's messages, or None if they are unusable."""
    if not isinstance(messages, list) or not messages:
        return None
    out: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        role = message.get("role")
        content = message.get("content")
        # Once per message of every prefix-routed chat request: text content
        # (the usual) without a call, the four pieces in one extend.
        out += (
            role if isinstance(role, str) else "",
            "\n",
            content if isinstance(content, str) else _flatten_content(content),
            _SEPARATOR,
        )
    return "".join(out)


def render_completion(prompt: Any) -> str | None:
    """Canonical text of a completions prompt (a string, strings, or token ids)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        # A batch of prompts is routed by its first one; token-id prompts are
        # rendered as their ids so shared id prefixes are shared text prefixes.
        if isinstance(first, str):
            return first
        if isinstance(first, int):
            return ",".join(str(t) for t in prompt)
        if isinstance(first, list):
            return ",".join(str(t) for t in first)
    return None


def block_hashes(text: str, block_chars: int) -> list[int]:
    """Chained hashes of ``text`` cut in blocks of ``block_chars`` (last may be partial)."""
    hashes: list[int] = []
    previous = 0
    for start in range(0, len(text), block_chars):
        previous = hash((previous, text[start : start + block_chars]))
        hashes.append(previous)
    return hashes


def first_block_hash(text: str, block_chars: int) -> int:
    """``block_hashes(text, block_chars)[0]`` alone (text not empty), without the rest."""
    return hash((0, text[:block_chars]))


def stable_key(text: str, block_chars: int) -> int:
    """A key of the first block that every gateway process computes alike.

    CRC-32 rather than a cryptographic hash: it only has to be stable across
    processes (the rendezvous mixes it well afterwards), and it is the
    cheapest stable hash in the standard library.
    """
    return zlib.crc32(text[:block_chars].encode("utf-8"))


# First blocks whose last replica is remembered beyond the index's capacity.
HOMES = 65_536


class PrefixIndex:
    """Which replicas were sent which block hashes, bounded per replica.

    ``_owners`` answers the routing question (block -> replicas) in one dict
    lookup per block; the per-replica ``OrderedDict`` is the LRU that bounds
    memory to roughly the replicas' KV capacity and keeps ``_owners`` in step.
    """

    def __init__(self) -> None:
        self._owners: dict[int, dict[str, None]] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}
        # The replica each first block was last recorded on, kept after the
        # LRU forgets the block (bounded by HOMES): the index's capacity is an
        # estimate, and an engine often still holds a prefix it forgot.
        self._homes: OrderedDict[int, str] = OrderedDict()
        # How many remembered first blocks each replica is home to: how many
        # distinct prefixes it was given, what new ones are spread by on
        # engines that keep only a few (SoonestStart.place_new).
        self._homed: dict[str, int] = {}

    def home(self, first_block: int) -> str | None:
        """The replica a prompt with this first block was last recorded on, if remembered."""
        return self._homes.get(first_block)

    def homed(self, replica_id: str) -> int:
        """How many remembered first blocks were last recorded on ``replica_id``."""
        return self._homed.get(replica_id, 0)

    def sync(self, capacities: dict[str, int]) -> None:
        """Track exactly these replicas with these capacities (in blocks)."""
        for replica_id in list(self._lru):
            if replica_id not in capacities:
                self._forget(replica_id)
        for replica_id, capacity in capacities.items():
            self._lru.setdefault(replica_id, OrderedDict())
            self._capacity[replica_id] = max(1, capacity)
            self._evict(replica_id)

    def matches(self, hashes: list[int], allowed: dict[str, Any]) -> dict[str, int]:
        """Blocks of ``hashes`` each replica among ``allowed`` holds, from the first on.

        Replicas holding none are absent. Every holder counts, not only the
        longest: one holding the system prompt but not this question still
        saves most of the prefill.
        """
        found: dict[str, int] = {}
        if not hashes:
            return found
        owners = self._owners.get(hashes[0])
        if not owners:
            return found
        alive = [r for r in owners if r in allowed]
        depth = 1
        for block in hashes[1:]:
            if not alive:
                break
            owners = self._owners.get(block)
            if not owners:
                break
            still: list[str] = []
            for replica_id in alive:
                if replica_id in owners:
                    still.append(replica_id)
                else:
                    found[replica_id] = depth
            alive = still
            depth += 1
        for replica_id in alive:
            found[replica_id] = depth
        return found

    def holds(self, block: int) -> bool:
        """Whether any replica was sent ``block`` (a prompt's first block: is it new?)."""
        return block in self._owners

    def depth(self, hashes: list[int], replica_id: str) -> int:
        """How many blocks of ``hashes`` ``replica_id`` holds from the first on."""
        owners = self._owners
        depth = 0
        for block in hashes:
            holders = owners.get(block)
            if holders is None or replica_id not in holders:
                break
            depth += 1
        return depth

    def record(self, replica_id: str, hashes: list[int]) -> None:
        lru = self._lru.get(replica_id)
        if lru is None:
            return
        owners = self._owners
        # Newest-last, and the prompt's first block touched last: the LRU then
        # evicts a prefix from its end, so what remains is still a prefix and
        # the chained lookup keeps working after eviction.
        for block in reversed(hashes):
            if block in lru:
                lru.move_to_end(block)
            else:
                lru[block] = None
                holders = owners.get(block)
                if holders is None:
                    owners[block] = {replica_id: None}
                else:
                    holders[replica_id] = None
        if len(lru) > self._capacity[replica_id]:
            self._evict(replica_id)
        homes = self._homes
        first = hashes[0]
        before = homes.get(first)
        if before == replica_id:
            homes.move_to_end(first)
            return
        homed = self._homed
        if before is not None:
            homed[before] -= 1
        homed[replica_id] = homed.get(replica_id, 0) + 1
        homes[first] = replica_id
        homes.move_to_end(first)
        if len(homes) > HOMES:
            _, gone = homes.popitem(last=False)
            homed[gone] -= 1

    def blocks(self, replica_id: str) -> int:
        return len(self._lru.get(replica_id, ()))

    def _evict(self, replica_id: str) -> None:
        lru = self._lru[replica_id]
        capacity = self._capacity[replica_id]
        while len(lru) > capacity:
            block, _ = lru.popitem(last=False)
            self._disown(block, replica_id)

    def _forget(self, replica_id: str) -> None:
        for block in self._lru.pop(replica_id):
            self._disown(block, replica_id)
        self._capacity.pop(replica_id, None)

    def _disown(self, block: int, replica_id: str) -> None:
        holders = self._owners.get(block)
        if holders is not None:
            holders.pop(replica_id, None)
            if not holders:
                del self._owners[block]
