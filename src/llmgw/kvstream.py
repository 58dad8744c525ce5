"""The KV-cache events stream: what an engine guard relays and a gateway reads.

vLLM publishes its KV-cache events on a ZeroMQ PUB socket with no key.
That socket stays on its node (agent.kvrelay), and the replica's engine
guard relays the events over the replica's own advertised address, behind
the engine key and the node's TLS like every other route of the engine:
``GET /llmgw/kv-events`` with ``Authorization: Bearer <engine key>`` as a
connection's first request is answered by the guard itself with a streamed
HTTP/1.1 200 whose body runs until the connection closes (no length, no
chunking: the guard writes each message once for every follower).

The body is a sequence of messages, each one ZeroMQ multipart message as
the engine sent it (vLLM: topic, 8-byte big-endian sequence number,
msgpack payload)::

    message = count:u32 frame{count}
    frame   = length:u32 bytes{length}

(integers big-endian). A message of no frames is a heartbeat, sent every
:data:`HEARTBEAT_S`: an engine with nothing to report is told apart from a
connection that died without a word (a node gone off the network sends no
FIN), which a reader notices after :data:`SILENCE_S`.

Standard library only: the guard's process imports it, and its memory
counts in the engine's budget.
"""

from __future__ import annotations

import struct

# The relay's path on the replica's address: any other path is the engine's.
# (wire.routing.KV_EVENTS_PATH spells it again for the routing table, which
# imports nothing outside llmgw.wire; a test pins the two.)
PATH = "/llmgw/kv-events"
# The first request line the guard answers itself; anything else is spliced.
REQUEST_LINE = f"GET {PATH} HTTP/1.1".encode()
CONTENT_TYPE = "application/x-llmgw-kv-events"

HEARTBEAT_S = 5.0
# Several heartbeats missed: the stream is dead, whatever TCP thinks.
SILENCE_S = 4 * HEARTBEAT_S
# vLLM sends three frames; a payload is one scheduler step's events (kB to a
# few MB for long prompts). Past these the stream is not an engine's, and a
# reader that believed the length would allocate whatever it said.
MAX_FRAMES = 16
MAX_FRAME_BYTES = 64 << 20

_U32 = struct.Struct(">I")
HEARTBEAT = _U32.pack(0)

# The guard's answer head: no Content-Length, so the body ends at the close.
ANSWER_HEAD = (
    "HTTP/1.1 200 OK\r\n"
    f"Content-Type: {CONTENT_TYPE}\r\n"
    "Cache-Control: no-store\r\n"
    "Connection: close\r\n\r\n"
).encode()


class BadStream(ValueError):
    """Bytes that are not this framing: the stream cannot be resynchronised."""


def encode(frames: list[bytes]) -> bytes:
    """One message's bytes on the stream."""
    parts = [_U32.pack(len(frames))]
    for frame in frames:
        parts.append(_U32.pack(len(frame)))
        parts.append(frame)
    return b"".join(parts)


def read_u32(data: bytes) -> int:
    return int(_U32.unpack(data)[0])


def check_count(count: int) -> int:
    if count > MAX_FRAMES:
        raise BadStream(f"a message of {count} frames (at most {MAX_FRAMES})")
    return count


def check_length(length: int) -> int:
    if length > MAX_FRAME_BYTES:
        raise BadStream(f"a frame of {length} bytes (at most {MAX_FRAME_BYTES})")
    return length
