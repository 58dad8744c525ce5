"""Replica failures and client disconnects."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from tests.gateway.conftest import (
    SECRET,
    async_client,
    fast_settings,
    make_config,
    route,
    running_gateway,
)
from tests.waiting import eventually

from llmgw.gateway.link import MemoryLink

FAKE = Path(__file__).with_name("fake_upstream.py")
HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


async def _refused(url: str) -> openai.APIStatusError:
    """What the gateway answers a one-message chat with, where it must refuse it."""
    with pytest.raises(openai.APIStatusError) as refused:
        await async_client(url).chat.completions.create(model="m", messages=HI)
    return refused.value


async def _engine_process(name: str, delay_s: float) -> tuple[asyncio.subprocess.Process, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(FAKE), name, str(delay_s), stdout=asyncio.subprocess.PIPE
    )
    assert process.stdout is not None
    port = int((await asyncio.wait_for(process.stdout.readline(), 20)).strip())
    return process, f"http://127.0.0.1:{port}"


async def test_killed_replica_mid_load_costs_no_client_error(
    upstreams: Any, link: MemoryLink
) -> None:
    # The doomed engine never answers before it is killed, however slowly this
    # machine runs the test: every request it holds must be saved by a retry.
    doomed, doomed_url = await _engine_process("doomed", 30.0)
    try:
        survivor = await upstreams("survivor", delay_s=0.05)
        config = make_config(1, [route("m", [doomed_url, survivor], routing="round-robin")])
        link.publish(config)
        async with running_gateway(link, fast_settings(retries=2)) as (gateway, url):
            client = async_client(url)

            async def one(i: int) -> str:
                await asyncio.sleep(i * 0.005)  # spread over ~0.4 s, across the kill
                if i % 2:
                    stream = await client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": f"q{i}"}], stream=True
                    )
                    return "".join([c.choices[0].delta.content or "" async for c in stream])
                answer = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": f"q{i}"}]
                )
                return answer.choices[0].message.content or ""

            requests = [asyncio.create_task(one(i)) for i in range(80)]
            await asyncio.sleep(0.15)  # some requests are now waiting on the doomed engine
            doomed.kill()
            await doomed.wait()
            answers = await asyncio.gather(*requests)
            assert all(a.startswith("hello from survivor") for a in answers)
            text = gateway.metrics.render().decode()
            assert 'llmgw_gateway_upstream_retries_total{model="m"}' in text
            assert 'llmgw_gateway_requests_total{model="m",status="200"} 80.0' in text
            doomed_replica = gateway.snapshot.replicas[doomed_url]  # type: ignore[union-attr]
            assert doomed_replica.cooled_until > 0  # cooled down, not tried on every request
            assert all(r.in_flight == 0 for r in gateway.snapshot.replicas.values())  # type: ignore[union-attr]
    finally:
        if doomed.returncode is None:
            doomed.kill()
            await doomed.wait()


async def test_no_reachable_replica_is_503_with_retry_after(link: MemoryLink) -> None:
    link.publish(make_config(1, [route("m", ["http://127.0.0.1:9"])]))  # discard port: refused
    async with running_gateway(link, fast_settings(retry_after_s=7)) as (_, url):
        failed = await _refused(url)
        assert (failed.status_code, failed.code) == (503, "upstream_unavailable")
        assert failed.response.headers["retry-after"] == "7"


async def test_client_disconnect_cancels_upstream(upstreams: Any, link: MemoryLink) -> None:
    slow = await upstreams("slow", delay_s=10.0)
    dripping = await upstreams("drip", tokens=200, token_delay_s=0.05)
    link.publish(make_config(1, [route("slow", [slow]), route("drip", [dripping])]))
    async with running_gateway(link) as (gateway, url):
        impatient = async_client(url, timeout=0.3)
        with pytest.raises(openai.APITimeoutError):
            await impatient.chat.completions.create(model="slow", messages=HI)
        stream = await async_client(url).chat.completions.create(
            model="drip", messages=HI, stream=True
        )
        async for _chunk in stream:
            break
        await stream.close()
        await eventually(
            lambda: slow.cancelled and dripping.cancelled, 5, what="both engines told to stop"
        )
        assert slow.cancelled == 1
        assert dripping.cancelled == 1
        assert all(r.in_flight == 0 for r in gateway.snapshot.replicas.values())  # type: ignore[union-attr]
        assert 'status="499"' in gateway.metrics.render().decode()


async def test_idle_connection_closed_by_the_engine_is_not_a_failure(
    upstreams: Any, link: MemoryLink
) -> None:
    engine = await upstreams("e1", keepalive_s=0.1)
    link.publish(make_config(1, [route("m", [engine])]))
    async with running_gateway(link) as (gateway, url):
        client = async_client(url)
        for _ in range(3):
            answer = await client.chat.completions.create(model="m", messages=HI)
            assert answer.choices[0].message.content == "hello from e1"
            await asyncio.sleep(0.3)  # the engine closes the pooled connection meanwhile
        replica = gateway.snapshot.replicas["e1"]  # type: ignore[union-attr]
        assert replica.failures == 0 and replica.cooled_until == 0.0
        assert "llmgw_gateway_upstream_retries_total{" not in gateway.metrics.render().decode()


async def test_engine_past_its_deadline_is_a_504(upstreams: Any, link: MemoryLink) -> None:
    stuck = await upstreams("stuck", delay_s=30.0)
    link.publish(make_config(1, [route("m", [stuck])]))
    async with running_gateway(link, fast_settings(upstream_timeout_s=0.3)) as (gateway, url):
        timed_out = await _refused(url)
        assert (timed_out.status_code, timed_out.code) == (504, "upstream_timeout")
        await eventually(lambda: stuck.cancelled, 2.5, what="stuck.cancelled")
        assert stuck.cancelled == 1  # the engine was told to stop
        assert gateway.snapshot.replicas["stuck"].in_flight == 0  # type: ignore[union-attr]


async def test_client_gone_mid_body_is_a_499_not_a_crash(upstreams: Any, link: MemoryLink) -> None:
    engine = await upstreams("e1")
    link.publish(make_config(1, [route("m", [engine])]))
    async with running_gateway(link) as (gateway, url):
        port = int(url.rsplit(":", 1)[1])
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: Bearer " + SECRET.encode() + b"\r\n"
            b'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"model": '
        )
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.close()
        await writer.wait_closed()
        await eventually(
            lambda: 'status="499"' in gateway.metrics.render().decode(), 1, what="a 499 counted"
        )
        assert 'llmgw_gateway_requests_total{model="-",status="499"} 1.0' in (
            gateway.metrics.render().decode()
        )
        # ...and the gateway still serves.
        answer = await async_client(url).chat.completions.create(model="m", messages=HI)
        assert answer.choices[0].message.content == "hello from e1"
        assert engine.seen and len(engine.seen) == 1


async def test_unusable_endpoint_url_is_skipped_like_a_dead_replica(
    upstreams: Any, link: MemoryLink
) -> None:
    engine = await upstreams("e1")
    link.publish(
        make_config(1, [route("m", ["https://127.0.0.1:1", engine], routing="round-robin")])
    )
    async with running_gateway(link) as (_, url):
        client = async_client(url)
        for _ in range(3):
            answer = await client.chat.completions.create(model="m", messages=HI)
            assert answer.choices[0].message.content == "hello from e1"
