"""The standalone gateway's HTTP link against a tiny fake control plane."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from aiohttp import web
from openai.types.chat import ChatCompletionMessageParam
from tests.gateway.conftest import async_client, make_config, route, running_gateway

from llmgw import wire
from llmgw.errors import AuthError
from llmgw.gateway.link import ControlPlaneUnavailable, HttpControlPlaneLink

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


async def test_standalone_gateway_follows_the_control_plane_and_survives_its_absence(
    upstreams: Any,
) -> None:
    engine = await upstreams("e1")
    plane = await FakeControlPlane(
        make_config(1, [route("m", [engine]), route("lazy", [], on_demand=True)])
    ).start()
    link = HttpControlPlaneLink(plane.url, TOKEN)
    try:
        async with running_gateway(link) as (gateway, url):
            client = async_client(url)
            messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
            await client.chat.completions.create(model="m", messages=messages)
            lazy = asyncio.create_task(
                client.chat.completions.create(model="lazy", messages=messages)
            )
            for _ in range(100):
                if plane.usage and plane.loads and plane.demands:
                    break
                await asyncio.sleep(0.05)
            assert plane.demands == ["lazy"]
            assert plane.usage[0].requests == 1 and plane.usage[0].key_id == "k1"
            assert any(r.replica_id == "e1" for load in plane.loads for r in load.replicas)
            # The control plane starts the replica: the waiting request is answered.
            plane.publish(
                make_config(2, [route("m", [engine]), route("lazy", [engine], on_demand=True)])
            )
            assert (await lazy).choices[0].message.content == "hello from e1"

            # The control plane goes away: the gateway keeps its last routes.
            port = plane.port
            await plane.stop()
            await asyncio.sleep(0.6)
            for _ in range(3):
                answer = await client.chat.completions.create(model="lazy", messages=messages)
                assert answer.choices[0].message.content == "hello from e1"
            assert gateway.snapshot is not None and gateway.snapshot.version == 2

            # It comes back with a newer version: the gateway catches up.
            plane = await FakeControlPlane(
                make_config(3, [route("m", [engine]), route("new", [engine])]), port=port
            ).start()
            for _ in range(200):
                if gateway.snapshot.version == 3:
                    break
                await asyncio.sleep(0.05)
            assert gateway.snapshot.version == 3
            answer = await client.chat.completions.create(model="new", messages=messages)
            assert answer.choices[0].message.content == "hello from e1"
    finally:
        await link.close()
        await plane.stop()


async def test_link_errors_name_the_problem() -> None:
    plane = await FakeControlPlane(make_config(1, [])).start()
    try:
        bad = HttpControlPlaneLink(plane.url, "wrong")
        with pytest.raises(AuthError):
            await bad.watch_config(0)
        await bad.close()
        good = HttpControlPlaneLink(plane.url, TOKEN)
        config = await good.watch_config(-1)
        assert config.routing.version == 1
        await good.close()
    finally:
        await plane.stop()
    gone = HttpControlPlaneLink(plane.url, TOKEN)
    with pytest.raises(ControlPlaneUnavailable):
        await gone.demand("m")
    await gone.close()
