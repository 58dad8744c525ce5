"""Following each replica's KV-cache events: one ZeroMQ subscriber per replica that publishes.

A replica whose endpoint names an events URL (``wire.Endpoint.kv_events``)
gets an :class:`~.kvcache.ExactCache` and a task here that feeds it. The
task never ends on bad input: a batch that does not decode is logged and
dropped, a socket error is retried with backoff. A sequence gap (the PUB
socket drops what its high-water mark cannot hold, and a subscriber misses
what was sent before it connected) or a restarted engine (its sequence starts
at 0 again) clears the cache: what was lost cannot be told, and an empty
cache only under-reports, while a stale one would send prompts to blocks
long evicted. Until its first batch a replica is routed by the estimate.

ZeroMQ lives behind :class:`Subscriber`, a Protocol, so tests feed captured
frames without a socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Protocol

from llmgw.gateway.routing.kvcache import BadEvent, ExactCache, decode_batch
from llmgw.gateway.routing.replica import Replica

log = logging.getLogger(__name__)

# Reconnect pacing after a socket error (ZeroMQ reconnects a dropped TCP
# peer by itself; this covers a socket that failed outright).
RETRY_S = (0.5, 10.0)


class Subscriber(Protocol):
    async def recv(self) -> list[bytes]:
        """The next multipart message: ``[topic, seq (8 bytes, big-endian), payload]``."""
        ...

    def close(self) -> None: ...


def zmq_subscriber(url: str) -> Subscriber:
    """A SUB socket connected to ``url``, subscribed to every topic."""
    import zmq
    import zmq.asyncio

    context = zmq.asyncio.Context.instance()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    # A gateway that falls behind drops old batches rather than growing
    # without bound; the sequence gap then clears the cache.
    socket.setsockopt(zmq.RCVHWM, 100_000)
    socket.connect(url)

    class _Sub:
        async def recv(self) -> list[bytes]:
            return list(await socket.recv_multipart())

        def close(self) -> None:
            socket.close(0)

    return _Sub()


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


async def follow(cache: ExactCache, url: str, connect: Callable[[str], Subscriber]) -> None:
    """Feed ``cache`` from ``url`` until cancelled."""
    pause = RETRY_S[0]
    while True:
        subscriber: Subscriber | None = None
        try:
            subscriber = connect(url)
            while True:
                frames = await subscriber.recv()
                apply_frames(cache, frames, url)
                pause = RETRY_S[0]
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a socket's failure must not end the follower
            log.warning("kv events from %s: %s; again in %.1f s", url, exc, pause)
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

    def __init__(self, connect: Callable[[str], Subscriber] = zmq_subscriber) -> None:
        self._connect = connect
        self._tasks: dict[str, tuple[str, asyncio.Task[None]]] = {}

    def sync(self, replicas: Iterable[Replica]) -> None:
        """Follow exactly these replicas' events (called once per config, never per request)."""
        wanted: dict[str, Replica] = {r.replica_id: r for r in replicas if r.kv_events}
        for replica_id, (url, task) in list(self._tasks.items()):
            replica = wanted.get(replica_id)
            if replica is None or replica.kv_events != url:
                task.cancel()
                del self._tasks[replica_id]
                if replica is not None:
                    replica.exact = None  # a new follower's cache, or the estimate
        loop = asyncio.get_running_loop()
        for replica_id, replica in wanted.items():
            if replica_id in self._tasks or replica.kv_events is None:
                continue
            cache = replica.exact = ExactCache()
            task = loop.create_task(follow(cache, replica.kv_events, self._connect),
                                    name=f"gateway-kv-events-{replica_id}")  # fmt: skip
            self._tasks[replica_id] = (replica.kv_events, task)

    async def close(self) -> None:
        tasks = [task for _, task in self._tasks.values()]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks, return_exceptions=True)
