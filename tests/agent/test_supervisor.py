"""Engine processes: own session, logs and their tail, stop escalation, adoption guard."""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
from tests.agent.fakes import STUB
from tests.waiting import eventually

from llmgw.agent.engines.base import EngineLaunch
from llmgw.agent.ports import PortAllocator, port_is_free
from llmgw.agent.supervisor import (
    Supervisor,
    describe_exit,
    engine_environment,
    process_birth,
)


def stub_launch(port: int, *extra: str) -> EngineLaunch:
    return EngineLaunch(
        argv=[sys.executable, STUB, "--port", str(port), *extra], env={"CUDA_VISIBLE_DEVICES": ""}
    )


async def wait_for_log(sup: Supervisor, rid: str, text: str) -> list[str]:
    def tail() -> list[str] | None:
        lines = sup.log_tail(rid)
        return lines if any(text in line for line in lines) else None

    return await eventually(tail, 10, what=f"{text!r} in the log", note=lambda: sup.log_tail(rid))


async def test_engine_runs_in_its_own_session_with_its_env(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "logs")
    port = PortAllocator("127.0.0.1").allocate("r1")
    proc = sup.spawn("r1", stub_launch(port))
    try:
        assert os.getsid(proc.pid) == proc.pid != os.getsid(0)
        assert os.getpgid(proc.pid) == proc.pid
        tail = await wait_for_log(sup, "r1", "ready to serve")
        assert "env CUDA_VISIBLE_DEVICES=''" in tail
        assert not sup.poll(proc).exited
    finally:
        status = await sup.stop(proc, 5.0)
    assert status.exited and status.code == -signal.SIGTERM


async def test_stop_escalates_to_sigkill(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "logs")
    port = PortAllocator("127.0.0.1").allocate("r1")
    proc = sup.spawn("r1", stub_launch(port, "--ignore-term"))
    await wait_for_log(sup, "r1", "ready to serve")
    began = time.monotonic()
    status = await sup.stop(proc, 0.5)
    assert status.code == -signal.SIGKILL
    assert 0.5 <= time.monotonic() - began < 5


async def test_adoption_checks_the_start_time(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "logs")
    port = PortAllocator("127.0.0.1").allocate("r1")
    proc = sup.spawn("r1", stub_launch(port))
    try:
        adopted = Supervisor.adopt(proc.pid, proc.birth)
        assert adopted is not None and not Supervisor.poll(adopted).exited
        # Same pid, another start time: a reused pid, not our engine.
        boot, tick = proc.birth.rsplit(":", 1)
        assert Supervisor.adopt(proc.pid, f"{boot}:{int(tick) - 100}") is None
    finally:
        await sup.stop(proc, 5.0)
    assert Supervisor.adopt(proc.pid, proc.birth) is None


def test_process_birth_does_not_follow_the_wall_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    # psutil's create_time moves when the boot time derived from the wall
    # clock does (a second at a time); an adopted engine must not look like
    # another process then, or its agent takes it for exited and kills it.
    before = process_birth(os.getpid())
    moved = psutil.boot_time() + 1.0
    monkeypatch.setattr(psutil, "boot_time", lambda: moved)
    monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: moved)  # what create_time uses
    assert before is not None and process_birth(os.getpid()) == before
    assert process_birth(2**22 + 7) is None  # above Linux's pid_max: no such process


async def test_missing_executable_is_an_engine_error(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "logs")
    try:
        sup.spawn("r1", EngineLaunch(argv=["/nonexistent/llama-server", "--port", "1"]))
    except Exception as exc:
        assert "not found" in str(exc) and "installed" in str(exc)
    else:
        raise AssertionError("spawn of a missing executable succeeded")


def test_logs_rotate_by_copy_and_truncate(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "logs", log_max_bytes=100, log_backups=2)
    path = sup.log_path("r1")
    path.parent.mkdir(parents=True)
    path.write_text("old line\n" * 50)
    sup.rotate_if_large("r1")
    assert path.stat().st_size == 0
    assert (path.parent / "r1.log.1").read_text().startswith("old line")
    path.write_text("newer\n" * 50)
    sup.rotate_if_large("r1")
    assert (path.parent / "r1.log.2").read_text().startswith("old line")
    assert (path.parent / "r1.log.1").read_text().startswith("newer")


def test_log_tail_keeps_the_last_lines(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "logs")
    path = sup.log_path("r1")
    path.parent.mkdir(parents=True)
    path.write_text("".join(f"line {i}\n" for i in range(100)) + "progress 10%\rprogress 90%\n")
    assert sup.log_tail("r1", 3) == ["line 99", "progress 10%", "progress 90%"]


def test_engine_environment_drops_agent_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_JOIN_TOKEN", "secret")
    env = engine_environment({"CUDA_VISIBLE_DEVICES": "GPU-1"})
    assert "LLMGW_JOIN_TOKEN" not in env
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-1" and env["PYTHONUNBUFFERED"] == "1"


def test_describe_exit() -> None:
    assert describe_exit(-9) == "engine killed by SIGKILL"
    assert describe_exit(2) == "engine exited with code 2"
    assert "unknown" in describe_exit(None)


def free_range(count: int) -> int:
    """The first of ``count`` free consecutive ports, below the kernel's ephemeral
    range (where any outgoing connection of another test could take one)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20_000, 30_000)
        if all(port_is_free("127.0.0.1", base + i) for i in range(count)):
            return base
    raise AssertionError("no free port range")


def test_ports_never_collide_and_skip_busy_ones() -> None:
    import socket

    base = free_range(4)
    first, busy_port, last = base, base + 1, base + 3
    alloc = PortAllocator("127.0.0.1", (first, last))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", busy_port))
        busy.listen()
        got = {alloc.allocate(f"r{i}") for i in range(3)}
        assert got == {first, base + 2, last}
        try:
            alloc.allocate("r4")
        except Exception as exc:
            assert "no free port" in str(exc)
        else:
            raise AssertionError("allocated from a full range")
    assert alloc.allocate("r1") in got  # the same replica keeps its port
    alloc.release("r1")
    restarted = PortAllocator("127.0.0.1", (first, last))
    for rid, port in alloc.taken().items():
        restarted.restore(rid, port)  # as the agent does from its engine records
    assert restarted.allocate("new") not in alloc.taken().values()
    assert port_is_free("127.0.0.1", busy_port)


async def test_an_agent_finds_only_the_engines_it_started(tmp_path: Path) -> None:
    # Two agents on one host, each with a replica "r1": the one looking for an
    # engine it started but never recorded must not take the other's.
    mine, theirs = Supervisor(tmp_path / "a" / "logs"), Supervisor(tmp_path / "b" / "logs")
    ports = PortAllocator("127.0.0.1")
    proc = theirs.spawn("r1", stub_launch(ports.allocate("r1")))
    try:
        await wait_for_log(theirs, "r1", "ready to serve")
        assert mine.find("r1") is None
        found = theirs.find("r1")
        assert found is not None and found.pid == proc.pid
    finally:
        await theirs.stop(proc, 5.0)
