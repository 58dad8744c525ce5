"""The agent against a fake control plane: registration, convergence, failures, adoption."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import stat
import time
from pathlib import Path

import aiohttp
import psutil
import pytest
from tests.agent.conftest import AgentFactory, cpu_inventory
from tests.agent.fakes import FakeControlPlane
from tests.agent.helpers import assign, cpu_slot, model
from tests.agent.test_weights import plant
from tests.waiting import eventually

from llmgw.agent.engines.nodeenv import NodeEnvAllowed
from llmgw.errors import DiscoveryError
from llmgw.wire import ModelSpec, NodeInventory, ReplicaState, WeightsSource


def stub_model(
    name: str = "stub-model", args: list[str] | None = None, timeout: float = 30.0
) -> ModelSpec:
    return model(
        "sim",
        name=name,
        weights=WeightsSource(kind="none"),
        gpu_classes=["cpu"],
        engine_args=args or [],
        start_timeout_s=timeout,
    )


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def wait_dead(pid: int, within: float = 10.0) -> None:
    await eventually(lambda: not alive(pid), within, what=f"pid {pid} to end")


async def test_registers_once_and_keeps_the_token_private(
    fake_cp: FakeControlPlane, make_agent: AgentFactory, tmp_path: Path
) -> None:
    agent = make_agent("n1")
    report = await fake_cp.wait_for(lambda r: r.node == "n1")
    assert [d.label for d in report.inventory.devices] == ["cpu0", "cpu1", "cpu2", "cpu3"]
    assert report.agent_port is not None
    node_file = tmp_path / "n1" / "node.json"
    assert stat.S_IMODE(node_file.stat().st_mode) == 0o600
    await agent.shutdown()
    # A restart needs no join token: the node token on disk is enough.
    before = len(fake_cp.reports)
    make_agent("n1", join_token=None)
    await fake_cp.wait_for(lambda r: len(fake_cp.reports) > before + 1)
    assert fake_cp.registrations == 1


async def test_reports_ready_without_waiting_for_the_interval(
    fake_cp: FakeControlPlane, make_agent: AgentFactory
) -> None:
    fake_cp.interval = 30.0
    make_agent("n1")
    fake_cp.assign_one(stub_model())
    await fake_cp.wait_for(lambda r: True)
    began = time.monotonic()
    # The only report that carries the assignment's answer was the first;
    # the interval is 30 s, so a ready report within 10 s came from the change.
    status = await fake_cp.wait_state("r1", ReplicaState.READY, within=10)
    assert time.monotonic() - began < 10
    assert status.port and status.pid and status.ready_at
    assert any("stub engine" in line for line in status.log_tail)


async def test_generation_change_restarts_and_kill_makes_failed(
    fake_cp: FakeControlPlane, make_agent: AgentFactory
) -> None:
    make_agent("n1")
    fake_cp.assign_one(stub_model())
    first = await fake_cp.wait_state("r1", ReplicaState.READY)
    assert first.pid is not None

    fake_cp.assign_one(stub_model(), generation=2)
    second = await fake_cp.wait_for(
        lambda r: any(s.generation == 2 and s.state == ReplicaState.READY for s in r.replicas)
    )
    new = second.replicas[0]
    assert new.pid != first.pid
    await wait_dead(first.pid)  # the old generation was stopped

    assert new.pid is not None
    os.kill(new.pid, signal.SIGKILL)
    failed = await fake_cp.wait_state("r1", ReplicaState.FAILED)
    assert failed.exit_code == -signal.SIGKILL
    assert failed.reason and "SIGKILL" in failed.reason and "last output" in failed.reason
    assert failed.log_tail
    # Still assigned at the same generation: the agent does not restart it on
    # its own; the control plane decides (a new generation, below). Three more
    # reports (about a second) still say so.
    for _ in range(3):
        later = await fake_cp.wait_for(lambda r: True)
        assert later.replicas[0].state == ReplicaState.FAILED
    fake_cp.assign_one(stub_model(), generation=3)
    third = await fake_cp.wait_for(
        lambda r: any(s.generation == 3 and s.state == ReplicaState.READY for s in r.replicas)
    )
    assert third.replicas[0].pid not in (first.pid, new.pid)

    # Not asked for any more: stopped.
    fake_cp.assignments["n1"] = []
    await fake_cp.wait_for(lambda r: not r.replicas)
    last = third.replicas[0].pid
    assert last is not None
    await wait_dead(last)


async def test_engine_exit_reason_has_code_and_last_lines(
    fake_cp: FakeControlPlane, make_agent: AgentFactory
) -> None:
    make_agent("n1")
    fake_cp.assign_one(
        stub_model(args=["--ready-after", "30", "--exit-after", "0.3", "--exit-code", "7"])
    )
    failed = await fake_cp.wait_state("r1", ReplicaState.FAILED)
    assert failed.exit_code == 7
    assert failed.reason is not None
    assert "code 7" in failed.reason and "giving up with code 7" in failed.reason


async def test_start_timeout_stops_the_engine(
    fake_cp: FakeControlPlane, make_agent: AgentFactory
) -> None:
    make_agent("n1")
    fake_cp.assign_one(stub_model(args=["--ready-after", "60"], timeout=1.0))
    starting = await fake_cp.wait_state("r1", ReplicaState.STARTING)
    failed = await fake_cp.wait_state("r1", ReplicaState.FAILED)
    assert failed.reason and "start timeout" in failed.reason
    assert starting.pid is not None or failed.pid is not None
    pid = failed.pid or starting.pid
    assert pid is not None
    await wait_dead(pid)


async def test_malformed_assignments_are_refused_not_half_applied(
    fake_cp: FakeControlPlane, make_agent: AgentFactory
) -> None:
    make_agent("n1")
    good = assign(stub_model(), [cpu_slot(0)], replica_id="good")
    other_node = assign(stub_model(), [cpu_slot(1)], replica_id="elsewhere", node="n2")
    no_device = assign(stub_model(), [cpu_slot(9)], replica_id="nodev")
    clash = assign(stub_model(), [cpu_slot(0)], replica_id="zclash")
    bad_args = assign(stub_model(args=["--port", "1"]), [cpu_slot(2)], replica_id="badargs")
    vllm = assign(model("vllm", gpu_classes=["cpu"]), [cpu_slot(3)], replica_id="vllm")
    fake_cp.assignments["n1"] = [good, other_node, no_device, clash, bad_args, vllm]
    report = await fake_cp.wait_for(
        lambda r: len(r.refused) == 5 and any(s.replica_id == "good" for s in r.replicas)
    )
    assert "node 'n2'" in report.refused["elsewhere"]
    assert "device cpu9 is not on this node" in report.refused["nodev"]
    assert "also assigned to replica good" in report.refused["zclash"]
    assert "--port" in report.refused["badargs"]
    assert "not available" in report.refused["vllm"]
    assert [s.replica_id for s in report.replicas] == ["good"]
    await fake_cp.wait_state("good", ReplicaState.READY)


async def test_agent_restart_adopts_the_running_engine(
    fake_cp: FakeControlPlane, make_agent: AgentFactory, tmp_path: Path
) -> None:
    agent = make_agent("n1")
    fake_cp.assignments["n1"] = [
        assign(stub_model(), [cpu_slot(0)], replica_id="keep"),
        assign(stub_model(), [cpu_slot(1)], replica_id="dies"),
    ]
    report = await fake_cp.wait_for(
        lambda r: len(r.replicas) == 2 and all(s.state == ReplicaState.READY for s in r.replicas)
    )
    pids = {s.replica_id: s.pid for s in report.replicas}
    ports = {s.replica_id: s.port for s in report.replicas}
    # A client keeps calling the engine through the whole agent restart.
    answers: list[int] = []
    stop_calling = asyncio.Event()

    async def keep_calling() -> None:
        after_restart = 0  # and a few calls once the new agent runs
        async with aiohttp.ClientSession() as session:
            while after_restart < 5:
                async with session.get(f"http://127.0.0.1:{ports['keep']}/v1/models") as resp:
                    answers.append(resp.status)
                after_restart += stop_calling.is_set()
                await asyncio.sleep(0.02)

    caller = asyncio.create_task(keep_calling())
    await agent.shutdown(stop_engines=False)  # as if the agent died
    assert all(alive(pid) for pid in pids.values() if pid)
    dead = pids["dies"]
    assert dead is not None
    os.killpg(dead, signal.SIGKILL)
    await wait_dead(dead)

    before = len(fake_cp.reports)
    make_agent("n1", data_dir=tmp_path / "n1")
    first = await fake_cp.wait_for(lambda r: len(fake_cp.reports) > before)
    by_id = {s.replica_id: s for s in first.replicas}
    # The very first report after the restart already shows it ready, same
    # process, same port: the gateway never loses the endpoint.
    assert by_id["keep"].state == ReplicaState.READY
    assert by_id["keep"].pid == pids["keep"] and by_id["keep"].port == ports["keep"]
    assert by_id["dies"].state == ReplicaState.FAILED
    assert by_id["dies"].reason and "while the agent was away" in by_id["dies"].reason
    stop_calling.set()
    await caller
    assert set(answers) == {200}


async def test_an_engine_started_but_never_recorded_is_found_and_stopped(
    fake_cp: FakeControlPlane, make_agent: AgentFactory, tmp_path: Path
) -> None:
    # The agent writes a replica's record (port) before the spawn and its pid
    # after: an agent killed in between leaves a running engine that its
    # record does not name. The next agent must not leave it holding devices.
    agent = make_agent("n1")
    fake_cp.assign_one(stub_model())
    ready = await fake_cp.wait_state("r1", ReplicaState.READY)
    assert ready.pid is not None and alive(ready.pid)
    await agent.shutdown(stop_engines=False)
    state = tmp_path / "n1" / "engines.json"
    saved = json.loads(state.read_text())
    saved["engines"]["r1"].update(pid=None, birth=None, ready_at=None)
    state.write_text(json.dumps(saved))

    make_agent("n1", data_dir=tmp_path / "n1")
    failed = await fake_cp.wait_state("r1", ReplicaState.FAILED)
    assert failed.reason is not None and "while starting this engine" in failed.reason
    await wait_dead(ready.pid)


async def test_draining_is_reported(fake_cp: FakeControlPlane, make_agent: AgentFactory) -> None:
    make_agent("n1")
    fake_cp.assign_one(stub_model())
    ready = await fake_cp.wait_state("r1", ReplicaState.READY)
    draining = assign(stub_model(), [cpu_slot(0)])
    draining.draining = True
    fake_cp.assignments["n1"] = [draining]
    status = await fake_cp.wait_state("r1", ReplicaState.DRAINING)
    assert status.pid == ready.pid  # in-flight requests finish on the same engine


async def test_weights_come_from_a_peer_agent(
    fake_cp: FakeControlPlane, make_agent: AgentFactory, tmp_path: Path
) -> None:
    # The Hub is unreachable (a closed loopback port): only the peer can help.
    offline = "http://127.0.0.1:9"
    source = WeightsSource(kind="hf", repo="org/tiny", revision="abc", file="tiny.gguf")
    spec = model("sim", name="tiny", weights=source, gpu_classes=["cpu"])
    holder = make_agent("n1", hf_endpoint=offline)
    await fake_cp.wait_for(lambda r: r.node == "n1")
    plant(holder.weights, spec, b"weights" * 1000)
    make_agent("n2", hf_endpoint=offline)
    await fake_cp.wait_for(lambda r: r.node == "n2")
    assert holder.server is not None
    fake_cp.weight_peers = {"tiny": [f"http://127.0.0.1:{holder.server.port}"]}
    fake_cp.assignments["n2"] = [assign(spec, [cpu_slot(0)], node="n2")]
    await fake_cp.wait_state("r1", ReplicaState.READY)
    report = await fake_cp.wait_for(lambda r: r.node == "n2" and bool(r.weights))
    assert report.weights[0].model == "tiny" and report.weights[0].size_bytes == 7000


async def test_shutdown_stops_engines(fake_cp: FakeControlPlane, make_agent: AgentFactory) -> None:
    agent = make_agent("n1")
    fake_cp.assignments["n1"] = [
        assign(stub_model(args=["--ignore-term"]), [cpu_slot(0)], replica_id="stubborn"),
    ]
    status = await fake_cp.wait_state("stubborn", ReplicaState.READY)
    assert status.pid is not None
    began = time.monotonic()
    await agent.shutdown(stop_engines=True)
    assert not alive(status.pid)  # SIGKILL after the grace
    assert time.monotonic() - began >= 2.5  # it waited the grace (3 s) first


async def test_refused_node_token_registers_again(
    fake_cp: FakeControlPlane, make_agent: AgentFactory
) -> None:
    make_agent("n1")
    await fake_cp.wait_for(lambda r: True)
    fake_cp.tokens.clear()  # e.g. the node was deleted on the control plane
    before = len(fake_cp.reports)
    await fake_cp.wait_for(lambda r: len(fake_cp.reports) > before, within=20)
    assert fake_cp.registrations == 2


async def test_every_registration_carries_the_data_dirs_agent_key(
    fake_cp: FakeControlPlane,
    make_agent: AgentFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    agent = make_agent("n1")
    await fake_cp.wait_for(lambda r: True)
    key_file = tmp_path / "n1" / "agent.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    key = key_file.read_text()
    assert fake_cp.agent_keys == [key] and len(key) >= 32
    await agent.shutdown()
    # Its node token lost, the same data dir registers with the same key: the
    # one thing that lets the control plane give it its node back.
    (tmp_path / "n1" / "node.json").unlink()
    make_agent("n1")
    await fake_cp.wait_for(lambda r: fake_cp.registrations == 2)
    assert fake_cp.agent_keys == [key, key]
    assert key not in caplog.text


async def test_a_failing_discovery_does_not_end_the_loop(
    fake_cp: FakeControlPlane, make_agent: AgentFactory
) -> None:
    calls = 0

    def flaky() -> NodeInventory:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise DiscoveryError("nvidia-smi -q -x: root element is <html>")
        return cpu_inventory()

    make_agent("n1", inventory_provider=flaky)
    report = await fake_cp.wait_for(lambda r: bool(r.inventory.warnings))
    assert "discovery failed: nvidia-smi" in report.inventory.warnings[0]
    assert len(report.inventory.devices) == 4  # the last inventory seen, flagged
    await fake_cp.wait_for(lambda r: calls >= 3)


async def test_while_only_a_standby_answers_reports_keep_the_interval(
    fake_cp: FakeControlPlane, make_agent: AgentFactory
) -> None:
    # A new leader counts a node's silence from its takeover; an agent that had
    # backed off to 30 s while no instance led would reach it at the edge of the
    # unreachable grace. A standby's answer means a leader is on its way.
    make_agent("n1")
    await fake_cp.wait_for(lambda r: True)
    fake_cp.standby = True
    # Interval 0.3 s: about 10 tries in 3 s; doubling from 1 s would have made 2 or 3.
    await eventually(lambda: fake_cp.standby_answers >= 6, 3.0, what="6 tries within 3 s",
                     note=lambda: fake_cp.standby_answers)  # fmt: skip
    fake_cp.standby = False
    before = len(fake_cp.reports)
    started = time.monotonic()
    await fake_cp.wait_for(lambda r: len(fake_cp.reports) > before, within=5)
    assert time.monotonic() - started < 1.5


async def test_a_nodes_admin_allowed_env_names_are_reported_and_applied(
    fake_cp: FakeControlPlane, make_agent: AgentFactory
) -> None:
    # llmgw agent --engine-env-allow LD_LIBRARY_PATH: the control plane learns
    # the names (it accepts them in a catalog then), and this node's adapters
    # pass them on to engines while every other name keeps the engine's rules.
    agent = make_agent("n1", engine_env_allow=frozenset({"LD_LIBRARY_PATH"}))
    report = await fake_cp.wait_for(lambda r: r.node == "n1")
    assert report.inventory.engine_env_allow == ["LD_LIBRARY_PATH"]
    assert all(isinstance(adapter, NodeEnvAllowed) for adapter in agent.adapters.values())
