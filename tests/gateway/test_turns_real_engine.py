"""Turns at the real llama_cpp.server: the gateway sends it one request at a time, cheapest first.

The engine runs with the agent's flags and the gateway routes to it with the
dialect the adapter declares (one generation at a time). While a cold
prompt computes, another cold prompt and then a short one arrive: the
engine alone would compute them in that order, so the short one would wait
for both cold prefills. Through the gateway the short one goes first, and
the engine never has two of the gateway's requests at once (its log shows
each generation whole before the next one's prompt).

The same one-at-a-time sending times each prompt from the gateway's turn:
a prompt the engine had in its context, or loaded from its RAM prompt
cache, comes back at once, and the gateway learns from it that its index
forgot too early (routing/cachesize.py), without taking a cache load's
time for the engine's prefill speed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.gateway.conftest import async_client, make_config, running_gateway
from tests.gateway.test_llamacpp_gaps_real_engine import _dialect
from tests.gateway.test_real_engine import SERVED, Engine, llama_server
from tests.waiting import eventually

from llmgw import wire
from llmgw.agent.engines.llamacpppython import PROMPT_CACHE_N_BATCH
from llmgw.gateway.link import MemoryLink

pytestmark = pytest.mark.slow

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
         "lambda", "omicron", "sigma"]  # fmt: skip


def _long(seed: int) -> str:
    """A prompt of ~400 tokens that shares nothing with another seed's."""
    words = [WORDS[(seed * 7 + i * i) % len(WORDS)] for i in range(400)]
    return f"Record {seed}: " + " ".join(words) + "\n\nWhat does the record say?"


@pytest.fixture(scope="module")
def agents_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    folder = tmp_path_factory.mktemp("engine")
    with llama_server(folder, "--interrupt_requests", "false", "--logits_all", "false",
                      "--n_threads", "1", "--n_threads_batch", "1") as run:  # fmt: skip
        yield run


async def test_a_short_prompt_goes_before_a_cold_one_sent_earlier(agents_engine: Engine) -> None:
    endpoint = wire.Endpoint(replica_id="llama", url=agents_engine.url, dialect=_dialect())
    route = wire.ModelRoute(name="gemma", served_name=SERVED, endpoints=[endpoint])
    link = MemoryLink(poll_timeout_s=1.0)
    link.publish(make_config(1, [route]))
    async with running_gateway(link) as (_, url):
        client = async_client(url, timeout=120.0)
        first_token: dict[str, float] = {}

        async def ask(name: str, content: str) -> None:
            stream = await client.chat.completions.create(
                model="gemma", messages=[{"role": "user", "content": content}],
                max_tokens=4, stream=True, temperature=0.0,
            )  # fmt: skip
            chunk: Any
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content and name not in first_token:
                    first_token[name] = time.monotonic()

        busy = asyncio.create_task(ask("cold-first", _long(1)))
        await asyncio.sleep(0.5)  # at the engine, computing
        cold = asyncio.create_task(ask("cold-second", _long(2)))
        await asyncio.sleep(0.1)
        short = asyncio.create_task(ask("short", "Say hi."))
        await asyncio.gather(busy, cold, short)
    assert first_token["short"] < first_token["cold-second"], first_token
    # One generation at a time from the gateway: each prompt's evaluation is
    # followed by its own answer before the next prompt's starts.
    log = agents_engine.log.read_text(errors="replace")
    kinds = [
        "prompt" if "prompt eval" in line else "decode"
        for line in log.splitlines()
        if " eval time" in line
    ]
    assert kinds[-6:] == ["prompt", "decode"] * 3, kinds


async def _ask(client: Any, content: str) -> None:
    """One streamed chat through the gateway, read to its end."""
    stream = await client.chat.completions.create(
        model="gemma", messages=[{"role": "user", "content": content}],
        max_tokens=2, stream=True, temperature=0.0,
    )  # fmt: skip
    async for _ in stream:
        pass


async def test_the_engines_time_tells_the_gateway_what_it_found_cached(
    agents_engine: Engine,
) -> None:
    # The engine keeps the context it computed last. A held prompt asked
    # unstreamed is asked of this engine as a stream (routes/assemble.py),
    # timed as one, and agrees with the index. Then its replica is replaced
    # by a new one at the same engine (a new routing table), whose index
    # holds nothing: the same context again is routed as new, and comes back
    # at once. The index forgot too early, and the capacity grows
    # (routing/cachesize.py).
    def config(version: int, replica_id: str) -> wire.GatewayConfig:
        endpoint = wire.Endpoint(replica_id=replica_id, url=agents_engine.url,
                                 dialect=_dialect())  # fmt: skip
        route = wire.ModelRoute(name="gemma", served_name=SERVED, endpoints=[endpoint])
        made = make_config(version, [route])
        made.routing.gateways = 1  # alone: the engine computes only this gateway's requests
        return made

    link = MemoryLink(poll_timeout_s=1.0)
    link.publish(config(1, "x"))
    async with running_gateway(link) as (gateway, url):
        client = async_client(url, timeout=120.0)

        def replica() -> Any:
            snapshot = gateway.snapshot
            assert snapshot is not None
            return snapshot.routes["gemma"].replicas[0]

        def samples() -> int:
            snapshot = gateway.snapshot
            assert snapshot is not None
            return int(snapshot.routes["gemma"].policy.speed.samples)  # type: ignore[attr-defined]

        def seen() -> tuple[str, float, int]:
            r = replica()
            return r.replica_id, r.capacity_scale, samples()

        await _ask(client, _long(3))  # cold: timed whole, nothing to correct
        await eventually(lambda: samples() == 1, 30, "the cold prompt timed", note=seen)
        assert replica().capacity_scale == 1.0
        for question in (" In a word.", " In two words."):
            # Held, and found held: nothing to correct.
            answer = await client.chat.completions.create(
                model="gemma", messages=[{"role": "user", "content": _long(3) + question}],
                max_tokens=2, temperature=0.0,
            )  # fmt: skip
            assert answer.usage is not None and answer.usage.prompt_tokens > 400
        assert replica().capacity_scale == 1.0, seen()  # (metered before it was sent)
        link.publish(config(2, "y"))
        await eventually(lambda: replica().replica_id == "y", 30, "the new table", note=seen)
        await _ask(client, _long(3) + " Briefly.")  # routed as new, found in the engine's context
        await eventually(lambda: replica().capacity_scale > 1.0, 30, "the hit timed",
                         note=seen)  # fmt: skip


async def test_a_prompt_loaded_from_the_engines_cache_is_timed_a_hit(tmp_path: Path) -> None:
    # The engine as the agent starts it with its RAM prompt cache on (the
    # logits rows each state carries bounded by n_batch): a prompt found in
    # the cache, not in its context, comes back at once. Its replica is
    # declared too small for the index to keep more than a block, so the
    # prompt is routed as new there: its time grows the index's capacity.
    cache = ("--cache", "true", "--cache_type", "ram", "--cache_size", str(64 << 20),
             "--n_batch", str(PROMPT_CACHE_N_BATCH))  # fmt: skip
    with llama_server(tmp_path, "--interrupt_requests", "false", "--logits_all", "false",
                      "--n_threads", "1", "--n_threads_batch", "1", *cache) as engine:  # fmt: skip
        endpoint = wire.Endpoint(replica_id="x", url=engine.url, dialect=_dialect(),
                                 kv_capacity_tokens=16)  # fmt: skip
        route = wire.ModelRoute(name="gemma", served_name=SERVED, endpoints=[endpoint])
        config = make_config(1, [route])
        config.routing.gateways = 1  # alone: the engine computes only this gateway's requests
        link = MemoryLink(poll_timeout_s=1.0)
        link.publish(config)
        async with running_gateway(link) as (gateway, url):
            client = async_client(url, timeout=120.0)
            snapshot = gateway.snapshot
            assert snapshot is not None
            router = snapshot.routes["gemma"]
            (replica,) = router.replicas
            speed = router.policy.speed  # type: ignore[attr-defined]

            def seen() -> tuple[float, int, float]:
                return replica.capacity_scale, speed.samples, speed.tokens_per_s

            await _ask(client, _long(1))  # cold
            await _ask(client, _long(2))  # the index forgets the first, the engine's cache not
            await eventually(lambda: speed.samples == 2, 30, "the prompts timed", note=seen)
            assert replica.capacity_scale == 1.0
            computing = speed.tokens_per_s
            await _ask(client, _long(1) + " Briefly.")  # routed as new, loaded from its cache
            await eventually(lambda: replica.capacity_scale > 1.0, 30, "the hit timed",
                             note=seen)  # fmt: skip
            # A cache load's time is not the engine's prefill speed.
            assert speed.samples == 2 and speed.tokens_per_s == computing
