"""Talking to engines: the upstream client, usage extraction, the SSE relay.

Only failures that happen before the engine's answer could have reached the
client are retried elsewhere (:class:`~llmgw.http.client.ConnectFailed`,
and for a non-streaming answer a body cut short, since nothing was relayed
yet); anything after the first byte was relayed is reported in-band.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson

from llmgw.gateway.metering.usage import Usage, find_usage
from llmgw.gateway.settings import GatewaySettings
from llmgw.http.client import Pool, render_post, request_head
from llmgw.http.upstream import ConnectFailed, Response

# Connections opened at once when a config names new replicas (Upstream.warm).
WARM_CONCURRENCY = 16


@dataclass(frozen=True, slots=True)
class Target:
    host: str
    port: int
    path: str
    head: bytes  # the request line and constant headers, rendered once
    # https, verified by this context (the fleet's CA for an engine llmgw
    # runs, the system's CAs for an external model's server); None: http.
    tls: ssl.SSLContext | None = None


class Upstream:
    """The gateway's client for engines (one per gateway, created in ``start``)."""

    def __init__(self, settings: GatewaySettings) -> None:
        self._settings = settings
        self._pool: Pool | None = None
        self._targets: dict[tuple[str, str, str | None, bool], Target] = {}
        self._system_tls: ssl.SSLContext | None = None
        self._engine_ca: str | None = None
        self._engine_tls: ssl.SSLContext | None = None
        self._external: frozenset[str] = frozenset()

    def trust_engines(self, engine_ca: str | None, external: Iterable[str]) -> None:
        """Verify https engines against ``engine_ca`` (the fleet's CA), except
        the ``external`` base URLs (hosted APIs), which the system's CAs verify.

        Called with every config, not per request: targets are parsed again
        only when either changed.
        """
        bases = frozenset(url.rstrip("/") for url in external)
        if engine_ca == self._engine_ca and bases == self._external:
            return
        if engine_ca != self._engine_ca:
            # The fleet's CA only, not the system's: a certificate a public CA
            # issued for a node's address must not pass for an engine's.
            self._engine_tls = (
                ssl.create_default_context(cadata=engine_ca) if engine_ca else None
            )
            self._engine_ca = engine_ca
        self._external = bases
        self._targets.clear()

    def _tls_for(self, base: str) -> ssl.SSLContext:
        if self._engine_tls is not None and base.rstrip("/") not in self._external:
            return self._engine_tls
        if self._system_tls is None:
            # The system's trust store (SSL_CERT_FILE/SSL_CERT_DIR honoured).
            self._system_tls = ssl.create_default_context()
        return self._system_tls

    async def start(self) -> None:
        self._pool = Pool(self._settings.connect_timeout_s, self._settings.upstream_timeout_s)

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def target(
        self, base: str, path: str, engine_key: str | None = None, *, json: bool = True
    ) -> Target:
        """Where ``base`` + ``path`` goes, parsed once per endpoint and path.

        ``engine_key``: the replica's key (wire.Endpoint.engine_key), rendered
        into the constant head with the rest, so it costs nothing per request.
        ``json`` False: a route whose requests each name their content type
        (:meth:`post`'s ``headers``).
        """
        key = (base, path, engine_key, json)
        target = self._targets.get(key)
        if target is None:
            host, port, base_path, tls = self._address(base)
            if len(self._targets) > 4096:
                self._targets.clear()
            full = base_path + path
            head = request_head(host, port, full, engine_key, json=json)
            target = Target(host, port, full, head, tls)
            self._targets[key] = target
        return target

    def _address(self, base: str) -> tuple[str, int, str, ssl.SSLContext | None]:
        """(host, port, path, TLS context) of an endpoint's base URL."""
        parts = urlsplit(base)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            # Raised as a connection failure: the request moves to another
            # replica and this one cools down, as if it were unreachable.
            raise ConnectFailed(f"endpoint URL {base!r} is not http(s)://host[:port]")
        # An engine llmgw runs is https:// where its node has a
        # certificate from the fleet's CA (trust_engines); an external
        # model's server is checked against the system's trust store.
        tls = self._tls_for(base) if parts.scheme == "https" else None
        port = parts.port or (443 if tls is not None else 80)
        return parts.hostname, port, parts.path.rstrip("/"), tls

    async def warm(self, bases: Iterable[str]) -> int:
        """An idle connection to each of ``bases`` (endpoint URLs) ahead of traffic; how many.

        Concurrently, WARM_CONCURRENCY at a time: a fleet's first config
        names hundreds of replicas, and a gateway must not open hundreds of
        connections at once to do it.
        """
        pool = self._pool
        if pool is None:
            return 0
        addresses = set()
        for base in bases:
            with contextlib.suppress(ConnectFailed):
                host, port, _, tls = self._address(base)
                addresses.add((host, port, tls))
        gate = asyncio.Semaphore(WARM_CONCURRENCY)

        async def one(host: str, port: int, tls: ssl.SSLContext | None) -> bool:
            async with gate:
                return await pool.warm(host, port, tls)

        done = await asyncio.gather(*(one(*address) for address in addresses))
        return sum(done)

    def post(
        self, target: Target, body: bytes, request_id: str, headers: bytes = b""
    ) -> Coroutine[Any, Any, Response]:
        """The answer's start, to await; ``headers``: more header lines, each ending in
        CRLF, already checked.

        Not a coroutine itself: the caller waits in the pool's, one level less
        to resume at the answer's start.
        """
        pool = self._pool
        if pool is None:
            raise RuntimeError("the gateway's upstream client is not started")
        extra = b"X-Request-Id: " + request_id.encode() + b"\r\n" + headers
        payload = render_post(target.head, body, extra)
        return pool.request(target.host, target.port, payload, target.tls)


_EVENT_SPLIT = re.compile(rb"(?:\r?\n){2}")
_USAGE_MARK = b'"usage":{'
_USAGE_MARK_SPACED = b'"usage": {'
# A finish reason that is a string, not null: the answer really ended.
_FINISH_MARK = b'"finish_reason":"'
_FINISH_MARK_SPACED = b'"finish_reason": "'
_DONE_MARK = b"[DONE]"
_DONE_EVENTS = (b"data: [DONE]", b"data:[DONE]")
# Where _take_events has something to do: the first usage or [DONE] mark.
_MARKS = re.compile(rb'"usage": ?\{|\[DONE\]')


def _last_boundary(data: bytes) -> int:
    """End (exclusive) of the last complete SSE event in ``data``, or -1."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else -1, crlf + 4 if crlf >= 0 else -1)


class EventBuffer:
    """Holds a stream's bytes until they complete an SSE event: relays pass whole events on."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    def whole_events(self, chunk: bytes) -> bytes:
        """The events ``chunk`` completes, with what was held before them (b"": none yet)."""
        if self._pending:
            data = self._pending + chunk
        elif chunk[-2:] == b"\n\n":
            return chunk  # the usual: whole events (_last_boundary would say len(chunk))
        else:
            data = chunk
        cut = _last_boundary(data)
        if cut < 0:
            self._pending = data
            return b""
        self._pending = data[cut:]
        return data[:cut]

    def flush(self) -> bytes:
        """What is held (the end of a stream that ended mid-event)."""
        rest, self._pending = self._pending, b""
        return rest


class StreamRelay(EventBuffer):
    """Passes an SSE stream through whole events at a time, noting the usage.

    Events are forwarded as soon as they are complete (engines write whole
    events, so this adds no delay), which also means an error event appended
    after a failure never lands in the middle of a half-sent line. When the
    gateway itself asked the engine for ``include_usage``, the usage-only event
    is removed so the client sees the stream it asked for.

    A stream is whole only with a finish reason and then ``[DONE]``: an
    engine that stops early without either (llama_cpp.server cuts a running
    stream when another request arrives, and still sends ``[DONE]``) would
    otherwise hand the client a short answer that looks complete. So
    ``[DONE]`` is passed on only after a finish reason; the caller reports
    an error for a stream that is not :attr:`whole`. With ``hold_done`` it is
    never passed on: the caller adds what must precede it (a usage chunk it
    counted), then ``[DONE]`` itself. ``observe`` sees every complete event
    block before it is relayed (to count what the client received).
    """

    __slots__ = ("_hold_done", "_observe", "_strip", "done", "events", "finished", "usage")

    def __init__(
        self,
        strip_usage: bool,
        *,
        hold_done: bool = False,
        observe: Callable[[bytes], None] | None = None,
    ) -> None:
        super().__init__()
        self._strip = strip_usage
        self._hold_done = hold_done
        self._observe = observe
        self.usage: Usage | None = None
        self.events = 0
        self.finished = False  # a finish reason was seen
        self.done = False  # [DONE] was seen

    @property
    def whole(self) -> bool:
        """The engine ended the stream properly: a finish reason, then [DONE]."""
        return self.finished and self.done

    def feed(self, chunk: bytes) -> bytes:
        complete = self.whole_events(chunk)
        if not complete:
            return b""
        self.events += complete.count(b"data:")
        if (
            not self.finished
            and (_FINISH_MARK in complete or _FINISH_MARK_SPACED in complete)
            and _DONE_MARK not in complete
        ):
            # With a [DONE] in the same block, which came first decides
            # (_take_events looks at the events in order): a [DONE] before
            # the finish reason is the engine ending early, whatever
            # follows it in the same read (found by bench/fuzz.py: it went
            # out to the client when both arrived in one read).
            self.finished = True
        if self._observe is not None:
            self._observe(complete)
        if _USAGE_MARK in complete or _USAGE_MARK_SPACED in complete or _DONE_MARK in complete:
            # One pass over the events for both: an engine's last chunk holds
            # the usage and [DONE] together, and splitting it twice was ~15 %
            # of the gateway's CPU per streamed request.
            complete = self._take_events(complete)
        return complete

    def _take_events(self, block: bytes) -> bytes:
        """``block`` less a usage-only event the client did not ask for and a held [DONE]."""
        if b"\r" not in block and b"\n\n\n" not in block and block[:1] != b"\n":
            # Events apart by exactly one blank line (what engines send): the
            # ones before the first mark are split and joined back unchanged,
            # so they go out as they are, and only the rest is looked at (the
            # last of a read's events are usually the usage and [DONE]).
            mark = _MARKS.search(block)
            if mark is not None:
                cut = block.rfind(b"\n\n", 0, mark.start())
                if cut >= 0:
                    head = block[: cut + 2]
                    if not self.finished and (_FINISH_MARK in head or _FINISH_MARK_SPACED in head):
                        self.finished = True
                    return head + self._kept_events(block[cut + 2 :])
        return self._kept_events(block)

    def _kept_events(self, block: bytes) -> bytes:
        """Each event of ``block`` looked at: the events kept, joined."""
        kept: list[bytes] = []
        for event in _EVENT_SPLIT.split(block):
            if not event:
                continue
            if not self.finished and (_FINISH_MARK in event or _FINISH_MARK_SPACED in event):
                self.finished = True
            if _USAGE_MARK in event or _USAGE_MARK_SPACED in event:
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


def sse_error(message: str, code: str = "upstream_error") -> bytes:
    """An error event for a stream that already started (status 200 is gone)."""
    payload = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + orjson.dumps(payload) + b"\n\n"
