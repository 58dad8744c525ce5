"""Adapters in the gateway: their own prefix index, the base's replicas' load, parent listed."""

from __future__ import annotations

from llmgw import wire
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
