"""Adapters' weights fetched ahead of need: the control plane's list, the agent's fetch."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import aiohttp
from tests.agent.test_weights import fake_package as fake_package
from tests.agent.test_weights import package_source

from llmgw.agent.prefetch import Prefetcher
from llmgw.agent.runnerdeps import RunnerDeps
from llmgw.agent.weights import WeightsCache
from llmgw.control.adapters import AdapterIndex, prefetch_for
from llmgw.control.state import FleetState, ModelRecord, ReplicaRecord
from llmgw.wire import ModelSpec, ReplicaState, ShardAssignment, WeightsSource

HF = {"kind": "hf", "repo": "acme/lora", "revision": "abc"}


def fleet() -> FleetState:
    state = FleetState()
    specs = [
        ModelSpec(name="base", engine="sim", sim={"max_loras": 2}),
        ModelSpec(name="other", engine="sim", sim={"max_loras": 2}),
        ModelSpec(name="ad-old", engine="sim", base="base", weights=HF),
        ModelSpec(name="ad-new", engine="sim", base="base", weights=HF),
        ModelSpec(name="ad-bare", engine="sim", base="base"),  # no weights to fetch
        ModelSpec(name="ad-other", engine="sim", base="other", weights=HF),
    ]
    for spec in specs:
        state.models[spec.name] = ModelRecord(spec=spec, created_at=0, updated_at=0)
    state.models["ad-old"].demand_at = 10.0
    state.models["ad-new"].demand_at = 20.0
    state.replicas["r1"] = ReplicaRecord(id="r1", model="base", created_at=0,
                                         state=ReplicaState.READY,
                                         shards=[ShardAssignment(node="n1")])  # fmt: skip
    return state


def test_a_node_is_told_the_adapters_of_the_bases_it_runs_most_recent_first() -> None:
    state, index = fleet(), AdapterIndex()
    assert [s.name for s in prefetch_for(state, "n1", index)] == ["ad-new", "ad-old"]
    assert prefetch_for(state, "n2", index) == []  # runs no base
    state.replicas["r1"].state = ReplicaState.FAILED
    assert prefetch_for(state, "n1", index) == []


async def test_the_adapter_index_follows_the_catalog_and_not_routing() -> None:
    state, index = fleet(), AdapterIndex()
    built = index.of(state)
    # A node turning unreachable or back moves the routing version: the
    # catalog did not change, so the index is not walked again.
    await state.bump_routing()
    assert index.of(state) is built
    added = ModelSpec(name="ad-added", engine="sim", base="base", weights=HF)
    state.models[added.name] = ModelRecord(spec=added, created_at=0, updated_at=0)
    assert [s.name for s in prefetch_for(state, "n1", index)] == ["ad-new", "ad-old", "ad-added"]
    # A spec replaced with its record written again (services.catalog).
    record = state.models["ad-old"]
    record.spec = record.spec.model_copy(update={"weights": WeightsSource()})
    state.models["ad-old"] = record
    assert [s.name for s in prefetch_for(state, "n1", index)] == ["ad-new", "ad-added"]
    del state.models["ad-new"]
    assert [s.name for s in prefetch_for(state, "n1", index)] == ["ad-added"]
    # A whole catalog put in the table's place (a plain dict): read afresh.
    state.models = {"base": state.models["base"]}
    assert prefetch_for(state, "n1", index) == []


def deps_with(cache: WeightsCache, session: aiohttp.ClientSession) -> RunnerDeps:
    # fetch_weights reads only the cache, the peers, the peer token and the sessions.
    fields: dict[str, Any] = {"weights": cache, "session": session, "peer_session": None,
                              "peers": lambda _name: [], "peer_token": lambda: None}
    return cast(RunnerDeps, SimpleNamespace(**fields))


async def test_the_agent_fetches_each_listed_adapter_once_in_the_background(
    tmp_path: Path, fake_package: str
) -> None:
    cache = WeightsCache(tmp_path / "w")
    adapter = ModelSpec(name="ad-pkg", engine="sim", base="base",
                        weights=WeightsSource.model_validate(package_source(fake_package)))
    prefetch = Prefetcher()
    async with aiohttp.ClientSession() as session:
        deps = deps_with(cache, session)
        assert cache.lookup(adapter) is None
        prefetch.want([adapter], deps)
        for _ in range(200):
            if cache.lookup(adapter) is not None:
                break
            await asyncio.sleep(0.02)
        assert cache.lookup(adapter) is not None  # on disk before any load asked for it
        assert [e.model for e in cache.report()] == ["ad-pkg"]
        await prefetch.close()
        prefetch.want([adapter], deps)  # fetched already: nothing to do
        assert prefetch._task is None or prefetch._task.done()
