"""``llmgw agent`` as a process: registers and reports, exits cleanly, fails in one line."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

from tests.agent.fakes import FakeControlPlane

LLMGW = [sys.executable, "-m", "llmgw.cli.main", "agent"]


async def test_agent_command_reports_and_stops_on_sigterm(
    fake_cp: FakeControlPlane, tmp_path: Path
) -> None:
    proc = await asyncio.create_subprocess_exec(
        *LLMGW,
        "--control-plane",
        fake_cp.url,
        "--join-token",
        fake_cp.join_token,
        "--data-dir",
        str(tmp_path / "d"),
        "--name",
        "cli-node",
        "--cpu-slots",
        "2",
        "--fabric",
        "ib-a",
        "--log-level",
        "warning",
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        report = await fake_cp.wait_for(lambda r: r.node == "cli-node", within=30)
        assert report.fabrics == ["ib-a"]
        assert sum(d.gpu_class == "cpu" for d in report.inventory.devices) == 2
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_bad_join_token_is_one_line_and_exit_2(
    fake_cp: FakeControlPlane, tmp_path: Path
) -> None:
    proc = await asyncio.create_subprocess_exec(
        *LLMGW,
        "--control-plane",
        fake_cp.url,
        "--join-token",
        "llmgw-join-wrong",
        "--data-dir",
        str(tmp_path / "d"),
        "--name",
        "n",
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    lines = err.decode().strip().splitlines()
    assert lines[-1].startswith("llmgw: ") and "401" in lines[-1]
    assert "Traceback" not in err.decode()
