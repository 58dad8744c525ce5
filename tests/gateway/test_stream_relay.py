"""StreamRelay looks only at the events from the first usage or [DONE] mark on.

The events before it are passed as they are when the block is plainly
separated; the answer must be what looking at every event of the whole
block gives (the reference below: StreamRelay._take_events before the change).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from llmgw.gateway.routes.sse import StreamRelay

EVENTS = [
    b'data: {"choices":[{"delta":{"content":"x"},"finish_reason":null}]}',
    b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}',
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}',
    b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}',
    b'data: {"choices":[{"delta":{}}],"usage":{"prompt_tokens":1,"completion_tokens":1}}',
    b"data: [DONE]",
    b"data:[DONE]",
    b": keep-alive",
    b"data: [DONE] and more",
]
SEPARATORS = [b"\n\n", b"\n\n", b"\n\n", b"\r\n\r\n", b"\n\r\n", b"\n\n\n", b"\n\n\n\n", b"\n"]


class _Reference(StreamRelay):
    def _take_events(self, block: bytes) -> bytes:
        return self._kept_events(block)  # every event looked at, as before


def _state(relay: StreamRelay) -> tuple[object, ...]:
    return (relay.usage, relay.done, relay.finished, relay.events, relay.flush())


def relayed_as_the_reference(seed: int, make_block: Callable[[random.Random], bytes]) -> None:
    """3,000 relays (usage stripped or not, [DONE] held or not), each fed one to three
    blocks from ``make_block``: each block answered, and the relay left, as the reference's."""
    rng = random.Random(seed)
    for _ in range(3000):
        strip, hold = rng.random() < 0.5, rng.random() < 0.3
        new, old = StreamRelay(strip, hold_done=hold), _Reference(strip, hold_done=hold)
        for _ in range(rng.randrange(1, 4)):
            block = make_block(rng)
            assert new.feed(block) == old.feed(block), block
        assert _state(new) == _state(old)


def test_a_block_is_relayed_as_splitting_and_joining_it_gives() -> None:
    def any_block(rng: random.Random) -> bytes:
        parts = [rng.choice(SEPARATORS) if rng.random() < 0.1 else b""]
        for _ in range(rng.randrange(1, 9)):
            parts += [rng.choice(EVENTS), rng.choice(SEPARATORS)]
        return b"".join(parts)

    relayed_as_the_reference(16, any_block)


def test_an_engines_last_read_is_relayed_as_looking_at_each_event_gives() -> None:
    # Blocks as engines write them (one blank line apart, [DONE] last if at
    # all): the usual end of a stream is taken without splitting the block.
    def engine_block(rng: random.Random) -> bytes:
        events = [rng.choice(EVENTS[:2] * 3 + EVENTS) for _ in range(rng.randrange(1, 5))]
        if rng.random() < 0.5:
            events.append(b"data: [DONE]")
        return b"\n\n".join(events) + b"\n\n"

    relayed_as_the_reference(17, engine_block)
