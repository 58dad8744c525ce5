"""The agent's own small HTTP server: weights for peers of its fabric, and /metrics.

Copying weights from a node next door is the fastest way to get them, but
the weights may be licensed or private, so every request must carry the
fleet's peer token (``AgentReportAnswer.peer_token``). Until the control
plane has sent one, the server refuses everything.

Files are found through the manifest, never by joining a requested path onto
the cache directory, so no request can reach a file outside a cache entry.

/metrics (llmgw.agent.metrics) is for the monitoring system, which holds no
peer token: it takes the metrics token instead when one is set, like the
gateway's and the control plane's.

Like llmgw's other servers it bounds what one client can hold: a request
head must be complete within ``IDLE_TIMEOUT_S`` of the connection opening or
of the previous answer (aiohttp's keep-alive timer runs from those moments
and is not reset by bytes of a head, so it bounds slow heads and idle
connections alike; its default is an hour), head lines and fields are
capped by aiohttp (8 KiB each, 128 fields), and past ``MAX_CONNECTIONS``
open connections requests get 503 instead of the node running out of file
descriptors. One client address holds at most
``LLMGW_MAX_CONNECTIONS_PER_ADDRESS`` of them (llmgw.addresscap): past that
its next connection is answered 503 and closed before a byte is read, so one
address keeping slow connections open cannot lock the control plane's
nudges and the peers out. A file being sent is never cut: the timer only
runs while a connection waits for a request. The peer token is checked
before any body is read (the middleware runs before a handler reads one).
"""

from __future__ import annotations

import asyncio
import hmac
import ssl
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web
from aiohttp.typedefs import Handler

from llmgw.addresscap import AddressCounts, max_per_address_from_env
from llmgw.agent.fetchers import FILE_PATH, MANIFEST_PATH
from llmgw.agent.weights import WeightsCache, manifest_json
from llmgw.promkit import CONTENT_TYPE, scrape_allowed
from llmgw.secrets import bearer
from llmgw.wire import NUDGE_PATH

# As the head timeout of llmgw's own HTTP servers (llmgw.http.server); here it
# is the idle timeout too, which peers' connection pools shrug off.
IDLE_TIMEOUT_S = 10.0
# Peers copying, a scrape, a nudge: a node sees a few dozen at once; well
# under the usual 1,024 descriptors an agent started by hand gets.
MAX_CONNECTIONS = 512


class WeightsServer:
    def __init__(
        self,
        cache: WeightsCache,
        token: Callable[[], str | None],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        node: str = "",
        on_nudge: Callable[[], None] | None = None,
        metrics: Callable[[], bytes] | None = None,
        metrics_token: str | None = None,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        max_per_address: int | None = None,
    ) -> None:
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self.per_address = AddressCounts(
            max_per_address_from_env() if max_per_address is None else max_per_address)
        self.cache = cache
        self._metrics = metrics
        self._metrics_token = metrics_token
        self._token = token
        self._on_nudge = on_nudge
        self.host = host
        self.port = port
        self.node = node
        self._runner: web.AppRunner | None = None
        # Listening with a node certificate (agent.nodecert), not plain HTTP.
        self.tls = False

    @property
    def running(self) -> bool:
        return self._runner is not None

    def _app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/agent/v1/health", self._health)
        app.router.add_get(MANIFEST_PATH, self._manifest)
        app.router.add_get(FILE_PATH, self._file)
        app.router.add_post(NUDGE_PATH, self._nudge)
        if self._metrics is not None:
            app.router.add_get("/metrics", self._scrape)
        return app

    def routes(self) -> list[tuple[str, str]]:
        """Every route this server answers, as (method, path).

        The auth matrix (tests/test_auth_matrix.py) is generated from these,
        so a route added without deciding who may call it fails that test.
        """
        return [(route.method, route.resource.canonical)
                for route in self._app().router.routes()
                if route.method != "HEAD" and route.resource is not None]

    async def start(self, ssl_context: ssl.SSLContext | None = None) -> int:
        """Listen (with TLS when given a context) and return the bound port.

        The port is kept: started again (plain to TLS), it listens where
        the control plane and peers already know to find it.
        """
        self._runner = _CappedRunner(self._app(), self.per_address, access_log=None,
                                     keepalive_timeout=self.idle_timeout_s)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=ssl_context)
        await site.start()
        self.tls = ssl_context is not None
        addresses = self._runner.addresses
        if addresses:
            self.port = int(addresses[0][1])
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _auth(
        self,
        request: web.Request,
        handler: Handler,
    ) -> web.StreamResponse:
        runner = self._runner
        if runner is not None and runner.server is not None and (
                len(runner.server.connections) > self.max_connections):
            return web.json_response({"error": "too many connections; retry later"},
                                     status=503, headers={"Retry-After": "1"})
        if request.path not in ("/agent/v1/health", "/metrics"):
            expected = self._token()
            given = bearer(request.headers.get("Authorization"))
            if not expected or not given or not hmac.compare_digest(given, expected):
                refused = web.json_response({"error": "a valid peer token is required"},
                                            status=401)
                # The connection goes with the refusal: kept open, it is a slot
                # held by a caller without a credential.
                refused.force_close()
                return refused
        return await handler(request)

    async def _nudge(self, request: web.Request) -> web.Response:
        """The control plane's hint that this node's assignments changed.

        Carries nothing: the agent just reports now instead of at its next
        interval, and learns what changed from the answer. A placement then
        starts within a round trip, not within a report interval.
        """
        if self._on_nudge is not None:
            self._on_nudge()
        return web.json_response({"ok": True}, status=202)

    async def _scrape(self, request: web.Request) -> web.Response:
        if not scrape_allowed(request.headers.get("Authorization"), self._metrics_token):
            refused = web.json_response(
                {"error": "/metrics needs the metrics token (Authorization: Bearer ...)"},
                status=401)
            refused.force_close()
            return refused
        render = self._metrics or bytes  # the route exists only with it
        return web.Response(body=render(), headers={"Content-Type": CONTENT_TYPE})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"node": self.node, "ok": True})

    async def _manifest(self, request: web.Request) -> web.Response:
        model = request.query.get("model", "")
        found = self.cache.latest(model)
        if found is None:
            return web.json_response({"error": f"no weights of {model!r} here"}, status=404)
        _, entry = found
        return web.Response(body=manifest_json(entry), content_type="application/json")

    async def _file(self, request: web.Request) -> web.StreamResponse:
        model = request.query.get("model", "")
        path = request.query.get("path", "")
        found = self.cache.latest(model)
        if found is None:
            return web.json_response({"error": f"no weights of {model!r} here"}, status=404)
        root, entry = found
        if not any(item.path == path for item in entry.files):
            return web.json_response({"error": f"{path!r} is not part of {model!r}"}, status=404)
        return web.FileResponse(root / path)


_OVER_PER_ADDRESS = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: 41\r\n\r\n"
    b"Too many connections from this address.\r\n"
)


class _Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, behind the per-address count."""

    def __init__(self, inner: asyncio.Protocol, counts: AddressCounts) -> None:
        self.inner: asyncio.Protocol | None = inner
        self.counts = counts
        self.key: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and peer:
            self.key = self.counts.take(str(peer[0]))
            if self.key is None:
                self.inner = None  # aiohttp never sees it
                cast(asyncio.Transport, transport).write(_OVER_PER_ADDRESS)
                transport.close()
                return
        assert self.inner is not None
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.key is not None:
            self.counts.give(self.key)
            self.key = None
        if self.inner is not None:
            self.inner.connection_lost(exc)


class _CountedServer:
    """aiohttp's protocol factory (web.Server), each protocol behind :class:`_Counted`."""

    def __init__(self, server: web.Server, counts: AddressCounts) -> None:
        self._server = server
        self._counts = counts

    def __call__(self) -> _Counted:
        return _Counted(self._server(), self._counts)

    def __getattr__(self, name: str) -> Any:
        # Everything else (connections, shutdown...) is aiohttp's server's.
        return getattr(self._server, name)


class _CappedRunner(web.AppRunner):
    def __init__(self, app: web.Application, counts: AddressCounts, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._counts = counts

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        return cast(web.Server, _CountedServer(server, self._counts))
