"""Per-key limits (models, expiry, revocation, rpm, tpm) and batched usage."""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from tests.gateway.conftest import (
    SECRET,
    api_key,
    async_client,
    make_config,
    route,
    running_gateway,
)
from tests.waiting import eventually

from llmgw import wire
from llmgw.gateway.link import MemoryLink
from llmgw.gateway.metering.batcher import UsageBatcher
from llmgw.gateway.tenancy.windows import SlidingCount

OTHER = "sk-llmgw-other-key-abcdefghijklmnopqrstuvwxyz"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


async def test_models_expiry_and_revocation(upstreams: Any, link: MemoryLink) -> None:
    engine = await upstreams("e1")
    keys = [
        api_key(SECRET, "narrow", models=["a"]),
        api_key(OTHER, "old", expires_at=time.time() - 1),
        api_key("sk-llmgw-revoked-0000000000000000000", "gone", revoked=True),
    ]
    link.publish(
        make_config(1, [route("a", [engine], aliases=["alias-a"]), route("b", [engine])], keys)
    )
    async with running_gateway(link) as (_, url):
        narrow = async_client(url)
        await narrow.chat.completions.create(model="a", messages=MESSAGES)
        await narrow.chat.completions.create(model="alias-a", messages=MESSAGES)
        with pytest.raises(openai.NotFoundError):
            await narrow.chat.completions.create(model="b", messages=MESSAGES)
        assert [m.id for m in (await narrow.models.list()).data] == ["a"]
        with pytest.raises(openai.NotFoundError):
            await narrow.models.retrieve("b")
        with pytest.raises(openai.AuthenticationError) as expired:
            await async_client(url, OTHER).chat.completions.create(model="a", messages=MESSAGES)
        assert "expired" in expired.value.message
        with pytest.raises(openai.AuthenticationError) as revoked:
            await async_client(url, "sk-llmgw-revoked-0000000000000000000").models.list()
        assert "revoked" in revoked.value.message
        assert len(engine.seen) == 2


async def test_rpm_limit_survives_a_config_update(upstreams: Any, link: MemoryLink) -> None:
    engine = await upstreams("e1")
    link.publish(make_config(1, [route("m", [engine])], [api_key(rpm=3)]))
    async with running_gateway(link) as (gateway, url):
        client = async_client(url)
        for _ in range(3):
            await client.chat.completions.create(model="m", messages=MESSAGES)
        link.publish(make_config(2, [route("m", [engine])], [api_key(rpm=3)]))
        await eventually(
            lambda: gateway.snapshot is not None and gateway.snapshot.version == 2, 1,
            what="routing table version 2",
        )
        with pytest.raises(openai.RateLimitError) as limited:
            await client.chat.completions.create(model="m", messages=MESSAGES)
        assert limited.value.code == "rate_limit_exceeded"
        assert limited.value.body["type"] == "requests"  # type: ignore[index]
        assert int(limited.value.response.headers["retry-after"]) >= 1
        assert len(engine.seen) == 3


async def test_tpm_limit_charges_real_usage(upstreams: Any, link: MemoryLink) -> None:
    engine = await upstreams("e1", tokens=50)
    link.publish(make_config(1, [route("m", [engine])], [api_key(tpm=40)]))
    async with running_gateway(link) as (_, url):
        client = async_client(url)
        await client.chat.completions.create(model="m", messages=MESSAGES)  # uses > 40 tokens
        with pytest.raises(openai.RateLimitError) as limited:
            await client.chat.completions.create(model="m", messages=MESSAGES)
        assert limited.value.body["type"] == "tokens"  # type: ignore[index]


async def test_usage_is_batched_per_key_model_minute(upstreams: Any, link: MemoryLink) -> None:
    engine = await upstreams("e1", tokens=5)
    keys = [api_key(SECRET, "k1"), api_key(OTHER, "k2")]
    link.publish(make_config(1, [route("m", [engine]), route("n", [engine])], keys))
    async with running_gateway(link) as (gateway, url):
        first, second = async_client(url), async_client(url, OTHER)
        for _ in range(3):
            await first.chat.completions.create(model="m", messages=MESSAGES)
        stream = await first.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        _ = [c async for c in stream]
        await second.chat.completions.create(model="n", messages=MESSAGES)
        with pytest.raises(openai.BadRequestError):
            await second.chat.completions.create(
                model="n", messages=MESSAGES, extra_body={"top_k": "x"}
            )
        # The control plane is away for a while: nothing may be lost. A delivery
        # is one call, refused whole while the link fails.
        refused: list[int] = []
        deliver = link.report_usage

        async def counted(records: list[wire.UsageRecord]) -> None:
            if link.fail:
                refused.append(len(records))
            await deliver(records)

        link.report_usage = counted  # type: ignore[method-assign]
        link.fail = True
        delivered = len(link.usage)
        await second.chat.completions.create(model="n", messages=MESSAGES)
        # The gateway tried meanwhile (twice), and nothing got through.
        await eventually(lambda: len(refused) >= 2, what="two refused deliveries")
        assert len(link.usage) == delivered
        assert len(gateway.runtime.usage) > 0  # kept in memory meanwhile
        link.fail = False
        await eventually(
            lambda: sum(r.requests for r in link.usage) == 7, 5, what="7 requests metered"
        )
    totals: dict[tuple[str, str], list[int]] = {}
    for record in link.usage:
        assert record.minute % 60 == 0
        row = totals.setdefault((record.key_id, record.model), [0, 0, 0, 0, 0])
        for i, value in enumerate(
            (record.requests, record.prompt_tokens, record.completion_tokens,
             record.cached_tokens, record.errors)
        ):  # fmt: skip
            row[i] += value
    assert totals[("k1", "m")][0] == 4
    assert totals[("k1", "m")][2] == 20  # 4 answers x 5 tokens, the stream included
    assert totals[("k1", "m")][3] == 8
    assert totals[("k1", "m")][4] == 0
    assert totals[("k2", "n")][0] == 3
    assert totals[("k2", "n")][4] == 1
    # Far fewer rows than requests: one per key, model and minute per flush.
    assert len(link.usage) <= 6


def test_usage_batcher_bounds_and_restores() -> None:
    batcher = UsageBatcher(max_rows=2)
    batcher.add(60, "k", "m", 1, 2, 0, False)
    batcher.add(60, "k", "m", 1, 2, 0, True)
    records = batcher.drain()
    assert records == [
        wire.UsageRecord(minute=60, key_id="k", model="m", requests=2, prompt_tokens=2,
                         completion_tokens=4, errors=1)
    ]  # fmt: skip
    batcher.add(60, "k", "m", 1, 0, 0, False)
    batcher.restore(records)
    assert batcher.drain()[0].requests == 3
    batcher.add(60, "k", "a", 0, 0, 0, False)
    batcher.add(120, "k", "a", 0, 0, 0, False)
    batcher.add(180, "k", "a", 0, 0, 0, False)  # over the bound: minute 60 is dropped
    assert sorted(r.minute for r in batcher.drain()) == [120, 180]
    assert batcher.dropped == 1


def test_the_sliding_minute_never_counts_less_than_the_last_60_s() -> None:
    count = SlidingCount()
    count.add(1, 100.2)
    count.add(2, 130.0)
    assert count.count(160.1) == 3  # 100.2 is still within (100.1, 160.1]
    assert count.count(160.4) == 3  # out of the window, but its half-second slot is not yet
    assert count.count(160.6) == 2
    assert count.frees_in(161.0) == pytest.approx(29.5)
    assert count.count(191.0) == 0
