"""The gateway: an ASGI app plus the background work that keeps it current.

``Gateway(link, settings)`` is an app for llmgw's server (llmgw.http.contract),
served either alone (``llmgw gateway``) or next to the control plane's app
behind a path dispatcher (``gateway.asgi`` is the same app for any other
ASGI server); either way the caller runs ``await gateway.start()`` /
``await gateway.stop()`` (or lets the ASGI lifespan protocol do it). Per
request there is no framework: a dict lookup on the path,
:func:`llmgw.gateway.handler.handle` and the route objects of
:mod:`llmgw.gateway.routes`.

Background tasks, each guarded so that one failure never stops the others:

* config watch: long-polls the link, compiles a new :class:`ConfigView` per
  version and wakes requests waiting for an on-demand model; on any error it
  keeps the last config and retries with backoff (a gateway must keep serving
  while the control plane is away);
* load report (~1 s): in-flight, request counts and last-request times per
  replica, plus waiting requests per model (idle tracking, scale-up);
* usage flush (~2 s): per key/model/minute rows; a failed send is put back.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from functools import partial
from typing import Any

from llmgw import secrets, wire
from llmgw.backoff import Backoff
from llmgw.gateway import front, handler, openapi
from llmgw.gateway.admission import Admission
from llmgw.gateway.engineclient import Upstream
from llmgw.gateway.front import Runtime
from llmgw.gateway.health import HealthProber
from llmgw.gateway.link import ControlPlaneLink
from llmgw.gateway.metering.account import settle_counts
from llmgw.gateway.metering.batcher import UsageBatcher
from llmgw.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from llmgw.gateway.ondemand import WaitRoom
from llmgw.gateway.replies import JSON, ApiError, send_bytes, send_error, send_json
from llmgw.gateway.routes.table import ROUTES
from llmgw.gateway.routing.kvfollow import KvFollowers, stream_connect
from llmgw.gateway.settings import GatewaySettings
from llmgw.gateway.snapshot import ConfigView
from llmgw.gateway.tenancy.check import TenantCheck
from llmgw.gateway.tenancy.point import EnforcementPoint
from llmgw.gateway.types import Receive, Reply, Scope
from llmgw.http.asgi import as_asgi
from llmgw.http.contract import Asgi, Endpoint
from llmgw.promkit import scrape_allowed

log = logging.getLogger(__name__)

_MAX_BACKOFF_S = 10.0
_MODEL_PATH = "/v1/models/{model}"  # any path under /v1/models/

# Allocations (net of frees) between young-generation collections: 10x
# Python's 700. A request's objects are freed by reference counting; what
# is left over is the odd cycle, so collections stay rare and short. At 700,
# bench/gateway.py's gateway ran 22 young and 2 middle collections in 8 s at
# 1,000 req/s (pauses of up to 20 ms on the loaded test machine); at 7,000, none.
_YOUNG_THRESHOLD = 7000


def freeze_startup_objects() -> None:
    """Move everything allocated so far out of the garbage collector's sight.

    Modules, pydantic schemas and the first config are tens of thousands of
    objects that live as long as the process; a full collection walks all of
    them, which showed up as multi-millisecond pauses in the gateway's p99.
    Process-wide, so the process owner calls it once start-up is done, the
    HTTP server's modules loaded too (``llmgw gateway`` does; ``llmgw
    up``/``serve`` may).
    """
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(_YOUNG_THRESHOLD, middle, old)


class Gateway:
    def __init__(self, link: ControlPlaneLink, settings: GatewaySettings | None = None) -> None:
        self.link = link
        self.settings = settings or GatewaySettings()
        room = WaitRoom(self.settings.queue_length)
        admission = Admission(self.settings.hold_queue_length, self.settings.hold_wait_s,
                              self.settings.hold_reserve, self.settings.retry_after_s)
        self.metrics = GatewayMetrics(waiting=room.waiting, held=admission.waiting)
        self.runtime = Runtime(
            settings=self.settings,
            metrics=self.metrics,
            upstream=Upstream(self.settings),
            usage=UsageBatcher(self.settings.usage_max_rows),
            room=room,
            demand=self._demand,
            tenancy=TenantCheck(EnforcementPoint(link.exchange_allowance)),
            admission=admission,
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._side_tasks: set[asyncio.Task[Any]] = set()
        self._configured = asyncio.Event()
        self._started = False
        self._routes = self._route_table()
        # (method, path) -> endpoint, for llmgw's server (llmgw.http.contract.App):
        # the request's task runs the endpoint itself, with no frame of this
        # app's dispatch on its stack. Any other request comes to __call__.
        self.endpoints: dict[tuple[str, str], Endpoint] = {
            (method, path): endpoint for path, (method, endpoint) in self._routes.items()
        }
        # The same app for any other ASGI server (tests run it under uvicorn's own).
        self.asgi: Asgi = as_asgi(self)
        # External models' URLs, probed by this gateway (llmgw.gateway.health).
        self.health = HealthProber(self.settings, lambda: self.runtime.snapshot)
        # Replicas' KV-cache events, followed while the gateway runs.
        self.kv_followers = KvFollowers(stream_connect(self.runtime.upstream.tls_for))

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._configured = asyncio.Event()
        await self.runtime.upstream.start()
        if self.runtime.snapshot is not None:  # applied before the start (llmgw gateway does)
            self._warm(self.runtime.snapshot, None)
            self.kv_followers.sync(self.runtime.snapshot.replicas.values())
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._watch_loop(), name="gateway-config-watch"),
            loop.create_task(self._load_loop(), name="gateway-load-report"),
            loop.create_task(self._usage_loop(), name="gateway-usage-flush"),
            loop.create_task(self.health.run(), name="gateway-external-health"),
            loop.create_task(self.runtime.tenancy.point.run(), name="gateway-limit-shares"),
        ]

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        for task in [*self._tasks, *self._side_tasks]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._side_tasks, return_exceptions=True)
        self._tasks = []
        await self.kv_followers.close()
        # A clean stop loses no usage: streams still being counted first
        # (gateway.metering.account), then one last flush, each bounded in time.
        await settle_counts(2.0)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2.0):
                await self.flush_usage()
        await self.runtime.upstream.close()

    async def wait_configured(self, within_s: float) -> bool:
        """True once a first config was applied (for start-up checks and tests)."""
        try:
            async with asyncio.timeout(within_s):
                await self._configured.wait()
        except TimeoutError:
            return False
        return True

    @property
    def snapshot(self) -> ConfigView | None:
        return self.runtime.snapshot

    def apply(self, config: wire.GatewayConfig) -> bool:
        """Install ``config`` if it differs from the current one; True when it did."""
        current = self.runtime.snapshot
        if (
            current is not None
            and current.version == config.routing.version
            and current.config == config
        ):
            return False
        snapshot = ConfigView(config, self.settings, current)
        self.runtime.upstream.trust_engines(
            config.routing.engine_ca, (e.url for e in snapshot.external.values())
        )
        self.runtime.snapshot = snapshot
        self.metrics.config_version = snapshot.version
        self._configured.set()
        self.runtime.room.wake(snapshot.served_models())
        if self._started:
            self._warm(snapshot, current)
            self.kv_followers.sync(snapshot.replicas.values())
        return True

    def _warm(self, snapshot: ConfigView, previous: ConfigView | None) -> None:
        """Connect to the replicas ``snapshot`` adds, so their first requests don't.

        Engines only: an external model's hosted API is not ours to hold
        connections open to.
        """
        known = previous.replicas if previous is not None else {}
        urls = [
            replica.url
            for replica_id, replica in snapshot.replicas.items()
            if replica_id not in known and replica_id not in snapshot.external
        ]
        if not urls:
            return
        task = asyncio.get_running_loop().create_task(self.runtime.upstream.warm(urls))
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    # -- background work -------------------------------------------------------

    async def _watch_loop(self) -> None:
        backoff = Backoff(0.5, _MAX_BACKOFF_S)
        while True:
            current = self.runtime.snapshot
            after = current.version if current is not None else -1
            try:
                config = await self.link.watch_config(after)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("config watch failed (keeping version %s): %s", after, exc)
                await asyncio.sleep(backoff.failed())
                continue
            backoff.succeeded()
            try:
                self.apply(config)
            except Exception:
                log.exception("config version %s could not be applied", config.routing.version)
                await asyncio.sleep(1.0)

    def load_report(self) -> wire.GatewayLoadReport:
        snapshot = self.runtime.snapshot
        replicas = snapshot.replicas.values() if snapshot is not None else ()
        return wire.GatewayLoadReport(
            gateway_id=self.settings.gateway_id,
            replicas=[
                wire.ReplicaLoad(
                    replica_id=r.replica_id,
                    in_flight=r.in_flight,
                    last_request_at=r.last_request_at,
                    requests=r.requests,
                    # An external URL's health as this gateway's probes see it.
                    up=health.up if (health := self.health.of(r.replica_id)) else None,
                    reason=health.reason[:500] if health and health.reason else None,
                )
                for r in replicas
            ],
            waiting=self.runtime.room.waiting(),
            used=self.runtime.usage.take_last_used(),
        )

    async def _load_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.load_report_s)
            report = self.load_report()
            try:
                await self.link.report_load(report)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("load report failed: %s", exc)
                continue
            snapshot = self.runtime.snapshot
            if snapshot is not None:
                # Subtract what was reported rather than zeroing: requests that
                # arrived while the report was in flight belong to the next one.
                for load in report.replicas:
                    replica = snapshot.replicas.get(load.replica_id)
                    if replica is not None:
                        replica.requests = max(0, replica.requests - load.requests)

    async def flush_usage(self) -> int:
        records = self.runtime.usage.drain()
        if not records:
            return 0
        try:
            await self.link.report_usage(records)
        except BaseException:
            self.runtime.usage.restore(records)
            raise
        return len(records)

    async def _usage_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.usage_flush_s)
            try:
                await self.flush_usage()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("usage flush failed (kept for the next one): %s", exc)

    def _demand(self, model: str) -> None:
        async def ask() -> None:
            try:
                await self.link.demand(model)
            except Exception as exc:
                # The load report's `waiting` carries the same ask, so a lost
                # demand is healed within a report interval.
                log.warning("demand for %s failed: %s", model, exc)

        task = asyncio.get_running_loop().create_task(ask())
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    # -- ASGI ------------------------------------------------------------------

    def routes(self) -> list[tuple[str, str]]:
        """Every route this gateway answers, as (method, path template).

        The dispatch below serves exactly these, so the auth matrix
        (tests/test_auth_matrix.py), which is generated from them, fails for
        a route added without deciding who may call it.
        """
        return [(method, path) for path, (method, _) in self._routes.items()]

    def _route_table(self) -> dict[str, tuple[str, Endpoint]]:
        """Path -> (method, endpoint), built once: a request costs one dict lookup.

        The /v1 POST routes call the handler itself (a partial, no method in
        between): every await of a request resumes each coroutine frame on its
        stack, so a frame less is cheaper on every one of them.
        """
        routes: dict[str, tuple[str, Endpoint]] = {
            path: ("POST", partial(handler.handle, self.runtime, route))
            for path, route in sorted(ROUTES.items())
        }
        routes["/v1/models"] = ("GET", self._models)
        routes[_MODEL_PATH] = ("GET", self._models)
        routes[openapi.OPENAPI_PATH] = ("GET", self._openapi)
        routes["/metrics"] = ("GET", self._scrape)
        routes["/health"] = routes["/healthz"] = ("GET", self._health_route)
        return routes

    async def __call__(self, scope: Scope, receive: Receive, send: Reply) -> None:
        kind = scope["type"]
        if kind == "http":
            path = scope["path"]
            route = self._routes.get(path)
            if route is None and path.startswith("/v1/models/"):
                route = self._routes[_MODEL_PATH]
            if route is None:
                await self._refuse(send, 404, f"Invalid URL ({scope['method']} {path}).")
                return
            method, endpoint = route
            if scope["method"] == method or (method == "GET" and scope["method"] == "HEAD"):
                await endpoint(scope, receive, send)
            else:
                await self._refuse(send, 405, f"Use {method} for {path}.")
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _models(self, scope: Scope, receive: Receive, send: Reply) -> None:
        await front.list_models(self.runtime, scope, send)

    async def _scrape(self, scope: Scope, receive: Receive, send: Reply) -> None:
        if self._metrics_allowed(scope):
            await send_bytes(send, 200, self.metrics.render(), CONTENT_TYPE, self._id())
            return
        settings = self.settings
        tokens = " or ".join(name for name, held in (
            ("the metrics token", settings.metrics_token is not None),
            ("the admin token", settings.metrics_admin is not None)) if held)
        await self._refuse(send, 401, f"/metrics needs {tokens} (Authorization: Bearer ...)."
                           if tokens else
                           "/metrics is closed: start the gateway with "
                           "--metrics-token-file (or LLMGW_METRICS_TOKEN) for scrapes "
                           "that send it, or --open-metrics.")

    async def _openapi(self, scope: Scope, receive: Receive, send: Reply) -> None:
        await send_bytes(send, 200, openapi.DOCUMENT_BYTES, JSON, self._id())

    async def _health_route(self, scope: Scope, receive: Receive, send: Reply) -> None:
        await self._health(send)

    def _metrics_allowed(self, scope: Scope) -> bool:
        # Metrics name every model and replica and show the traffic: on a
        # shared network they are for the monitoring system, not for anyone.
        settings = self.settings
        header = (front.header(scope, b"authorization") or b"").decode("latin-1")
        if settings.metrics_token is not None and scrape_allowed(header, settings.metrics_token):
            return True
        if settings.metrics_admin is not None:
            token = secrets.bearer(header)
            if token is not None and settings.metrics_admin(token):
                return True
        return settings.metrics_open and settings.metrics_token is None

    @staticmethod
    def _id() -> list[tuple[bytes, bytes]]:
        return [(b"x-request-id", front.new_request_id().encode())]

    async def _refuse(self, send: Reply, status: int, message: str) -> None:
        await send_error(send, ApiError(status, message), self._id())

    async def _health(self, send: Reply) -> None:
        snapshot = self.runtime.snapshot
        if snapshot is None:
            retry = [*self._id(), (b"retry-after", b"1")]
            await send_json(send, 503, {"status": "waiting_for_config"}, retry)
            return
        body = {"status": "ok", "version": snapshot.version, "time": time.time()}
        await send_json(send, 200, body, self._id())

    async def _lifespan(self, receive: Receive, send: Reply) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.start()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return
