"""The standalone gateway's HTTP link against a tiny fake control plane."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from openai.types.chat import ChatCompletionMessageParam
from tests.gateway.conftest import async_client, make_config, route, running_gateway
from tests.gateway.fake_control_plane import TOKEN, FakeControlPlane
from tests.waiting import eventually

from llmgw import wire
from llmgw.errors import AuthError, ControlPlaneUnavailable
from llmgw.gateway.link import HttpControlPlaneLink


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
            await eventually(
                lambda: plane.usage and plane.loads and plane.demands, 5,
                what="usage, load and demand reports",
            )
            assert plane.demands == ["lazy"]
            assert plane.usage[0].requests == 1 and plane.usage[0].key_id == "k1"
            assert any(r.replica_id == "e1" for load in plane.loads for r in load.replicas)
            # The control plane starts the replica: the waiting request is answered.
            plane.publish(
                make_config(2, [route("m", [engine]), route("lazy", [engine], on_demand=True)])
            )
            assert (await lazy).choices[0].message.content == "hello from e1"

            # The control plane goes away: the gateway notices (its watch fails)
            # and keeps its last routes.
            failed_watches: list[Exception] = []
            watch = link.watch_config

            async def watched(after_version: int) -> wire.GatewayConfig:
                try:
                    return await watch(after_version)
                except Exception as exc:
                    failed_watches.append(exc)
                    raise

            link.watch_config = watched  # type: ignore[method-assign]
            port = plane.port
            await plane.stop()
            await eventually(lambda: failed_watches, what="the gateway's watch failing")
            for _ in range(3):
                answer = await client.chat.completions.create(model="lazy", messages=messages)
                assert answer.choices[0].message.content == "hello from e1"
            assert gateway.snapshot is not None and gateway.snapshot.version == 2

            # It comes back with a newer version: the gateway catches up.
            plane = await FakeControlPlane(
                make_config(3, [route("m", [engine]), route("new", [engine])]), port=port
            ).start()
            await eventually(
                lambda: gateway.snapshot.version == 3, 10, what="gateway.snapshot.version == 3"
            )
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


async def test_a_restarted_control_plane_is_asked_for_its_whole_config() -> None:
    plane = await FakeControlPlane(make_config(7, [])).start()
    link = HttpControlPlaneLink(plane.url, TOKEN)
    try:
        assert (await link.watch_config(-1)).routing.version == 7
        await link.watch_config(7)  # the same instance: "newer than 7" means something
        assert plane.polls == [-1, 7]
        port = plane.port
        await plane.stop()
        with pytest.raises(ControlPlaneUnavailable):
            await link.watch_config(7)
        # Back, counting versions from its own start: asked for "newer than 7"
        # it would hold the poll for nothing.
        plane = await FakeControlPlane(make_config(2, []), port=port).start()
        assert (await link.watch_config(7)).routing.version == 2
        assert plane.polls == [-1]
    finally:
        await link.close()
        await plane.stop()
