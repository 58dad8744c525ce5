"""Limits that hold across gateways: a real control plane on PostgreSQL, two gateways
following it over HTTP, one external model (a fake engine on loopback).

Before, each gateway enforced a key's whole RPM in its own memory, so two gateways
gave a key twice its limit; a quota or budget over a day or month did not exist.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from tests.control.planekit import opened_plane
from tests.gateway.conftest import (
    SECRET,
    api_key,
    async_client,
    fast_settings,
    make_config,
    route,
    running_gateway,
)
from tests.gateway.test_keys_usage import OTHER
from tests.servers import serve_asgi

from llmgw.control.app import create_app
from llmgw.control.plane import ControlPlane
from llmgw.gateway.app import Gateway
from llmgw.gateway.link import HttpControlPlaneLink, MemoryLink
from llmgw.wire import ExternalSpec, ModelPrice, ModelSpec, TeamInfo, TenantLimits

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi " * 20}]


@asynccontextmanager
async def fleet(pg_database_url: str, engine_url: str, gateways: int = 2
                ) -> AsyncIterator[tuple[ControlPlane, list[tuple[Gateway, str]]]]:
    async with AsyncExitStack() as stack:
        cp, creds = await stack.enter_async_context(opened_plane(pg_database_url))
        await cp.catalog.put([ModelSpec(
            name="m", external=ExternalSpec(urls=[engine_url]),
            price=ModelPrice(input_per_million=1000.0, output_per_million=3000.0))])
        url = await stack.enter_async_context(serve_asgi(create_app(cp), graceful_s=0.5))
        assert creds.gateway_token
        started = []
        for _ in range(gateways):
            link = HttpControlPlaneLink(url, creds.gateway_token)
            stack.push_async_callback(link.close)
            started.append(await stack.enter_async_context(
                running_gateway(link, fast_settings())))
        yield cp, started


async def ask(url: str, secret: str) -> tuple[int, str]:
    try:
        await async_client(url, secret).chat.completions.create(model="m", messages=MESSAGES)
    except openai.APIStatusError as refused:
        return refused.status_code, refused.message
    return 200, ""


async def test_a_keys_rpm_holds_across_two_gateways(pg_database_url: str, upstreams: Any
                                                    ) -> None:
    engine = await upstreams("e1")
    async with fleet(pg_database_url, engine.url) as (cp, gateways):
        _, secret = await cp.keys.create(name="busy", rpm=12)
        await asyncio.sleep(0.5)  # both gateways hold the new key
        urls = [url for _, url in gateways]
        answers = await asyncio.gather(*(ask(urls[i % 2], secret) for i in range(40)))
        served = [status for status, _ in answers].count(200)
        # Each gateway alone would have admitted 12: together 24.
        assert 6 <= served <= 12, answers
        refused = [message for status, message in answers if status == 429]
        assert refused and all("requests per minute (RPM)" in m and "limit 12" in m
                               for m in refused)
        assert len(engine.seen) == served


async def test_a_teams_token_quota_and_a_keys_budget_hold_across_two_gateways(
    pg_database_url: str, upstreams: Any,
) -> None:
    engine = await upstreams("e1", tokens=20)  # 20 completion tokens an answer, and the prompt
    async with fleet(pg_database_url, engine.url) as (cp, gateways):
        team = await cp.teams.create(TeamInfo(team_id="-", name="research",
                                              tokens_per_day=350))
        _, in_team = await cp.keys.create(name="r1", team_id="research")
        # $0.015 + $0.06 = $0.075 an answer at the model's price: 4 fit in $0.30.
        _, budgeted = await cp.keys.create(name="b1", limits=TenantLimits(budget_usd=0.30))
        await asyncio.sleep(0.5)
        urls = [url for _, url in gateways]

        async def until_refused(secret: str) -> tuple[int, str]:
            for i in range(40):  # one at a time, alternating gateways
                status, message = await ask(urls[i % 2], secret)
                if status != 200:
                    assert status == 429, message
                    return i, message
            pytest.fail("never refused")

        served, message = await until_refused(in_team)
        assert "daily token quota of team `research` (350 tokens)" in message
        await gateways[0][0].flush_usage()
        await gateways[1][0].flush_usage()
        tokens, _ = await cp.store.consumed(since=0, team_id=team.team_id)
        per_answer = tokens / served
        # Over by at most the one request each gateway had in flight when its
        # share ran out; each gateway alone would have allowed 350 itself.
        assert 350 <= tokens <= 350 + 2 * per_answer, (served, tokens)

        spent, message = await until_refused(budgeted)
        assert 3 <= spent <= 4 + 2, spent
        assert "monthly budget of this API key ($0.30) is spent" in message
        await gateways[0][0].flush_usage()
        await gateways[1][0].flush_usage()
        _, spend = await cp.store.consumed(since=0, key_id=cp.keys.all()[-1].key_id)
        assert 0.30 <= spend <= 0.30 + 2 * spend / spent


async def test_gateways_cut_off_from_the_control_plane_keep_their_last_shares(
    upstreams: Any,
) -> None:
    engine = await upstreams("e1")
    link = MemoryLink(make_config(1, [route("m", [engine])], [
        api_key(rpm=10), api_key(secret=OTHER, key_id="k2", rpm=10)]))
    async with running_gateway(link) as (_, first), running_gateway(link) as (_, second):
        # k1 is used on both gateways: each holds a share of its 10.
        answers = [await ask(url, SECRET) for url in (first, second) * 3]
        assert [status for status, _ in answers] == [200] * 6
        link.fail = True
        more = await asyncio.gather(*(ask(url, SECRET) for url in (first, second) * 10))
        served = [status for status, _ in more].count(200)
        # Never unlimited: together still within the key's 10 a minute.
        assert served <= 4, more
        assert {status for status, _ in more} <= {200, 429}
        # k2 was never seen: no share, no guess.
        status, message = await ask(first, OTHER)
        assert status == 503 and "cannot be checked" in message
