"""A tiny control plane speaking the gateway side of the fixed protocol (aiohttp.web)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from aiohttp import web

from llmgw import wire
from llmgw.allowance import AllowanceBook
from llmgw.gateway.link import lend_from_config

TOKEN = "llmgw-gw-test-token"


class FakeControlPlane:
    def __init__(self, config: wire.GatewayConfig, port: int = 0) -> None:
        self.config = config
        self.port = port
        self.loads: list[wire.GatewayLoadReport] = []
        self.usage: list[wire.UsageRecord] = []
        self.demands: list[str] = []
        self.polls: list[int] = []
        self._changed = asyncio.Event()
        self.allowances = AllowanceBook(settle_s=0.0, now=time.monotonic())
        self._runner: web.AppRunner | None = None

    def publish(self, config: wire.GatewayConfig) -> None:
        self.config = config
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def start(self) -> FakeControlPlane:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/gateway/v1/config", self._config)
        app.router.add_post("/gateway/v1/load", self._load)
        app.router.add_post("/gateway/v1/demand", self._demand)
        app.router.add_post("/gateway/v1/usage", self._usage)
        app.router.add_post("/gateway/v1/allowance", self._allowance)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"detail": "bad token"}, status=401)
        return await handler(request)  # type: ignore[no-any-return]

    async def _config(self, request: web.Request) -> web.Response:
        after = int(request.query["after"])
        self.polls.append(after)
        if self.config.routing.version <= after:
            changed = self._changed
            try:
                async with asyncio.timeout(0.5):  # the real one waits ~25 s
                    await changed.wait()
            except TimeoutError:
                pass
        return web.Response(body=self.config.model_dump_json(), content_type="application/json")

    async def _allowance(self, request: web.Request) -> web.Response:
        report = wire.AllowanceReport.model_validate_json(await request.read())
        answer = await lend_from_config(self.allowances, self.config, report)
        return web.Response(body=answer.model_dump_json(), content_type="application/json")

    async def _load(self, request: web.Request) -> web.Response:
        self.loads.append(wire.GatewayLoadReport.model_validate_json(await request.read()))
        return web.Response(status=204)

    async def _demand(self, request: web.Request) -> web.Response:
        self.demands.append(wire.DemandRequest.model_validate_json(await request.read()).model)
        return web.Response(status=202)

    async def _usage(self, request: web.Request) -> web.Response:
        rows = orjson.loads(await request.read())
        self.usage.extend(wire.UsageRecord.model_validate(row) for row in rows)
        return web.Response(status=204)
