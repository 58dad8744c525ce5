"""The gateway's client for engines: where each endpoint and path goes, trusted how.

Targets are parsed once per endpoint and path, their constant request head
rendered with them; requests go through llmgw's pooled HTTP/1.1 client
(:mod:`llmgw.http.client`). Only failures that happen before the engine's
answer could have reached the client are retried elsewhere
(:class:`~llmgw.http.upstream.ConnectFailed`, and for a non-streaming answer
a body cut short, since nothing was relayed yet); anything after the first
byte was relayed is reported in-band.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

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

    def tls_for(self, url: str) -> ssl.SSLContext | None:
        """How a connection of its own to an engine at ``url`` is verified: as requests to
        it are (trust_engines); None for http."""
        return self._tls_for(url) if urlsplit(url).scheme == "https" else None

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
