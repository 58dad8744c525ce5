"""A small fleet with every case the console must show, built through the control plane.

Nodes with MIG cards (instances of class ``a100-80g-mig-3g.40gb``, numbered
``1000 + 100 * card + instance``), two fabrics, an unhealthy GPU, a MIG card
with nothing carved (out of placement), a node that never reported
(unreachable) with a ready replica on it, a parked model, an unplaceable
model, an idle replica (ready, last request 25 minutes ago), a replica still
downloading its weights with an engine log, and usage of two API keys on two
models.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from llmgw.control.plane import ControlPlane
from llmgw.control.rows import model_row, replica_row
from llmgw.control.state import ReplicaRecord
from llmgw.wire import (
    AgentRegistration,
    AgentReport,
    Device,
    DownloadProgress,
    EngineKind,
    MigInfo,
    ModelSpec,
    NodeInventory,
    ReplicaState,
    ReplicaStatus,
    ShardAssignment,
    UsageRecord,
    WeightsEntry,
    device_label,
    mig_number,
)

A100 = "NVIDIA A100-SXM4-80GB"
H100 = "NVIDIA H100 80GB HBM3"
MIG_CLASS = "a100-80g-mig-3g.40gb"
ECC_REASON = "uncorrectable ECC errors (volatile: 3)"
NOT_CARVED = "MIG mode is enabled but no instances are carved"
PARK_ERROR = "engine exited (1): CUDA error: out of memory"
UNPLACEABLE_REASON = "needs 8 free h100-80g on one node; 0/5 nodes fit: 2 too few free h100-80g"


def card(host: str, index: int, name: str, cls: str, *, temp: int, power: float,
         healthy: bool = True, reasons: list[str] | None = None) -> Device:
    return Device(
        number=index, label=device_label(index), uuid=f"GPU-{host}-{index}", name=name,
        gpu_class=cls, memory_total_mib=81920, memory_used_mib=0, utilization_pct=3,
        temperature_c=temp, power_w=power, healthy=healthy, unhealthy_reasons=reasons or [],
    )


def mig(host: str, index: int, instance: int, *, temp: int, power: float) -> Device:
    number = mig_number(index, instance)
    return Device(
        number=number, label=device_label(number), uuid=f"MIG-{host}-{index}-{instance}",
        name=f"{A100} MIG 3g.40gb", gpu_class=MIG_CLASS, memory_total_mib=40192,
        utilization_pct=None, temperature_c=temp, power_w=power,
        mig=MigInfo(parent_uuid=f"GPU-{host}-{index}", parent_index=index,
                    gpu_instance_id=1 + instance, compute_instance_id=0, profile="3g.40gb"),
    )


def inventories() -> dict[str, tuple[list[str], list[Device]]]:
    """node -> (fabrics, devices)."""
    return {
        "gpu-a1": (["ib-a"], [
            mig("gpu-a1", 0, 0, temp=51, power=210.0),
            mig("gpu-a1", 0, 1, temp=51, power=210.0),
            card("gpu-a1", 1, A100, "a100-80g", temp=47, power=180.0),
            card("gpu-a1", 2, A100, "a100-80g", temp=49, power=95.0, healthy=False,
                 reasons=[ECC_REASON]),
        ]),
        "gpu-a2": (["ib-a"], [
            card("gpu-a2", i, A100, "a100-80g", temp=38 + i, power=70.0) for i in range(4)
        ]),
        "gpu-b1": (["ib-b"], [
            card("gpu-b1", 0, H100, "h100-80g", temp=55, power=310.0),
            card("gpu-b1", 1, H100, "h100-80g", temp=41, power=90.0).model_copy(
                update={"placeable": False, "unplaceable_reason": NOT_CARVED,
                        "utilization_pct": None}),
        ]),
        "gpu-b2": (["ib-b"], [
            card("gpu-b2", i, H100, "h100-80g", temp=40, power=85.0) for i in range(2)
        ]),
    }


MODELS = [
    ModelSpec(name="chat-small", engine=EngineKind.SIM, gpu_classes=[MIG_CLASS]),
    ModelSpec(name="embed", engine=EngineKind.SIM, gpu_classes=["a100-80g"],
              aliases=["embeddings"]),
    ModelSpec(name="llama-dl", engine=EngineKind.SIM, gpu_classes=["h100-80g"]),
    ModelSpec(name="big-model", engine=EngineKind.SIM, gpu_classes=["h100-80g"], gpus=8, tp=8),
    ModelSpec(name="broken", engine=EngineKind.SIM, gpu_classes=["a100-80g"]),
]


@dataclass
class Fleet:
    cp: ControlPlane
    node_tokens: dict[str, str]
    key_ids: list[str]


def _replica(rid: str, model: str, node: str, numbers: list[int], state: ReplicaState,
             created: float, **extra: object) -> ReplicaRecord:
    shard = ShardAssignment(node=node, device_numbers=numbers,
                            device_uuids=[f"dev-{node}-{n}" for n in numbers])
    return ReplicaRecord(id=rid, model=model, created_at=created, shards=[shard], state=state,
                         **extra)  # type: ignore[arg-type]


def statuses(now: float) -> dict[str, list[ReplicaStatus]]:
    return {
        "gpu-a1": [
            ReplicaStatus(replica_id="r-chat-1", state=ReplicaState.READY, port=9001,
                          ready_at=now - 3600, log_tail=["INFO engine ready"]),
            ReplicaStatus(replica_id="r-embed-1", state=ReplicaState.READY, port=9002,
                          ready_at=now - 600, log_tail=["INFO engine ready"]),
        ],
        "gpu-b1": [
            ReplicaStatus(
                replica_id="r-llama-1", state=ReplicaState.STARTING,
                reason="waiting for weights 34 %",
                download=DownloadProgress(bytes_done=34_000_000_000, bytes_total=100_000_000_000,
                                          rate_bps=250_000_000.0, eta_s=264.0),
                log_tail=["fetching model-00001-of-00004.safetensors",
                          "fetching model-00002-of-00004.safetensors"],
            ),
        ],
    }


async def build(cp: ControlPlane, join_token: str) -> Fleet:
    now = time.time()
    # serve --trust-reported-fabrics: the fabrics reported below are the operator's.
    cp.trust_reported_fabrics = True
    tokens: dict[str, str] = {}
    invs = inventories()
    for name in [*invs, "gpu-c1"]:
        devices = invs[name][1] if name in invs else [card(name, 0, A100, "a100-80g", temp=30,
                                                           power=60.0)]
        answer = await cp.nodes.register(AgentRegistration(
            node=name, join_token=join_token,
            inventory=NodeInventory(hostname=name, source="fake", devices=devices)))
        tokens[name] = answer.node_token
    await cp.catalog.put(MODELS)
    replicas = [
        # Idle: ready an hour ago, last asked for 25 minutes ago.
        _replica("r-chat-1", "chat-small", "gpu-a1", [mig_number(0, 0)], ReplicaState.READY,
                 now - 4000,
                 port=9001, ready_at=now - 3600, last_request_at=now - 1500),
        _replica("r-embed-1", "embed", "gpu-a1", [1], ReplicaState.READY, now - 4000,
                 port=9002, ready_at=now - 600, last_request_at=now - 5),
        # Still fetching its weights, well within its start timeout.
        _replica("r-llama-1", "llama-dl", "gpu-b1", [0], ReplicaState.STARTING, now - 120),
        # Ready, on the node that never reports: counted unreachable, not ready.
        _replica("r-embed-lost", "embed", "gpu-c1", [0], ReplicaState.READY, now - 4000,
                 port=9003, ready_at=now - 3600),
    ]
    for r in replicas:
        cp.state.replicas[r.id] = r
    await cp.store.write_replicas([replica_row(r) for r in replicas])
    broken = cp.state.models["broken"]
    broken.parked, broken.failures, broken.last_error = True, 5, PARK_ERROR
    await cp.store.upsert_models([model_row(broken)])
    await cp.event("parked", "broken", f"model broken parked after 5 failed starts: {PARK_ERROR}")
    # What the scheduler would have said on its last pass (memory only).
    cp.state.models["big-model"].unplaceable_reason = UNPLACEABLE_REASON
    await report_all(cp, tokens)
    key_ids = [k.key_id for k in cp.keys.all()]
    second, _ = await cp.keys.create(name="batch jobs")
    key_ids.append(second.key_id)
    minute = int(now) // 60 * 60
    usage = []
    for i in range(1, 46):
        usage.append(UsageRecord(minute=minute - 60 * i, key_id=key_ids[0], model="embed",
                                 requests=10 + i % 5, prompt_tokens=900 + 10 * i,
                                 completion_tokens=30 * i))
        usage.append(UsageRecord(minute=minute - 60 * i, key_id=key_ids[1], model="chat-small",
                                 requests=2 + i % 4, prompt_tokens=600 * (2 + i % 4),
                                 completion_tokens=150 * (2 + i % 4), cached_tokens=300 * (i % 4)))
        if i % 5 == 0:
            usage.append(UsageRecord(minute=minute - 60 * i, key_id=key_ids[1], model="embed",
                                     requests=3, prompt_tokens=500, completion_tokens=20))
    await cp.gateways.record_usage(usage)
    return Fleet(cp=cp, node_tokens=tokens, key_ids=key_ids)


async def report_all(cp: ControlPlane, tokens: dict[str, str]) -> None:
    """One report per reporting node (gpu-c1 never reports: it stays unreachable)."""
    now = time.time()
    per_node = statuses(now)
    for name, (fabrics, devices) in inventories().items():
        node = cp.nodes.for_token(tokens[name])
        weights = [WeightsEntry(model="chat-small")] if name == "gpu-a1" else []
        await cp.agents.report(node, AgentReport(
            node=name, fabrics=fabrics, weights=weights, replicas=per_node.get(name, []),
            inventory=NodeInventory(hostname=name, source="fake", driver_version="550.54.15",
                                    devices=devices)))


@contextlib.asynccontextmanager
async def keep_reporting(cp: ControlPlane, tokens: dict[str, str]) -> AsyncIterator[None]:
    """Report every few seconds, so nodes stay reachable for the whole module."""

    async def loop() -> None:
        while True:
            await asyncio.sleep(5)
            await report_all(cp, tokens)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
