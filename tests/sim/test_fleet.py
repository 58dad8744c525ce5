"""The simulated fleet: spec checks, inventories, in-process engines, and real agents
against a real control plane (uvicorn on loopback, SQLite in tmp) and a real gateway."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import openai
import pytest
from tests.control.planekit import Plane, opened_plane
from tests.servers import child_process, serve_asgi, terminates_cleanly
from tests.waiting import eventually

from llmgw.agent.engines.base import EngineLaunch, LaunchContext
from llmgw.agent.engines.sim import SimAdapter
from llmgw.control.app import create_app
from llmgw.control.catalog import validate_catalog
from llmgw.control.runtime import ControlPlaneRuntime
from llmgw.errors import AuthError, EngineError, ValidationError
from llmgw.gateway.app import Gateway
from llmgw.gateway.link import HttpControlPlaneLink
from llmgw.gateway.settings import GatewaySettings
from llmgw.sim.fleet import Fleet, apply_models, load_fleet_spec, start_fleet
from llmgw.sim.fleetspec import parse_fleet_spec
from llmgw.sim.inprocess import InProcessEngines, parse_launch
from llmgw.sim.inventory import fleet_nodes
from llmgw.wire import (
    ModelSpec,
    ReplicaAssignment,
    ReplicaState,
    ShardAssignment,
    SimParams,
    device_label,
    mig_number,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


# -- the spec --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fleet-small.yaml", "fleet-demo.yaml"])
def test_examples_parse_and_their_models_pass_the_catalog_rules(name: str) -> None:
    spec = load_fleet_spec(EXAMPLES / name)
    assert spec.models
    validate_catalog(spec.models)
    assert len(list(fleet_nodes(spec))) == spec.node_count


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("nodes: []", "nodes: List should have at least 1 item"),
        ("nodes: [{count: 0, class: h100-80g}]", "nodes[0].count: Input should be greater"),
        ("nodes: [{count: 1, class: h100-80g, unhealty: 1}]", "nodes[0].unhealty: Extra inputs"),
        ("nodes: [{count: 1, class: H100}]", "nodes[0].class: 'H100' is not a GPU class"),
        (
            "nodes: [{count: 1, class: h100-80g, gpus: 8, mig: {cards: 9}}]",
            "nodes[0]: mig.cards: 9 cards in MIG mode but the node has 8 gpus",
        ),
        (
            "nodes: [{count: 1, class: h100-80g, mig: {cards: 1, profile: big}}]",
            "nodes[0].mig.profile: 'big' is not a MIG profile",
        ),
        (
            "nodes: [{count: 1, class: h100-80g, mig: {cards: 1, instances: 8}}]",
            "nodes[0].mig.instances: Input should be less than or equal to 7",
        ),
        ("nodes: [{count: 1, class: h100-80g, gpus: 2, unhealthy: 3}]", "unhealthy: 3 but"),
        ("nodes: [{count: 1, class: gpu}]", "class 'gpu' names no memory size"),
        ("nodes: [{count: 1, class: cpu, mig: {cards: 1}}]", "a cpu node has no GPUs"),
        (
            "fabrics: [ib-a]\nnodes: [{count: 1, class: cpu, fabric: ib-z}]",
            "nodes[0].fabric: 'ib-z' is not in fabrics (ib-a)",
        ),
        (
            "nodes: [{count: 1, class: cpu}]\nmodels: [{name: m, engine: vllm}]",
            "models[0].engine: the simulated fleet runs only sim engines, not 'vllm'",
        ),
        (
            "nodes: [{count: 1, class: cpu}]\nmodels: [{name: m, engine: sim, gpus: 0}]",
            "models[0].gpus: Input should be greater than or equal to 1",
        ),
        ("nodes: {count: 1}", "nodes: Input should be a valid list"),
        ("- just a list", "expected a mapping with a `nodes:` list"),
        ("nodes: [", "not valid YAML"),
    ],
)
def test_spec_errors_name_the_field(text: str, expected: str) -> None:
    with pytest.raises(ValidationError) as caught:
        parse_fleet_spec(text, source="fleet.yaml")
    message = str(caught.value)
    assert message.startswith("fleet.yaml: ")
    assert expected in message, message


def test_missing_spec_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"cannot read fleet spec .*nope\.yaml"):
        load_fleet_spec(tmp_path / "nope.yaml")


# -- inventories ----------------------------------------------------------------


def test_inventory_has_mig_instances_unhealthy_cards_and_an_uncarved_card() -> None:
    spec = parse_fleet_spec(
        """
fabrics: [ib-a, ib-b]
nodes:
  - {count: 2, class: h100-80g, gpus: 4, fabric: ib-a,
     mig: {cards: 2, profile: 3g.40gb, instances: 2}, unhealthy: 1}
  - {name: empty, count: 1, class: a100-80g, gpus: 2, fabric: ib-b,
     mig: {cards: 1, profile: 1g.10gb, instances: 0}}
  - {count: 1, class: cpu, cpu_slots: 3, fabrics: [ib-a, ib-b]}
"""
    )
    nodes = list(fleet_nodes(spec))
    assert [n.name for n in nodes] == ["h100-80g-000", "h100-80g-001", "empty-000", "cpu-000"]
    first = nodes[0]
    assert first.fabrics == ["ib-a"]
    devices = {d.label: d for d in first.inventory.devices}
    assert list(devices) == ["0/mig0", "0/mig1", "1/mig0", "1/mig1", "2", "3"]
    mig = devices["1/mig1"]
    assert mig.number == mig_number(1, 1) and device_label(mig.number) == "1/mig1"
    assert mig.gpu_class == "h100-80g-mig-3g.40gb"
    assert mig.utilization_pct is None and mig.mig is not None and mig.mig.parent_index == 1
    assert devices["2"].gpu_class == "h100-80g" and devices["2"].healthy
    assert not devices["3"].healthy and "uncorrectable ECC" in devices["3"].unhealthy_reasons[0]
    # Same names and UUIDs on every build: a restarted fleet is the same nodes.
    again = next(iter(fleet_nodes(spec)))
    assert [d.uuid for d in again.inventory.devices] == [d.uuid for d in first.inventory.devices]
    assert len({d.uuid for n in nodes for d in n.inventory.devices}) == sum(
        len(n.inventory.devices) for n in nodes
    )
    uncarved = nodes[2].inventory.devices[0]
    assert uncarved.label == "0" and not uncarved.placeable
    assert "no instances are carved" in (uncarved.unplaceable_reason or "")
    cpu = nodes[3]
    assert [d.gpu_class for d in cpu.inventory.devices] == ["cpu"] * 3
    assert cpu.fabrics == ["ib-a", "ib-b"]


# -- in-process engines ---------------------------------------------------------


def _launch(port: int = 0, key: str | None = None, **sim: object) -> EngineLaunch:
    assignment = ReplicaAssignment(
        replica_id="r1",
        model=ModelSpec(name="m", engine="sim", sim=SimParams(startup_s=0.0, **sim)),
        shard=ShardAssignment(node="n", device_numbers=[0]),
        engine_key=key,
    )
    return SimAdapter().build(
        LaunchContext(assignment=assignment, weights_path=None, host="127.0.0.1", port=port)
    )


def test_parse_launch_reads_the_adapters_argv_and_refuses_other_engines() -> None:
    args = parse_launch(_launch(port=12345, kv_blocks=77))
    assert (args.host, args.model, args.port) == ("127.0.0.1", "m", 12345)
    assert SimParams.model_validate_json(args.params_json).kv_blocks == 77
    with pytest.raises(EngineError, match="only sim engines"):
        parse_launch(EngineLaunch(argv=["vllm", "serve", "x"]))
    with pytest.raises(EngineError, match="takes no arguments"):
        parse_launch(EngineLaunch(argv=[*_launch().argv, "--weird", "1"]))


async def test_in_process_engine_serves_then_stops() -> None:
    engines = InProcessEngines()
    proc = engines.spawn("r1", _launch())
    engine = engines.engines()[0]
    assert await engine.wait_ready()
    assert engines.poll(proc).exited is False
    assert any("listening on" in line for line in engines.log_tail("r1"))
    assert engines.adopt(proc.pid, proc.birth) is None
    status = await engines.stop(proc, grace_s=1.0)
    assert status.exited and status.code == 0
    assert engine.state == "stopped" and not engines.engines()


async def test_in_process_engine_refuses_calls_without_its_key() -> None:
    key = "engine-key-inprocess-0123456789abcdefghijklm"
    engines = InProcessEngines()
    proc = engines.spawn("r1", _launch(key=key))
    engine = engines.engines()[0]
    assert await engine.wait_ready()
    for given, answer in ((None, 401), ("Bearer wrong", 401), (f"Bearer {key}", 200)):
        headers = {"Authorization": given} if given else {}
        async with aiohttp.ClientSession() as session, session.get(
            f"{engine.url}/v1/models", headers=headers
        ) as resp:
            assert resp.status == answer, given
    await engines.stop(proc, grace_s=0.0)


async def test_in_process_engine_failing_at_start_exits_1() -> None:
    engines = InProcessEngines()
    proc = engines.spawn("r1", _launch(fault="fail_at_start"))
    assert not await engines.engines()[0].wait_ready()
    status = engines.poll(proc)
    assert status.exited and status.code == 1
    assert "fail_at_start" in engines.log_tail("r1")[-1]
    await engines.stop(proc, grace_s=0.0)


async def test_in_process_engine_on_a_taken_port_exits_1() -> None:
    engines = InProcessEngines()
    first = engines.spawn("r1", _launch())
    await engines.engines()[0].wait_ready()
    taken = engines.engines()[0].port
    assert taken is not None
    second = engines.spawn("r2", _launch(port=taken))
    await eventually(lambda: engines.poll(second).exited, 1, what="engines.poll(second).exited")
    assert engines.poll(second).code == 1
    assert "cannot listen" in engines.log_tail("r2")[-1]
    await engines.stop_all()
    assert engines.poll(first).exited


# -- against a real control plane ----------------------------------------------------


@asynccontextmanager
async def control_plane(tmp_path: Path) -> AsyncIterator[Plane]:
    """``llmgw serve``'s control plane: store, runtime (reconciler), HTTP app on loopback."""
    async with opened_plane(tmp_path) as (cp, creds):
        # serve --trust-reported-fabrics: the fleet spec's fabrics are the operator's.
        cp.trust_reported_fabrics = True
        runtime = ControlPlaneRuntime(cp, reconcile_interval_s=0.3)
        await runtime.start()
        try:
            # Leadership reloads the state from the store; wait for it so that a
            # test never reads the state halfway through that reload.
            await eventually(
                lambda: runtime.is_leader and runtime.passes, 10,
                what="a leading control plane's first pass",
            )
            assert runtime.is_leader
            async with serve_asgi(create_app(cp)) as url:
                yield Plane(cp, creds, url)
        finally:
            await runtime.stop()


BIG_FLEET = """
fabrics: [ib-a, ib-b]
nodes:
  - {count: 120, class: h100-80g, gpus: 8, fabric: ib-a,
     mig: {cards: 2, profile: 3g.40gb, instances: 2}, unhealthy: 1}
  - {count: 60, class: a100-80g, gpus: 8, fabric: ib-b}
  - {count: 20, class: l4-24g, gpus: 4, fabric: ib-b,
     mig: {cards: 1, profile: 1g.6gb, instances: 0}}
"""


async def test_200_nodes_register_with_a_real_control_plane_within_a_minute(
    tmp_path: Path,
) -> None:
    async with control_plane(tmp_path) as plane:
        spec = parse_fleet_spec(BIG_FLEET)
        started = time.monotonic()
        fleet = await start_fleet(spec, plane.url, plane.creds.join_token, tmp_path / "sim")
        try:
            took = await fleet.wait_registered(timeout_s=60.0)
            elapsed = time.monotonic() - started
            print(f"\n200 simulated nodes registered in {elapsed:.1f} s")
            assert elapsed < 60.0 and took <= elapsed
            nodes = plane.cp.state.nodes
            assert len(nodes) == 200
            h100 = nodes["h100-80g-000"]
            assert h100.fabrics == ["ib-a"]
            assert h100.inventory is not None
            classes = [d.gpu_class for d in h100.inventory.devices]
            assert classes.count("h100-80g-mig-3g.40gb") == 4 and classes.count("h100-80g") == 6
            assert sum(not d.healthy for d in h100.inventory.devices) == 1
            l4 = nodes["l4-24g-019"].inventory
            assert l4 is not None and not l4.devices[0].placeable
            # The first reports were spread out, not sent in one burst: the
            # control plane saw them over more than a second.
            seen = sorted(n.registered_at for n in nodes.values())
            assert seen[-1] - seen[0] > 1.0
        finally:
            await fleet.shutdown()
        assert all(task.done() for task in fleet._tasks)


SMALL_FLEET = """
fabrics: [ib-a]
nodes:
  - {count: 2, class: l4-24g, gpus: 2, fabric: ib-a, unhealthy: 1}
models:
  - name: sim-small
    engine: sim
    gpu_classes: [l4-24g]
    min_replicas: 2
    max_replicas: 2
    sim: {startup_s: 0.2, decode_ms_per_token: 1}
"""


async def wait_ready_replicas(fleet: Fleet, count: int, timeout_s: float) -> dict[str, str]:
    def enough() -> dict[str, str] | None:
        states = fleet.replica_states()
        ready = sum(s == ReplicaState.READY.value for s in states.values())
        return states if ready >= count else None

    return await eventually(enough, timeout_s, what=f"{count} ready replicas", every_s=0.1,
                            note=fleet.replica_states)  # fmt: skip


@asynccontextmanager
async def gateway_for(plane: Plane) -> AsyncIterator[tuple[Gateway, str]]:
    assert plane.creds.gateway_token
    link = HttpControlPlaneLink(plane.url, plane.creds.gateway_token)
    gateway = Gateway(link, GatewaySettings(load_report_s=0.5, usage_flush_s=0.5))
    await gateway.start()
    try:
        assert await gateway.wait_configured(30)  # start() does not wait for it
        async with serve_asgi(gateway.asgi) as url:
            yield gateway, url
    finally:
        await gateway.stop()
        await link.close()
        # The control plane holds the gateway's long poll open for ~25 s even
        # after the gateway left; a new routing version answers it now, so the
        # server can stop without waiting that out.
        await plane.cp.state.bump_routing()


async def wait_endpoints(gateway: Gateway, model: str, count: int, timeout_s: float) -> None:
    def learnt() -> bool:
        snapshot = gateway.snapshot
        router = snapshot.routes.get(model) if snapshot is not None else None
        return router is not None and len(router.replicas) >= count

    await eventually(learnt, timeout_s, what=f"the gateway learning {count} endpoints of {model}",
                     every_s=0.1)  # fmt: skip


@pytest.mark.parametrize("engines", ["inprocess", "subprocess"])
async def test_small_fleet_places_replicas_and_serves_through_the_gateway(
    tmp_path: Path, engines: str
) -> None:
    async with control_plane(tmp_path) as plane:
        fleet = await start_fleet(
            parse_fleet_spec(SMALL_FLEET),
            plane.url,
            plane.creds.join_token,
            tmp_path / "sim",
            engines="inprocess" if engines == "inprocess" else "subprocess",
            admin_token=plane.creds.admin_token,
        )
        try:
            # The models went through the admin API.
            assert "sim-small" in plane.cp.state.models
            await fleet.wait_registered(timeout_s=20.0)
            states = await wait_ready_replicas(fleet, 2, timeout_s=30.0)
            assert len(states) == 2
            placed = [
                shard for replica in plane.cp.state.replicas.values() for shard in replica.shards
            ]
            # Never on the unhealthy card (the last of each node).
            assert all(1 not in s.device_numbers for s in placed), placed
            if engines == "inprocess":
                assert len(fleet.sim_engines()) == 2
            else:
                assert fleet.sim_engines() == []
            async with gateway_for(plane) as (gateway, url):
                await wait_endpoints(gateway, "sim-small", 2, timeout_s=15.0)
                client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=plane.creds.api_key)
                try:
                    reply = await client.chat.completions.create(
                        model="sim-small",
                        messages=[{"role": "user", "content": "hello fleet"}],
                        max_tokens=5,
                    )
                    stream = await client.chat.completions.create(
                        model="sim-small",
                        messages=[{"role": "user", "content": "hello again"}],
                        max_tokens=4,
                        stream=True,
                    )
                    pieces = [c.choices[0].delta.content async for c in stream if c.choices]
                finally:
                    await client.close()
            assert reply.usage is not None and reply.usage.completion_tokens == 5
            assert "".join(p or "" for p in pieces).strip()
            if engines == "inprocess":
                served = sum(e.core.counters.finished for e in fleet.sim_engines())
                assert served == 2
        finally:
            await fleet.shutdown()
        assert fleet.sim_engines() == []


async def test_models_need_a_valid_admin_token(tmp_path: Path) -> None:
    async with control_plane(tmp_path) as plane:
        spec = parse_fleet_spec(SMALL_FLEET)
        with pytest.raises(AuthError, match="admin token"):
            await apply_models(plane.url, "llmgw-admin-wrong", spec.models)
        bad = [ModelSpec(name="m", engine="sim", gpu_classes=["a100-80g-mig-3g.40gb"], tp=2)]
        with pytest.raises(ValidationError, match="refused the fleet's models"):
            assert plane.creds.admin_token
            await apply_models(plane.url, plane.creds.admin_token, bad)


async def test_a_refused_join_token_is_reported(tmp_path: Path) -> None:
    async with control_plane(tmp_path) as plane:
        spec = parse_fleet_spec("nodes: [{count: 2, class: cpu}]")
        fleet = await start_fleet(spec, plane.url, "llmgw-join-wrong", tmp_path / "sim")
        try:
            with pytest.raises(Exception, match="refused the join token"):
                await fleet.wait_registered(timeout_s=10.0)
        finally:
            await fleet.shutdown()


# -- llmgw sim fleet ------------------------------------------------------------------


def test_cli_refuses_a_bad_spec_naming_the_field(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from llmgw.cli.sim import app

    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [{count: 2, class: h100-80g, gpus: 2, unhealthy: 5}]\n")
    result = CliRunner().invoke(app, ["fleet", str(bad), "--control-plane", "http://127.0.0.1:9"])
    assert result.exit_code == 2
    assert "bad.yaml: nodes[0]: unhealthy: 5 but the node has 2 gpus" in result.output
    models = EXAMPLES / "fleet-small.yaml"
    result = CliRunner().invoke(
        app,
        ["fleet", str(models), "--control-plane", "http://127.0.0.1:9"],
        env={"LLMGW_ADMIN_TOKEN": ""},
    )
    assert result.exit_code == 2 and "--admin-token" in result.output


async def test_cli_runs_a_fleet_until_sigterm(tmp_path: Path) -> None:
    spec = tmp_path / "fleet.yaml"
    spec.write_text("nodes: [{count: 3, class: l4-24g, gpus: 1}]\n")
    async with control_plane(tmp_path) as plane:
        assert plane.creds.join_token
        async with child_process(
            sys.executable, "-m", "llmgw.cli.main", "sim", "fleet", str(spec),
            "--control-plane", plane.url, "--join-token", plane.creds.join_token,
            "--data-dir", str(tmp_path / "fleet"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        ) as proc:  # fmt: skip
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
            assert b"3 nodes registered" in line, line
            assert sorted(plane.cp.state.nodes) == ["l4-24g-000", "l4-24g-001", "l4-24g-002"]
            await terminates_cleanly(proc)
