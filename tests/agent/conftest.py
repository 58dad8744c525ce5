"""Fixtures for the agent tests: a fake control plane and agents that clean up after themselves."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from tests.agent.fakes import FakeControlPlane, StubAdapter, serve_app
from tests.agent.helpers import cpu_slot

from llmgw.agent.app import Agent, AgentConfig
from llmgw.agent.engines.base import EngineAdapter
from llmgw.agent.memguard import MemoryGuard, agent_tag
from llmgw.agent.replicas import ReplicaRunner
from llmgw.wire import EngineKind, NodeInventory

T = TypeVar("T")


@pytest.fixture(autouse=True)
def _bf16_native_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's argv on a CPU slot as on a CPU computing bfloat16 natively (no --dtype added),
    whatever this machine's CPU: the tests of that choice set it themselves."""
    monkeypatch.setattr("llmgw.agent.engines.vllm.native_bf16", lambda: True)


def cpu_inventory(slots: int = 4, host: str = "h") -> NodeInventory:
    return NodeInventory(hostname=host, devices=[cpu_slot(i, host) for i in range(slots)])


@pytest.fixture
async def fake_cp() -> AsyncIterator[FakeControlPlane]:
    cp = FakeControlPlane()
    async with serve_app(cp.app()) as url:
        cp.url = url
        yield cp


def _kill_recorded_engines(data_dir: Path) -> None:
    """Safety net: no engine a test started outlives it, whatever the test did."""
    try:
        records = json.loads((data_dir / "engines.json").read_text())["engines"]
    except (OSError, ValueError, KeyError):
        return
    for record in records.values():
        pid = record.get("pid")
        if pid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


AgentFactory = Callable[..., Agent]


@pytest.fixture
async def make_agent(fake_cp: FakeControlPlane, tmp_path: Path) -> AsyncIterator[AgentFactory]:
    made: list[tuple[Agent, asyncio.Task[None] | None]] = []
    dirs: set[Path] = set()

    def factory(
        name: str = "n1",
        data_dir: Path | None = None,
        *,
        join_token: str | None = "llmgw-join-test",
        run: bool = True,
        inventory_provider: Callable[[], NodeInventory] | None = None,
        adapters: dict[EngineKind, EngineAdapter] | None = None,
        **kwargs: object,
    ) -> Agent:
        directory = data_dir or tmp_path / name
        dirs.add(directory)
        config = AgentConfig(
            control_plane=fake_cp.url,
            data_dir=directory,
            name=name,
            join_token=join_token,
            stop_grace_s=3.0,
            **kwargs,  # type: ignore[arg-type]
        )
        agent = Agent(
            config,
            inventory_provider=inventory_provider or (lambda: cpu_inventory()),
            adapters=adapters or {EngineKind.SIM: StubAdapter()},
        )
        task = asyncio.create_task(agent.run()) if run else None
        made.append((agent, task))
        return agent

    yield factory
    for agent, _ in made:
        with contextlib.suppress(Exception):
            await agent.shutdown(stop_engines=True)
    for directory in dirs:
        _kill_recorded_engines(directory)
    # Engines killed above leave their memory cgroups behind (empty once
    # they have exited); a guard for the same data dir removes them.
    await asyncio.sleep(0.2)
    for directory in dirs:
        with contextlib.suppress(Exception):
            MemoryGuard(agent_tag(directory), "cgroup")


Calls = list[tuple[float, T]]


@dataclass
class WatchLog:
    """What the agents' watch loops did, each call with when it ended (monotonic).

    A test that checks nothing happened to a serving engine reads here that
    the loop did look at it meanwhile: an idle loop would pass it as well.
    """

    probes: Calls[str | None] = field(default_factory=list)  # None: it answered
    # (running, counters) as read, or what the scrape raised
    scrapes: Calls[tuple[float, tuple[float, ...]] | Exception] = field(default_factory=list)

    @staticmethod
    def since(calls: Calls[T], start: float) -> list[T]:
        return [got for when, got in calls if when >= start]

    @staticmethod
    def spans(calls: Calls[T], start: float, seconds: float) -> bool:
        """Whether the calls went on until ``seconds`` after ``start``."""
        return bool(calls) and calls[-1][0] - start >= seconds


@pytest.fixture
def watch_log(monkeypatch: pytest.MonkeyPatch) -> WatchLog:
    log = WatchLog()

    def spy(name: str, into: Calls[Any]) -> None:
        original = getattr(ReplicaRunner, name)

        async def recorded(self: ReplicaRunner, *args: object) -> object:
            try:
                got = await original(self, *args)
            except Exception as exc:
                into.append((time.monotonic(), exc))
                raise
            into.append((time.monotonic(), got))
            return got

        monkeypatch.setattr(ReplicaRunner, name, recorded)

    spy("_probe", log.probes)
    spy("_scrape", log.scrapes)
    return log
