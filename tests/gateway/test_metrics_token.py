"""The gateway's /metrics can require a token (issue 13)."""

from __future__ import annotations

from typing import Any

import httpx
from tests.gateway.conftest import fast_settings, make_config, route, running_gateway

from llmgw.gateway.link import MemoryLink


async def test_metrics_can_require_a_token(upstreams: Any, link: MemoryLink) -> None:
    engine = await upstreams("e1")
    link.publish(make_config(1, [route("m", [engine])]))
    settings = fast_settings(metrics_token="metrics-secret")
    async with running_gateway(link, settings) as (_, url), httpx.AsyncClient() as client:
        assert (await client.get(f"{url}/metrics")).status_code == 401
        wrong = await client.get(f"{url}/metrics", headers={"Authorization": "Bearer no"})
        assert wrong.status_code == 401
        right = await client.get(f"{url}/metrics",
                                 headers={"Authorization": "Bearer metrics-secret"})
        assert right.status_code == 200 and "llmgw" in right.text
    async with running_gateway(link) as (_, url), httpx.AsyncClient() as client:
        assert (await client.get(f"{url}/metrics")).status_code == 200  # open by default
