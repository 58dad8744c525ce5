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
descriptors. A file being sent is never cut: the timer only runs while a
connection waits for a request.
"""

from __future__ import annotations

import hmac
import ssl
from collections.abc import Callable

from aiohttp import web
from aiohttp.typedefs import Handler

from llmgw.agent.fetchers import FILE_PATH, MANIFEST_PATH
from llmgw.agent.weights import WeightsCache, manifest_json
from llmgw.promkit import CONTENT_TYPE, scrape_allowed
from llmgw.secrets import bearer
from llmgw.wire import NUDGE_PATH

# As the head timeout of llmgw's uvicorn servers (cli/httpserver.py); here it
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
    ) -> None:
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
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
        self._runner = web.AppRunner(self._app(), access_log=None,
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
                return web.json_response({"error": "a valid peer token is required"}, status=401)
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
            return web.json_response(
                {"error": "/metrics needs the metrics token (Authorization: Bearer ...)"},
                status=401)
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
