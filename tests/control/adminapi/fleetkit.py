"""Small fleets written by hand, and a control plane served on loopback for HTTP tests."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI
from tests.control.planekit import opened_plane

from llmgw.control.plane import ControlPlane
from llmgw.control.state import FleetState, ModelRecord, NodeRecord, ReplicaRecord
from llmgw.serving import start_server
from llmgw.wire import (
    AgentRegistration,
    Device,
    EngineKind,
    MigInfo,
    ModelSpec,
    NodeInventory,
    NodeState,
    ReplicaState,
    ShardAssignment,
    WeightsEntry,
    device_label,
    mig_number,
)

T = TypeVar("T")
NOW = 1_800_000_000.0


def gpu(
    number: int,
    gpu_class: str = "h100-80g",
    *,
    healthy: bool = True,
    placeable: bool = True,
    reason: str | None = None,
) -> Device:
    return Device(
        number=number, label=device_label(number), uuid=f"GPU-{number}-{gpu_class}",
        name="NVIDIA H100 80GB HBM3", gpu_class=gpu_class, memory_total_mib=81559,
        utilization_pct=10, temperature_c=40, power_w=100.0, healthy=healthy,
        unhealthy_reasons=[] if healthy else [reason or "uncorrectable ECC errors: 1"],
        placeable=placeable, unplaceable_reason=None if placeable else reason,
    )


def mig(card: int, instance: int, profile: str = "3g.40gb", card_class: str = "a100-80g") -> Device:
    number = mig_number(card, instance)
    return Device(
        number=number, label=device_label(number), uuid=f"MIG-{card}-{instance}",
        name="NVIDIA A100-SXM4-80GB", gpu_class=f"{card_class}-mig-{profile}",
        memory_total_mib=40192, temperature_c=40, power_w=80.0, utilization_pct=None,
        mig=MigInfo(parent_uuid=f"GPU-{card}", parent_index=card,
                    gpu_instance_id=instance + 1, compute_instance_id=0, profile=profile),
    )


def gpus(count: int, gpu_class: str = "h100-80g") -> list[Device]:
    return [gpu(i, gpu_class) for i in range(count)]


def spec(name: str, **fields: Any) -> ModelSpec:
    fields.setdefault("engine", EngineKind.SIM)
    fields.setdefault("gpu_classes", ["h100-80g"])
    return ModelSpec(name=name, **fields)


@dataclass
class Fleet:
    """A FleetState built line by line: ``fleet.node(...)``, ``fleet.model(...)``."""

    now: float = NOW
    state: FleetState = field(default_factory=FleetState)
    _ids: int = 0

    def node(
        self,
        name: str,
        devices: list[Device] | None = None,
        *,
        fabrics: tuple[str, ...] = ("ib-a",),
        weights: tuple[str, ...] = (),
        admin_state: NodeState = NodeState.READY,
        seen_ago: float = 1.0,
    ) -> NodeRecord:
        record = NodeRecord(
            name=name, registered_at=self.now - 3600, admin_state=admin_state,
            fabrics=list(fabrics),
            inventory=NodeInventory(hostname=name, source="fake",
                                    devices=gpus(8) if devices is None else devices),
            weights=[WeightsEntry(model=m) for m in weights],
            last_seen=self.now - seen_ago,
        )
        self.state.nodes[name] = record
        return record

    def model(self, name: str, **fields: Any) -> ModelRecord:
        record_fields = {k: fields.pop(k) for k in (
            "parked", "failures", "last_error", "demand_at", "unplaceable_reason", "load_demand",
        ) if k in fields}
        record = ModelRecord(spec=spec(name, **fields), created_at=self.now - 3600,
                             updated_at=self.now - 3600, **record_fields)
        self.state.models[name] = record
        return record

    def replica(
        self,
        model: str,
        node: str,
        numbers: list[int],
        *,
        state: ReplicaState = ReplicaState.READY,
        idle: float | None = 5.0,
        more_shards: tuple[tuple[str, list[int]], ...] = (),
    ) -> ReplicaRecord:
        self._ids += 1
        ready = state in (ReplicaState.READY, ReplicaState.DRAINING)
        shards = [ShardAssignment(node=node, device_numbers=numbers)]
        shards += [ShardAssignment(node=n, rank=i + 1, device_numbers=nums)
                   for i, (n, nums) in enumerate(more_shards)]
        record = ReplicaRecord(
            id=f"r{self._ids:04d}", model=model, created_at=self.now - 7200, shards=shards,
            state=state, port=30000 + self._ids if ready else None,
            ready_at=self.now - (idle or 0) if ready and idle is not None else None,
        )
        self.state.replicas[record.id] = record
        return record


# -- a control plane on loopback, in a thread of its own ------------------------------


def admin_app(cp: ControlPlane) -> FastAPI:
    """The control plane's real app, with the admin API mounted as in production."""
    from llmgw.control.app import create_app

    return create_app(cp)


@dataclass
class Served:
    url: str
    cp: ControlPlane
    admin_token: str
    join_token: str
    gateway_token: str
    api_key: str
    loop: asyncio.AbstractEventLoop

    def call(self, make: Callable[[], Awaitable[T]], timeout: float = 30.0) -> T:
        """Run a coroutine on the server's loop (the control plane lives there)."""

        async def run() -> T:
            return await make()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def node_token(self, node: str = "node-x") -> str:
        join = self.join_token
        answer = self.call(lambda: self.cp.nodes.register(
            AgentRegistration(node=node, join_token=join)))
        return answer.node_token


@contextmanager
def served_control_plane(tmp: Path, fleet: FleetState | None = None) -> Iterator[Served]:
    """A real uvicorn on 127.0.0.1 (ephemeral port) with a SQLite store."""
    ready: list[Served] = []
    failed: list[BaseException] = []
    started = threading.Event()
    stop: list[asyncio.Event] = []

    async def main() -> None:
        async with opened_plane(f"sqlite:///{tmp / 'llmgw.db'}") as (cp, creds):
            if fleet is not None:
                cp.state.nodes.update(fleet.nodes)
                cp.state.models.update(fleet.models)
                cp.state.replicas.update(fleet.replicas)
            # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on sockets whose proto
            # says TCP, and without it every answer waited ~40 ms for a delayed ACK (measured).
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            server = uvicorn.Server(uvicorn.Config(admin_app(cp), lifespan="off",
                                                   log_level="warning", access_log=False))
            task = await start_server(server, [sock])
            stop.append(asyncio.Event())
            assert creds.admin_token and creds.join_token and creds.gateway_token
            assert creds.api_key
            ready.append(Served(f"http://127.0.0.1:{port}", cp, creds.admin_token,
                                creds.join_token, creds.gateway_token, creds.api_key,
                                asyncio.get_running_loop()))
            started.set()
            await stop[0].wait()
            server.should_exit = True
            await task
            sock.close()

    def thread_main() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # surfaced to the test below
            failed.append(exc)
            started.set()

    thread = threading.Thread(target=thread_main, name="control-plane", daemon=True)
    thread.start()
    started.wait(30)
    if failed or not ready:
        raise RuntimeError(f"control plane did not start: {failed!r}")
    served = ready[0]
    try:
        yield served
    finally:
        served.loop.call_soon_threadsafe(stop[0].set)
        thread.join(15)
