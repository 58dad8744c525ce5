"""Every engine is started with its replica's key, off its command line, and probed with it."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import aiohttp
import psutil
import pytest
import yaml
from tests.agent.conftest import AgentFactory, WatchLog
from tests.agent.fakes import FakeControlPlane
from tests.agent.helpers import assign, cpu_slot, gpu, model
from tests.agent.test_engines import ctx
from tests.agent.test_liveness import FAST
from tests.agent.test_supervisor import wait_for_log
from tests.waiting import eventually

from llmgw.agent.engines import LlamaCppAdapter, SglangAdapter, SimAdapter, VllmAdapter
from llmgw.agent.engines.base import EngineLaunch, LaunchContext, SecretFile
from llmgw.agent.supervisor import Supervisor, engine_environment
from llmgw.errors import EngineError
from llmgw.wire import EngineKind, ReplicaAssignment, ReplicaState, SimParams, WeightsSource

KEY = "engine-key-0123456789abcdefghijklmnopqrstu"


def keyed(a: ReplicaAssignment) -> ReplicaAssignment:
    return a.model_copy(update={"engine_key": KEY})


def no_key_in_argv(launch: EngineLaunch) -> None:
    assert all(KEY not in item for item in launch.argv), launch.argv


@pytest.mark.parametrize(
    ("adapter", "variable"),
    [(LlamaCppAdapter(server_binary="llama-server"), "LLAMA_API_KEY"),
     (LlamaCppAdapter(server_binary=""), "API_KEY"),
     (VllmAdapter(executable="vllm"), "VLLM_API_KEY"),
     (SimAdapter(), "LLMGW_ENGINE_KEY")],
)  # fmt: skip
def test_the_key_goes_to_the_engine_in_its_environment(
    adapter: LlamaCppAdapter | VllmAdapter | SimAdapter, variable: str
) -> None:
    d = [cpu_slot(0)] if adapter.kind in (EngineKind.LLAMACPP, EngineKind.SIM) else [gpu(0)]
    spec = model(adapter.kind.value, gpu_classes=[d[0].gpu_class])
    if adapter.kind == EngineKind.SIM:
        spec = spec.model_copy(update={"weights": WeightsSource(kind="none")})
    launch = adapter.build(ctx(keyed(assign(spec, d)), d))
    assert launch.env[variable] == KEY
    no_key_in_argv(launch)
    # What the engine finally gets: the key, whatever the agent inherited.
    assert engine_environment(launch.env, launch.drop_env)[variable] == KEY
    # Without a key (an assignment from before engine keys) there is none to
    # read, not even one the agent happens to have in its own environment.
    bare = adapter.build(ctx(assign(spec, d), d))
    assert variable not in bare.env
    if adapter.kind != EngineKind.SIM:  # the agent's LLMGW_* never reach an engine
        assert variable.upper() in bare.drop_env


def test_sglang_reads_it_from_a_config_file_on_the_rank_that_serves() -> None:
    d = [gpu(0)]
    launch = SglangAdapter(executable="sglang").build(ctx(keyed(assign(model("sglang"), d)), d))
    no_key_in_argv(launch)
    assert launch.secret_file is not None and launch.secret_file.flag == "--config"
    # SGLang's --config turns each YAML key into its flag: api-key -> --api-key.
    assert yaml.safe_load(launch.secret_file.text) == {"api-key": KEY}
    assert KEY not in repr(launch)
    two = model("sglang", nodes=2, tp=2)
    rank1 = keyed(assign(two, d, rank=1, leader="10.0.0.1:5000"))
    assert SglangAdapter(executable="sglang").build(ctx(rank1, d)).secret_file is None


async def test_the_supervisor_passes_a_secret_file_never_the_secret(tmp_path: Path) -> None:
    script = (
        "import sys, os, stat, time; path = sys.argv[-1];"
        " print('flag', sys.argv[-2], 'mode', oct(stat.S_IMODE(os.stat(path).st_mode)),"
        " 'text', open(path).read().strip(), flush=True); time.sleep(30)"
    )
    launch = EngineLaunch(
        argv=[sys.executable, "-c", script], secret_file=SecretFile("--config", f"api-key: {KEY}")
    )
    sup = Supervisor(tmp_path / "logs")
    proc = sup.spawn("r1", launch)
    try:
        tail = await wait_for_log(sup, "r1", "flag")
        assert tail == [f"flag --config mode 0o600 text api-key: {KEY}"]
        assert KEY not in " ".join(psutil.Process(proc.pid).cmdline())
    finally:
        await sup.stop(proc, 5.0)


@pytest.mark.parametrize(
    ("adapter", "args"),
    [(LlamaCppAdapter(server_binary="llama-server"), ["--api-key", "x"]),
     (LlamaCppAdapter(server_binary="llama-server"), ["--api_key_file=/k"]),
     (LlamaCppAdapter(server_binary=""), ["--api_key", "x"]),
     (LlamaCppAdapter(server_binary=""), ["--api", "x"]),
     (VllmAdapter(executable="vllm"), ["--api-key", "x"]),
     (SglangAdapter(executable="sglang"), ["--api-k=x"])],
)  # fmt: skip
def test_a_catalog_cannot_set_the_key_flag(
    adapter: LlamaCppAdapter | VllmAdapter | SglangAdapter, args: list[str]
) -> None:
    d = [cpu_slot(0)] if adapter.kind == EngineKind.LLAMACPP else [gpu(0)]
    spec = model(adapter.kind.value, gpu_classes=[d[0].gpu_class], engine_args=args)
    with pytest.raises(EngineError, match="manages"):
        adapter.validate(assign(spec, d))


class GuardedProbes(SimAdapter):
    """The sim with readiness and liveness on a route that needs the key
    (as llama_cpp.server's /v1/models): an agent probing without it would never
    see the engine ready, and would fail it once it serves."""

    def build(self, ctx: LaunchContext) -> EngineLaunch:
        return dataclasses.replace(
            super().build(ctx), health_path="/v1/models", liveness_path="/v1/models"
        )


async def test_the_agent_probes_with_the_key_and_the_engine_refuses_others(
    fake_cp: FakeControlPlane, make_agent: AgentFactory, watch_log: WatchLog
) -> None:
    make_agent("n1", adapters={EngineKind.SIM: GuardedProbes()}, liveness=FAST)
    spec = model("sim", name="sim-model", weights=WeightsSource(kind="none"),
                 gpu_classes=["cpu"], start_timeout_s=30)  # fmt: skip
    spec = spec.model_copy(update={"sim": SimParams(startup_s=0.0)})
    fake_cp.assignments["n1"] = [keyed(assign(spec, [cpu_slot(0)]))]
    ready = await fake_cp.wait_state("r1", ReplicaState.READY, within=30)
    base = f"http://127.0.0.1:{ready.port}"
    async with aiohttp.ClientSession() as session:
        for headers in ({}, {"Authorization": "Bearer not-the-key"}):
            async with session.get(f"{base}/v1/models", headers=headers) as resp:
                assert resp.status == 401
        async with session.get(f"{base}/v1/models",
                               headers={"Authorization": f"Bearer {KEY}"}) as resp:  # fmt: skip
            assert resp.status == 200
    # Liveness probes /v1/models every 0.1 s and fails the replica after 1.5 s
    # of refusals: probed and answered for well after that, and still ready.
    since = time.monotonic()
    await eventually(
        lambda: WatchLog.spans(watch_log.probes, since, 2.5), what="probes over 2.5 s"
    )
    assert set(WatchLog.since(watch_log.probes, since)) == {None}
    report = await fake_cp.wait_for(lambda r: True)
    (status,) = report.replicas
    assert status.state == ReplicaState.READY and status.reason is None
    assert status.pid == ready.pid
