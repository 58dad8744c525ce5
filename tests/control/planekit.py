"""The set-up most control-plane tests start from, in one place: a fresh store, a
control plane loaded from it with its first credentials, served on loopback; and
what an agent sends it (an inventory, a registration, a report)."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import httpx
from tests.servers import serve_asgi

from llmgw.control.app import create_app
from llmgw.control.nodecerts import NodeCertificates
from llmgw.control.plane import ControlPlane, NewCredentials
from llmgw.control.runtime import ControlPlaneRuntime
from llmgw.control.state import ReplicaRecord
from llmgw.control.store.repo import Store
from llmgw.nodetls import NodeIssuer
from llmgw.servertls import ServerTls, ensure_server_tls
from llmgw.wire import AgentReport, Device, NodeInventory, ReplicaState, ShardAssignment

KEY = "llmgw-agent-key-" + "k" * 43
OTHER_KEY = "llmgw-agent-key-" + "o" * 43


# A client calling a control plane's app in-process, the plane, its first credentials.
Api = tuple[httpx.AsyncClient, ControlPlane, NewCredentials]


class Plane(NamedTuple):
    cp: ControlPlane
    creds: NewCredentials
    url: str

    @property
    def join(self) -> str:
        assert self.creds.join_token
        return self.creds.join_token

    @property
    def admin(self) -> dict[str, str]:
        assert self.creds.admin_token
        return bearer(self.creds.admin_token)


@asynccontextmanager
async def opened_plane(
    where: Path | str, *, credentials: bool = True
) -> AsyncIterator[tuple[ControlPlane, NewCredentials]]:
    """A control plane loaded from a store (a SQLite file in the folder ``where``, or at
    the database URL ``where``), its missing credentials made unless told not to."""
    store = await Store.open(f"sqlite:///{where / 'cp.db'}" if isinstance(where, Path) else where)
    cp = ControlPlane(store)
    try:
        await cp.load()
        yield cp, await cp.ensure_credentials() if credentials else NewCredentials()
    finally:
        await cp.digests.close()
        await store.close()


@asynccontextmanager
async def running(cp: ControlPlane, **settings: Any) -> AsyncIterator[ControlPlaneRuntime]:
    """``cp``'s runtime (leader election, reconciler, flushes) started, stopped on the way out."""
    runtime = ControlPlaneRuntime(cp, **settings)
    await runtime.start()
    try:
        yield runtime
    finally:
        await runtime.stop()


@asynccontextmanager
async def served_plane(tmp_path: Path, *, tls: ServerTls | None = None) -> AsyncIterator[Plane]:
    """`opened_plane` served over HTTP (or with ``tls``) on loopback."""
    async with opened_plane(tmp_path) as (cp, creds), serve_asgi(create_app(cp), tls=tls) as url:
        yield Plane(cp, creds, url)


def ready_replica(cp: ControlPlane, model: str) -> ReplicaRecord:
    """A ready replica ``r1`` of ``model`` on node n1, put in ``cp``'s fleet state alone (no
    agent runs it, the store never hears of it): what a catalog change may restart or not."""
    shard = ShardAssignment(node="n1", device_numbers=[0])
    replica = ReplicaRecord(
        id="r1", model=model, created_at=0.0, state=ReplicaState.READY, shards=[shard]
    )
    cp.state.replicas[replica.id] = replica
    return replica


def fleet_ca(directory: Path) -> tuple[ServerTls, NodeCertificates]:
    """A server certificate for 127.0.0.1 from a new CA, and that CA signing node certificates."""
    tls = ensure_server_tls(directory, ["127.0.0.1"])
    assert tls.ca_file is not None and tls.ca_key_file is not None
    return tls, NodeCertificates(NodeIssuer.from_files(tls.ca_file, tls.ca_key_file))


@asynccontextmanager
async def signing_plane(tmp_path: Path) -> AsyncIterator[tuple[Plane, ServerTls]]:
    """`served_plane` over TLS, holding its CA's key: it signs each node's certificate."""
    tls, node_certs = fleet_ca(tmp_path / "cp-tls")
    async with served_plane(tmp_path, tls=tls) as plane:
        # Set before any agent has spoken: as `serve` does at start.
        plane.cp.node_certs = node_certs
        yield plane, tls


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def get_status(url: str, context: ssl.SSLContext | bool, token: str | None = None) -> int:
    """The status of a GET checked with ``context`` (False: no TLS checks), with a token."""
    async with aiohttp.ClientSession() as session, session.get(
            url, ssl=context, headers=bearer(token) if token else {},
            timeout=aiohttp.ClientTimeout(total=5)) as answer:
        return answer.status


def inventory(host: str) -> NodeInventory:
    return NodeInventory(
        hostname=host,
        devices=[Device(number=0, label="cpu0", uuid=f"CPU-{host}-0", name="cpu", gpu_class="cpu")],
    )


async def register(
    client: httpx.AsyncClient, url: str, join: str, node: str, agent_key: str | None = None
) -> str:
    body = {"node": node}
    if agent_key is not None:
        body["agent_key"] = agent_key
    answer = await client.post(f"{url}/agent/v1/register", json=body,
                               headers={"Authorization": f"Bearer {join}"})
    assert answer.status_code == 200, answer.text
    token: str = answer.json()["node_token"]
    return token


async def send_report(client: httpx.AsyncClient, url: str, token: str,
                      report: AgentReport | dict[str, Any] | bytes) -> httpx.Response:
    """POST a report (a model, a JSON body, or raw bytes) with a node token."""
    if isinstance(report, AgentReport):
        report = report.model_dump_json().encode()
    if isinstance(report, dict):
        return await client.post(f"{url}/agent/v1/report", json=report, headers=bearer(token))
    return await client.post(f"{url}/agent/v1/report", content=report, headers=bearer(token))


async def report_ok(client: httpx.AsyncClient, url: str, token: str,
                    report: AgentReport) -> httpx.Response:
    answer = await send_report(client, url, token, report)
    assert answer.status_code == 200, answer.text
    return answer
