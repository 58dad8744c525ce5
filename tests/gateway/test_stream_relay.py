"""StreamRelay looks only at the events from the first usage or [DONE] mark on.

The events before it are passed as they are when the block is plainly
separated; the answer must be what splitting the whole block and joining it
back gives (the reference below: StreamRelay._take_events before the change).
"""

from __future__ import annotations

import random

from llmgw.gateway.proxy import _DONE_EVENTS, _DONE_MARK, _EVENT_SPLIT, StreamRelay, find_usage

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
        kept: list[bytes] = []
        for event in _EVENT_SPLIT.split(block):
            if not event:
                continue
            if b'"usage":{' in event or b'"usage": {' in event:
                usage = find_usage(event)
                if usage is not None:
                    self.usage = usage
                    if self._strip and (b'"choices":[]' in event or b'"choices": []' in event):
                        continue
            elif _DONE_MARK in event and event.strip() in _DONE_EVENTS:
                self.done = True
                if not self.finished or self._hold_done:
                    continue
            kept.append(event)
        return b"\n\n".join(kept) + b"\n\n" if kept else b""


def _state(relay: StreamRelay) -> tuple[object, ...]:
    return (relay.usage, relay.done, relay.finished, relay.events, relay.flush())


def test_a_block_is_relayed_as_splitting_and_joining_it_gives() -> None:
    rng = random.Random(16)
    for _ in range(3000):
        strip, hold = rng.random() < 0.5, rng.random() < 0.3
        new, old = StreamRelay(strip, hold_done=hold), _Reference(strip, hold_done=hold)
        for _ in range(rng.randrange(1, 4)):
            parts = [rng.choice(SEPARATORS) if rng.random() < 0.1 else b""]
            for _ in range(rng.randrange(1, 9)):
                parts += [rng.choice(EVENTS), rng.choice(SEPARATORS)]
            block = b"".join(parts)
            assert new.feed(block) == old.feed(block), block
        assert _state(new) == _state(old)
