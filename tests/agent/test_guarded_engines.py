"""The agent runs an engine with a key behind its guard: one engine to the agent, closed to others.

The stand-in engine (tests/agent/stub_engine.py) answers anyone; with a key
in its assignment the agent starts it on loopback, under its guard on the
advertised port.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp
import psutil
from tests.agent.conftest import AgentFactory
from tests.agent.fakes import FakeControlPlane
from tests.agent.helpers import assign, cpu_slot
from tests.agent.test_agent import alive, stub_model, wait_dead

from llmgw.wire import ReplicaAssignment, ReplicaState

KEY = "engine-key-agent-0123456789abcdefghijklmnopq"
AUTH = {"Authorization": f"Bearer {KEY}"}


def keyed(assignment: ReplicaAssignment) -> ReplicaAssignment:
    return assignment.model_copy(update={"engine_key": KEY})


async def get(port: int, headers: dict[str, str] | None = None) -> int:
    async with aiohttp.ClientSession() as session, session.get(
        f"http://127.0.0.1:{port}/v1/models", headers=headers
    ) as resp:
        return resp.status


async def test_a_guarded_engine_keeps_serving_through_an_agent_restart(
    fake_cp: FakeControlPlane, make_agent: AgentFactory, tmp_path: Path
) -> None:
    agent = make_agent("n1")
    fake_cp.assignments["n1"] = [keyed(assign(stub_model(), [cpu_slot(0)], replica_id="g"))]
    status = await fake_cp.wait_state("g", ReplicaState.READY)
    runner = agent.runners["g"]
    assert status.port is not None and runner.engine_port not in (None, status.port)
    assert runner.proc is not None
    guard = psutil.Process(runner.proc.pid)
    (engine,) = guard.children()
    # The key is the guard's alone: not in argv, gone from the engine's environment.
    assert KEY not in " ".join(guard.cmdline()) and "LLMGW_GUARD_KEY" not in engine.environ()
    assert await get(status.port) == 401
    assert await get(status.port, {"Authorization": "Bearer wrong"}) == 401
    assert await get(status.port, AUTH) == 200
    assert runner.engine_port is not None and await get(runner.engine_port) == 200  # loopback

    # The gateway's calls go on while the agent is away and after it is back.
    answers: list[int] = []
    restarted = asyncio.Event()

    async def keep_calling() -> None:
        after = 0
        while after < 5:
            answers.append(await get(status.port or 0, AUTH))
            after += restarted.is_set()
            await asyncio.sleep(0.02)

    caller = asyncio.create_task(keep_calling())
    await agent.shutdown(stop_engines=False)
    await asyncio.sleep(0.3)
    again = make_agent("n1", data_dir=tmp_path / "n1")
    back = await fake_cp.wait_state("g", ReplicaState.READY)
    restarted.set()
    await caller
    assert set(answers) == {200}
    assert back.pid == guard.pid and back.port == status.port
    assert again.runners["g"].engine_port == runner.engine_port
    # A stop ends both.
    fake_cp.assignments["n1"] = []
    await wait_dead(guard.pid)
    await wait_dead(engine.pid)


async def test_the_engines_end_is_read_through_its_guard(
    fake_cp: FakeControlPlane, make_agent: AgentFactory
) -> None:
    make_agent("n1")
    exits = keyed(assign(stub_model("exits", ["--exit-after", "0.5", "--exit-code", "3"]),
                         [cpu_slot(0)], replica_id="exits"))
    killed = keyed(assign(stub_model("killed"), [cpu_slot(1)], replica_id="killed"))
    fake_cp.assignments["n1"] = [exits, killed]
    ready = await fake_cp.wait_state("killed", ReplicaState.READY)
    assert ready.pid is not None
    (engine,) = psutil.Process(ready.pid).children()
    os.kill(engine.pid, signal.SIGKILL)
    report = await fake_cp.wait_for(
        lambda r: all(s.state == ReplicaState.FAILED for s in r.replicas) and len(r.replicas) == 2
    )
    reasons = {s.replica_id: s.reason or "" for s in report.replicas}
    assert reasons["exits"].startswith("engine exited with code 3"), reasons
    assert reasons["killed"].startswith("engine killed by SIGKILL"), reasons
    assert not alive(ready.pid)


async def test_an_engine_whose_guard_dies_goes_with_it(
    fake_cp: FakeControlPlane, make_agent: AgentFactory
) -> None:
    make_agent("n1")
    fake_cp.assignments["n1"] = [keyed(assign(stub_model(), [cpu_slot(0)], replica_id="g"))]
    ready = await fake_cp.wait_state("g", ReplicaState.READY)
    assert ready.pid is not None
    (engine,) = psutil.Process(ready.pid).children()
    os.kill(ready.pid, signal.SIGKILL)  # the guard alone
    await wait_dead(engine.pid)  # no engine is left open without its guard
    failed = await fake_cp.wait_state("g", ReplicaState.FAILED)
    assert failed.reason and "SIGKILL" in failed.reason
