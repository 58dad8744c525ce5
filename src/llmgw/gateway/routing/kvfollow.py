"""Following each replica's KV-cache events: one stream per replica that publishes.

A replica whose endpoint names an events URL (``wire.Endpoint.kv_events``:
its engine guard's relay, on the replica's own address) gets an
:class:`~.kvcache.ExactCache` and a task here that feeds it. The stream is
read as the guard writes it (llmgw.kvstream: each ZeroMQ message the engine
published, length-prefixed, and heartbeats), over a connection of its own
that sends the engine key the gateway sends that replica, under the TLS
trust the gateway gives engines (gateway.engineclient.Upstream.tls_for):
the events carry every cached prompt's token ids, so they are the engine's
like any other route. Not through the hot path's pool: a stream that lasts
for the replica's life is no request, and the pool holds answers to a
deadline.

The task never ends on bad input: a batch that does not decode is logged
and dropped; a refused key, a broken connection, a stream that is not the
framing or falls silent past kvstream.SILENCE_S is retried with backoff. A
sequence gap (the engine's PUB socket and the guard both drop what a slow
reader cannot take, and a follower misses what was sent before it
connected) or a restarted engine (its sequence starts at 0 again) clears the
cache: what was lost cannot be told, and an empty cache only under-reports,
while a stale one would send prompts to blocks long evicted. Until its
first batch a replica is routed by the estimate.

The stream lives behind :class:`Subscriber`, a Protocol, so tests feed
captured frames without a socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol
from urllib.parse import urlsplit

from llmgw import kvstream
from llmgw.gateway.routing.kvcache import BadEvent, ExactCache, decode_batch
from llmgw.gateway.routing.replica import Replica

log = logging.getLogger(__name__)

# Reconnect pacing after a failed or lost stream.
RETRY_S = (0.5, 10.0)
# Connecting and the relay's answer head, together.
CONNECT_TIMEOUT_S = 10.0
HEAD_LIMIT = 16 << 10


class Subscriber(Protocol):
    async def recv(self) -> list[bytes]:
        """The next multipart message: ``[topic, seq (8 bytes, big-endian), payload]``."""
        ...

    def close(self) -> None: ...


# (events URL, engine key) -> a subscriber reading that stream.
Connect = Callable[[str, str | None], Awaitable[Subscriber]]


class EventsRefused(Exception):
    """The relay answered something other than its stream."""


class StreamSubscriber:
    """The guard's events stream over one HTTP/1.1 connection (llmgw.kvstream)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, url: str, key: str | None, tls: ssl.SSLContext | None) -> StreamSubscriber:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise EventsRefused(f"not an http(s) URL: {url!r}")
        if (parts.scheme == "https") != (tls is not None):
            raise EventsRefused(f"{url}: https wants a TLS context, http none")
        port = parts.port or (443 if tls is not None else 80)
        auth = f"Authorization: Bearer {key}\r\n" if key else ""
        request = (f"GET {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n{auth}"
                   "Accept: */*\r\n\r\n").encode()  # fmt: skip
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            reader, writer = await asyncio.open_connection(
                parts.hostname, port, ssl=tls, limit=HEAD_LIMIT,
                server_hostname=parts.hostname if tls is not None else None,
            )  # fmt: skip
            try:
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
            except BaseException:
                writer.transport.abort()
                raise
        status = head.split(b"\r\n", 1)[0]
        if not status.startswith(b"HTTP/1.1 200 "):
            writer.transport.abort()
            hint = " (the engine key was refused)" if status.startswith(b"HTTP/1.1 401") else ""
            raise EventsRefused(f"{status.decode(errors='replace')[:80]}{hint}")
        return cls(reader, writer)

    async def recv(self) -> list[bytes]:
        reader = self._reader
        while True:
            # A heartbeat at least every kvstream.HEARTBEAT_S: silence past
            # SILENCE_S is a stream that died without a word (a node gone).
            async with asyncio.timeout(kvstream.SILENCE_S):
                count = kvstream.check_count(kvstream.read_u32(await reader.readexactly(4)))
                frames = []
                for _ in range(count):
                    size = kvstream.check_length(kvstream.read_u32(await reader.readexactly(4)))
                    frames.append(await reader.readexactly(size))
            if frames:
                return frames

    def close(self) -> None:
        self._writer.transport.abort()


def stream_connect(tls_for: Callable[[str], ssl.SSLContext | None]) -> Connect:
    """Subscribers over the guards' streams; ``tls_for``: an events URL's TLS context (None:
    http), asked at each connect, so a new fleet CA is used from the next one."""

    async def connect(url: str, key: str | None) -> Subscriber:
        return await StreamSubscriber.open(url, key, tls_for(url))

    return connect


def apply_frames(cache: ExactCache, frames: list[bytes], where: str) -> bool:
    """One message into ``cache``; False (logged) where it was dropped."""
    if len(frames) != 3 or len(frames[1]) != 8:
        log.warning("kv events from %s: a message of %d frames dropped", where, len(frames))
        return False
    seq = int.from_bytes(frames[1], "big", signed=True)
    try:
        events = decode_batch(frames[2])
    except BadEvent as exc:
        log.warning("kv events from %s: batch %d dropped: %s", where, seq, exc)
        return False
    if cache.seq >= 0 and seq != cache.seq + 1:
        log.info("kv events from %s: batch %d after %d; its cache read anew", where, seq, cache.seq)
        cache.clear()
    cache.seq = seq
    cache.apply(events)
    return True


async def follow(cache: ExactCache, url: str, key: str | None, connect: Connect) -> None:
    """Feed ``cache`` from ``url`` until cancelled."""
    pause = RETRY_S[0]
    while True:
        subscriber: Subscriber | None = None
        try:
            subscriber = await connect(url, key)
            while True:
                frames = await subscriber.recv()
                apply_frames(cache, frames, url)
                pause = RETRY_S[0]
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a stream's failure must not end the follower
            log.warning("kv events from %s: %s; again in %.1f s", url,
                        exc or type(exc).__name__, pause)  # fmt: skip
        finally:
            if subscriber is not None:
                subscriber.close()
        cache.live = False
        cache.clear()
        cache.seq = -1
        await asyncio.sleep(pause)
        pause = min(pause * 2, RETRY_S[1])


class KvFollowers:
    """The followers of a gateway: one per replica whose endpoint publishes events."""

    def __init__(self, connect: Connect) -> None:
        self._connect = connect
        # replica id -> (events URL, engine key), its task
        self._tasks: dict[str, tuple[tuple[str, str | None], asyncio.Task[None]]] = {}

    def sync(self, replicas: Iterable[Replica]) -> None:
        """Follow exactly these replicas' events (called once per config, never per request)."""
        wanted: dict[str, Replica] = {r.replica_id: r for r in replicas if r.kv_events}
        for replica_id, (source, task) in list(self._tasks.items()):
            replica = wanted.get(replica_id)
            if replica is None or (replica.kv_events, replica.engine_key) != source:
                task.cancel()
                del self._tasks[replica_id]
                if replica is not None:
                    replica.exact = None  # a new follower's cache, or the estimate
        loop = asyncio.get_running_loop()
        for replica_id, replica in wanted.items():
            if replica_id in self._tasks or replica.kv_events is None:
                continue
            cache = replica.exact = ExactCache()
            key = replica.engine_key
            task = loop.create_task(follow(cache, replica.kv_events, key, self._connect),
                                    name=f"gateway-kv-events-{replica_id}")  # fmt: skip
            self._tasks[replica_id] = ((replica.kv_events, key), task)

    async def close(self) -> None:
        tasks = [task for _, task in self._tasks.values()]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks, return_exceptions=True)
