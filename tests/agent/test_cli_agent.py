"""``llmgw agent`` as a process: registers and reports, exits cleanly, fails in one line."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

import psutil
from tests.agent.fakes import FakeControlPlane
from tests.agent.helpers import assign, cpu_slot
from tests.servers import child_process, terminates_cleanly

from llmgw.wire import EngineKind, ModelSpec, ReplicaState, SimParams

LLMGW = [sys.executable, "-m", "llmgw.cli.main", "agent"]


def cpu_bf16_here() -> bool | None:
    """This machine's answer, read here from /proc/cpuinfo: x86 (AVX2) CPUs say."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = next((set(line.split(":", 1)[1].split()) for line in text.splitlines()
                  if line.startswith("flags")), set())  # fmt: skip
    if "avx2" not in flags:
        return None
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def agent_argv(control_plane: str, join_token: str, data_dir: Path, *more: str) -> list[str]:
    return [
        *LLMGW,
        "--control-plane",
        control_plane,
        "--join-token",
        join_token,
        "--data-dir",
        str(data_dir),
        *more,
    ]


async def test_agent_command_reports_and_stops_on_sigterm(
    fake_cp: FakeControlPlane, tmp_path: Path
) -> None:
    argv = agent_argv(
        fake_cp.url, fake_cp.join_token, tmp_path / "d",
        "--name", "cli-node", "--cpu-slots", "2", "--fabric", "ib-a", "--log-level", "warning",
    )  # fmt: skip
    async with child_process(*argv, stderr=asyncio.subprocess.PIPE) as proc:
        report = await fake_cp.wait_for(lambda r: r.node == "cli-node", within=30)
        assert report.fabrics == ["ib-a"]
        assert sum(d.gpu_class == "cpu" for d in report.inventory.devices) == 2
        # Its RAM, for placing CPU replicas (the machine's, or its cgroup's limit).
        ram = report.inventory.memory_total_mib
        assert ram is not None and 0 < ram <= psutil.virtual_memory().total >> 20
        # Whether its CPU computes bfloat16 (placement of vLLM on CPU slots).
        assert report.inventory.cpu_bf16 == cpu_bf16_here()
        await terminates_cleanly(proc)


async def test_bad_memory_guard_is_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        *LLMGW,
        "--control-plane",
        "http://127.0.0.1:9",
        "--data-dir",
        str(tmp_path / "d"),
        "--memory-guard",
        "cgroups",
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert err.decode().strip().splitlines()[-1] == (
        "llmgw: --memory-guard 'cgroups': expected one of auto, cgroup, rss, off"
    )


async def test_bad_join_token_is_one_line_and_exit_2(
    fake_cp: FakeControlPlane, tmp_path: Path
) -> None:
    argv = agent_argv(fake_cp.url, "llmgw-join-wrong", tmp_path / "d", "--name", "n")
    async with child_process(*argv, stderr=asyncio.subprocess.PIPE) as proc:
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    lines = err.decode().strip().splitlines()
    assert lines[-1].startswith("llmgw: ") and "401" in lines[-1]
    assert "Traceback" not in err.decode()


async def test_killed_agent_process_comes_back_to_the_same_engine(
    fake_cp: FakeControlPlane, tmp_path: Path
) -> None:
    """``kill -9`` of the agent (as of a whole ``llmgw up``): the engine lives on, adopted."""
    spec = ModelSpec(name="sim-k", engine=EngineKind.SIM, sim=SimParams(startup_s=0.1))
    assignment = assign(spec, [cpu_slot(0)], node="k")
    assignment.shard.device_uuids = []  # the real discovery names this host's slots
    fake_cp.assignments["k"] = [assignment]
    argv = agent_argv(
        fake_cp.url, fake_cp.join_token, tmp_path / "d", "--name", "k", "--log-level", "warning"
    )
    engine_pid = None
    try:
        async with child_process(*argv) as first:
            ready = await fake_cp.wait_state("r1", ReplicaState.READY, within=60)
            engine_pid = ready.pid
            first.kill()
            await first.wait()
        assert engine_pid is not None and psutil.pid_exists(engine_pid)
        async with child_process(*argv):
            again = await fake_cp.wait_for(lambda r: bool(r.replicas), within=30)
            assert again.replicas[0].state == ReplicaState.READY
            assert again.replicas[0].pid == engine_pid
    finally:
        if engine_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(engine_pid, signal.SIGKILL)
