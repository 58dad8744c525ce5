"""Adapters in the gateway: their own prefix index, the base's replicas' load, parent listed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.gateway.conftest import async_client, make_config, running_gateway

from llmgw import wire
from llmgw.gateway.link import MemoryLink
from llmgw.gateway.settings import GatewaySettings
from llmgw.gateway.snapshot import ConfigView

PROMPT = "a long shared system prompt " * 40


def view() -> ConfigView:
    endpoints = [wire.Endpoint(replica_id=n, url=f"http://{n}") for n in ("r1", "r2")]
    routes = [
        wire.ModelRoute(name="base", served_name="base", endpoints=endpoints),
        wire.ModelRoute(name="ad-a", served_name="ad-a", endpoints=endpoints, parent="base",
                        on_demand=True),
        wire.ModelRoute(name="ad-b", served_name="ad-b", endpoints=endpoints[:1],
                        parent="base", on_demand=True),
    ]
    table = wire.RoutingTable(version=1, models=routes)
    return ConfigView(wire.GatewayConfig(routing=table), GatewaySettings(), None)


def test_each_adapter_keys_its_own_prefix_cache_and_shares_its_bases_replicas() -> None:
    config = view()
    indexes = {config.indexes[n] for n in ("base", "ad-a", "ad-b")}
    assert len(indexes) == 3  # two adapters never share KV entries
    # One Replica object per engine, whichever model a request names: the
    # base's load counts what its adapters send it.
    assert config.routes["ad-a"].replicas[0] is config.routes["base"].replicas[0]
    pick = config.routes["ad-a"].pick(PROMPT)
    assert pick is not None and pick.hashes
    config.routes["ad-a"].record(pick)
    everyone = {r: r for r in ("r1", "r2")}
    assert config.indexes["ad-a"].matches(pick.hashes, everyone)  # its own prefix is known
    assert not config.indexes["ad-b"].matches(pick.hashes, everyone)
    assert not config.indexes["base"].matches(pick.hashes, everyone)


def test_models_listing_names_each_adapters_parent() -> None:
    listing = {m["id"]: m for m in view().listing(None)["data"]}
    assert listing["ad-a"]["parent"] == "base" and listing["ad-b"]["parent"] == "base"
    assert "parent" not in listing["base"]


async def test_an_engine_that_numbers_its_adapters_is_told_which_one_per_request(
    upstreams: Callable[..., Any], link: MemoryLink
) -> None:
    # llama-server: adapters applied per request by number; a request without
    # the field would run on the KV cache another adapter left in its slot.
    engine = await upstreams("llama-server")
    dialect = wire.EngineDialect(lora_ids={"ad-a": 0, "ad-b": 1})
    shared = wire.Endpoint(replica_id="r1", url=engine.url, dialect=dialect)
    routes = [wire.ModelRoute(name="base", served_name="base", endpoints=[shared])] + [
        wire.ModelRoute(name=n, served_name=n, endpoints=[shared], parent="base")
        for n in ("ad-a", "ad-b")
    ]
    link.publish(make_config(1, routes))
    async with running_gateway(link) as (_, url):
        client = async_client(url)
        for model in ("ad-b", "base", "ad-a"):
            reply = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}],
                # A client naming an adapter by number gets the one its model says.
                extra_body={"lora": [{"id": 1, "scale": 1.0}]},
            )  # fmt: skip
            assert reply.model == model  # the engine answers under its own name
        stream = await client.chat.completions.create(
            model="ad-a", messages=[{"role": "user", "content": "hi"}], stream=True)
        async for chunk in stream:
            assert chunk.model == "ad-a"
    sent = [(s.body["model"], s.body["lora"]) for s in engine.seen]
    assert sent == [
        ("ad-b", [{"id": 1, "scale": 1.0}]),
        ("base", [{"id": 0, "scale": 0.0}]),  # every adapter at 0
        ("ad-a", [{"id": 0, "scale": 1.0}]),
        ("ad-a", [{"id": 0, "scale": 1.0}]),
    ]
