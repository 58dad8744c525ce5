"""A real agent against a real control plane: a lost registration answer heals by itself.

An agent whose registration answer was lost holds no node token while its
name is taken. Its agent key (made before the first registration, kept in
its data dir) lets it register again; a wiped data dir has a new key and
still needs a person.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.control.planekit import opened_plane, register, send_report
from tests.servers import serve_asgi
from tests.waiting import eventually

from llmgw.agent.app import Agent, AgentConfig
from llmgw.agent.identity import Identity, load_identity, save_identity
from llmgw.control.app import create_app
from llmgw.control.plane import ControlPlane
from llmgw.secrets import hash_secret
from llmgw.wire import AgentReport, NodeInventory


class LosesRegistrationAnswers:
    """What an agent sees when the connection drops after the control plane committed.

    The registration reaches the control plane and is applied; its answer is
    thrown away and the agent gets the 502 a proxy in between would send.
    """

    def __init__(self, app: Any, lose: int) -> None:
        self.app = app
        self.lose = lose

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.lose > 0 and scope["type"] == "http" and scope["path"] == "/agent/v1/register":
            self.lose -= 1

            async def thrown_away(_: Any) -> None:
                return None

            await self.app(scope, receive, thrown_away)
            await send({"type": "http.response.start", "status": 502,
                        "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"upstream connection reset"})
            return
        await self.app(scope, receive, send)


@dataclass
class Plane:
    cp: ControlPlane
    url: str
    join_token: str
    proxy: LosesRegistrationAnswers
    agents: AsyncExitStack

    def start_agent(self, data_dir: Path) -> Agent:
        agent = Agent(AgentConfig(control_plane=self.url, data_dir=data_dir, name="n1",
                                  join_token=self.join_token, cpu_slots=1))
        task = asyncio.create_task(agent.run())
        self.agents.push_async_callback(agent.shutdown, True)
        self.agents.callback(task.cancel)
        return agent

    async def registered_events(self) -> list[str]:
        return [e["message"] for e in await self.cp.store.list_events(subject="n1")]


@pytest.fixture
async def plane(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> AsyncIterator[Plane]:
    caplog.set_level(logging.DEBUG)
    async with opened_plane(tmp_path) as (cp, creds):
        assert creds.join_token
        proxy = LosesRegistrationAnswers(create_app(cp), lose=0)
        async with serve_asgi(proxy) as url, AsyncExitStack() as agents:
            yield Plane(cp, url, creds.join_token, proxy, agents)
    # Whatever happened, no agent key reached a log line.
    keys = agent_keys_under(tmp_path)
    assert keys and not any(key in caplog.text for key in keys)


def agent_keys_under(directory: Path) -> list[str]:
    return [path.read_text() for path in directory.glob("*/agent.key")]


async def until(check: Callable[[], bool], what: str) -> None:
    await eventually(check, within_s=20.0, what=what)


def reported(cp: ControlPlane, after: float = 0.0) -> Callable[[], bool]:
    def check() -> bool:
        node = cp.state.nodes.get("n1")
        return node is not None and node.last_seen is not None and node.last_seen > after
    return check


async def test_a_lost_registration_answer_heals_without_a_person(
    plane: Plane, tmp_path: Path
) -> None:
    plane.proxy.lose = 1
    plane.start_agent(tmp_path / "n1")
    await until(reported(plane.cp), "the agent's first report")
    assert plane.proxy.lose == 0  # the first answer was indeed lost
    events = await plane.registered_events()
    assert "node n1 registered" in events  # the lost one had been committed
    assert any("registered again by its own agent" in m for m in events), events
    key = (tmp_path / "n1" / "agent.key").read_text()
    assert plane.cp.state.nodes["n1"].agent_key_hash == hash_secret(key)


async def test_an_agent_that_lost_its_node_token_but_kept_its_key_gets_its_node_back(
    plane: Plane, tmp_path: Path
) -> None:
    data_dir = tmp_path / "n1"
    first = plane.start_agent(data_dir)
    await until(reported(plane.cp), "the agent's first report")
    await first.shutdown()
    old = load_identity(data_dir, "n1")
    assert old is not None
    (data_dir / "node.json").unlink()

    since = time.time()
    plane.start_agent(data_dir)
    await until(reported(plane.cp, after=since), "a report after registering again")
    new = load_identity(data_dir, "n1")
    assert new is not None and new.node_token != old.node_token
    report = AgentReport(node="n1", inventory=NodeInventory(hostname="n1"))
    async with httpx.AsyncClient() as client:
        answer = await send_report(client, plane.url, old.node_token, report)
    assert answer.status_code == 401  # the old token was revoked
    assert list(plane.cp.state.nodes) == ["n1"]


async def test_a_wiped_data_dir_waits_for_a_person(
    plane: Plane, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = plane.start_agent(tmp_path / "n1")
    await until(reported(plane.cp), "the agent's first report")
    await first.shutdown()

    # Another data dir (a wiped disk, or another machine) under the same name:
    # the join token alone must not take over the node.
    since = time.time()
    wiped = plane.start_agent(tmp_path / "wiped")
    refusal = "llmgw ctl nodes delete n1"
    await until(lambda: refusal in caplog.text, "the refusal in the agent's log")
    assert wiped.identity is None and not reported(plane.cp, after=since)()
    assert "already registered" in caplog.text and "not the one it registered with" in caplog.text

    await plane.cp.nodes.delete("n1")  # what the message says to do
    await until(reported(plane.cp, after=since), "a report once the node was deleted")
    key = (tmp_path / "wiped" / "agent.key").read_text()
    assert plane.cp.state.nodes["n1"].agent_key_hash == hash_secret(key)


async def test_a_node_registered_before_agent_keys_learns_its_key_and_can_register_again(
    plane: Plane, tmp_path: Path
) -> None:
    # A node and data dir as an agent from before agent keys left them: a
    # node token on disk, no agent key anywhere.
    async with httpx.AsyncClient() as client:
        token = await register(client, plane.url, plane.join_token, "n1")
    data_dir = tmp_path / "n1"
    data_dir.mkdir()
    save_identity(data_dir, Identity(node="n1", node_token=token, control_plane=plane.url))
    assert plane.cp.state.nodes["n1"].agent_key_hash is None

    first = plane.start_agent(data_dir)
    await until(lambda: plane.cp.state.nodes["n1"].agent_key_hash is not None,
                "the agent key's hash from a report")
    key = (data_dir / "agent.key").read_text()
    assert plane.cp.state.nodes["n1"].agent_key_hash == hash_secret(key)
    await first.shutdown()

    # Its node token lost (as after a lost registration answer): it gets its node back.
    (data_dir / "node.json").unlink()
    since = time.time()
    plane.start_agent(data_dir)
    await until(reported(plane.cp, after=since), "a report after registering again")
    assert any("registered again by its own agent" in m
               for m in await plane.registered_events())
