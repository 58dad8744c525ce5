"""agent.loras against a simulated engine on loopback: loads, refusals, unloads, sleep."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web
from tests.agent.fakes import serve_app

from llmgw.agent.engineprobe import EngineEndpoint
from llmgw.agent.loras import EngineControl, start_adapters
from llmgw.sim.engine import SimEngine
from llmgw.wire import (
    ModelSpec,
    ReplicaAssignment,
    ReplicaState,
    ReplicaStatus,
    ShardAssignment,
    SimParams,
)

BASE = ModelSpec(name="base", engine="sim", sim={"max_loras": 2, "max_lora_rank": 8,
                                                 "lora_load_s": 0, "sleep_s": 0})  # fmt: skip


@pytest.fixture
async def engine() -> AsyncIterator[SimEngine]:
    sim = SimEngine("base", SimParams(startup_s=0, max_loras=2, max_lora_rank=8, lora_load_s=0,
                                      sleep_s=0, wake_s=0), api_key="k" * 32)  # fmt: skip
    await sim.start("127.0.0.1", 0)
    assert await sim.wait_ready()
    yield sim
    await sim.stop()


def assignment(*adapters: ModelSpec, asleep: bool = False) -> ReplicaAssignment:
    return ReplicaAssignment(replica_id="r1", model=BASE, shard=ShardAssignment(node="n"),
                             adapters=list(adapters), asleep=asleep)  # fmt: skip


def adapter(name: str) -> ModelSpec:
    return ModelSpec(name=name, engine="sim", base="base")


async def test_loads_unloads_refusals_and_sleep_through_the_engines_routes(
    engine: SimEngine, tmp_path: Path
) -> None:
    big = tmp_path / "big"
    big.mkdir()
    (big / "adapter_config.json").write_text(json.dumps({"r": 16}))
    paths = {"too-big": str(big)}
    released: list[str] = []

    async def fetch(spec: ModelSpec) -> tuple[str | None, str | None]:
        return paths.get(spec.name, f"/x/{spec.name}"), f"hold-{spec.name}"

    control = EngineControl("r1")
    async with aiohttp.ClientSession() as session:
        endpoint = EngineEndpoint(session, "127.0.0.1", engine.port, key="k" * 32)

        async def converge(wanted: ReplicaAssignment) -> None:
            while await control.converge(wanted, endpoint, fetch, released.append):
                pass

        await converge(assignment(adapter("a"), adapter("b")))
        assert set(control.loaded) == {"a", "b"} == set(engine.lora.loaded)
        # b out, too-big in: the engine refuses its rank; the refusal is reported, not retried.
        await converge(assignment(adapter("a"), adapter("too-big")))
        assert set(engine.lora.loaded) == {"a"}
        assert released == ["hold-b", "hold-too-big"]  # unloaded, and refused: not held
        assert "max_lora_rank 8" in control.reported_errors()["too-big"]
        assert not await control.converge(assignment(adapter("a"), adapter("too-big")),
                                          endpoint, fetch, released.append)  # fmt: skip
        await converge(assignment(adapter("a"), asleep=True))
        assert control.sleeping and engine.lora.sleeping
        await converge(assignment(adapter("a")))
        assert not control.sleeping and not engine.lora.sleeping
        assert set(engine.lora.loaded) == {"a"}  # adapters stay loaded through a sleep


async def test_an_engine_started_with_its_adapters_keeps_them_and_reports_later_ones() -> None:
    # llama-server takes adapters only at its start: no load or unload is
    # called on it, only its default scales are set to 0 once.
    posted: list[tuple[str, object]] = []

    async def record(request: web.Request) -> web.Response:
        posted.append((request.path, await request.json()))
        return web.json_response({"success": True})

    app = web.Application()
    app.router.add_post("/{tail:.*}", record)
    released: list[str] = []

    async def fetch(spec: ModelSpec) -> tuple[str | None, str | None]:
        raise AssertionError("an engine with a fixed set loads nothing")

    control = EngineControl("r1")
    control.started_with({"a": "hold-a", "b": None})
    async with serve_app(app) as url, aiohttp.ClientSession() as session:
        engine = EngineEndpoint(session, "127.0.0.1", int(url.rsplit(":", 1)[1]), key="k" * 32)

        async def step(*names: str) -> bool:
            wanted = assignment(*(adapter(n) for n in names))
            return await control.converge(wanted, engine, fetch, released.append)

        assert await step("a", "c")
        status = control.report(ReplicaStatus(replica_id="r1", state=ReplicaState.READY))
        assert status.adapters == ["a", "b"]
        assert list(status.adapter_errors) == ["c"]
        assert "only at its start" in status.adapter_errors["c"]
        assert not await step("a", "c")  # settled
        assert await step("a")  # c left the catalog: its error goes
        assert control.reported_errors() == {}
    assert posted == [("/lora-adapters", [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}])]
    control.release_all(released.append)
    assert released == ["hold-a"] and control.loaded == {}


async def test_an_adapter_whose_weights_cannot_be_had_is_left_out_of_the_start() -> None:
    # One broken catalog entry must not keep the base (and the other adapters) from serving.
    class Weights:
        released: list[str] = []

        def hold(self, spec: ModelSpec) -> str:
            return f"hold-{spec.name}"

        def release(self, key: str) -> None:
            self.released.append(key)

        async def ensure(self, spec: ModelSpec, **_: object) -> str:
            if spec.name == "broken":
                raise ValueError("digest mismatch")
            return f"/cache/{spec.name}.gguf"

    weights = Weights()
    deps = SimpleNamespace(weights=weights, peers=lambda _: [], peer_token=lambda: None,
                           peer_session=None, session=None)  # fmt: skip
    control = EngineControl("r1")
    started = await start_adapters(deps, control, [adapter("a"), adapter("broken")],  # type: ignore[arg-type]
                                   at_start=True)  # fmt: skip
    assert started == (("a", "/cache/a.gguf"),)
    assert control.fixed == frozenset({"a"}) and weights.released == ["hold-broken"]
    assert "digest mismatch" in control.reported_errors()["broken"]
    assert await start_adapters(deps, EngineControl("r2"), [adapter("a")], at_start=False) == ()  # type: ignore[arg-type]
