"""Builders shared by the agent tests: devices, fake NVML cards, models, assignments,
and an agent running for a test."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator
from pathlib import Path

from llmgw.agent.app import Agent
from llmgw.agent.discovery.fake import FakeGpu, FakeMig, FakeNvml
from llmgw.wire import (
    Device,
    EngineKind,
    MigInfo,
    ModelSpec,
    ReplicaAssignment,
    ShardAssignment,
    WeightsSource,
)


def gpu(number: int, gpu_class: str = "h100-80g") -> Device:
    return Device(
        number=number,
        label=str(number),
        uuid=f"GPU-0000000{number}-aaaa-bbbb-cccc-dddddddddddd",
        name="NVIDIA H100 80GB HBM3",
        gpu_class=gpu_class,
        memory_total_mib=81559,
    )


def mig_instance() -> Device:
    return Device(
        number=1001,
        label="0/mig1",
        uuid="MIG-11111111-2222-3333-4444-555555555555",
        name="NVIDIA A100-SXM4-80GB",
        gpu_class="a100-80g-mig-3g.40gb",
        memory_total_mib=40192,
        mig=MigInfo(
            parent_uuid="GPU-0000000a-aaaa-bbbb-cccc-dddddddddddd",
            parent_index=0,
            gpu_instance_id=1,
            compute_instance_id=0,
            profile="3g.40gb",
        ),
    )


def cpu_slot(number: int = 0, host: str = "h") -> Device:
    return Device(
        number=number,
        label=f"cpu{number}",
        uuid=f"CPU-{host}-{number}",
        name="cpu",
        gpu_class="cpu",
    )


def model(
    engine: EngineKind | str,
    *,
    name: str = "llama-3-70b",
    tp: int = 1,
    pp: int = 1,
    nodes: int = 1,
    engine_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    weights: WeightsSource | None = None,
    gpu_classes: list[str] | None = None,
    start_timeout_s: float = 600.0,
) -> ModelSpec:
    return ModelSpec(
        name=name,
        engine=EngineKind(engine),
        weights=weights or WeightsSource(kind="hf", repo="org/model", revision="abc123"),
        gpu_classes=gpu_classes or ["h100-80g"],
        gpus=tp * pp,
        tp=tp,
        pp=pp,
        nodes=nodes,
        engine_args=engine_args or [],
        env=env or {},
        start_timeout_s=start_timeout_s,
    )


def gemma(**fields: object) -> ModelSpec:
    """The small GGUF model on a CPU slot, as a llama.cpp catalog entry names it."""
    spec = model(
        "llamacpp",
        name="gemma-3-270m",
        weights=WeightsSource(kind="package", package="p"),
        gpu_classes=["cpu"],
    )
    return spec.model_copy(update=fields)


def assign(
    spec: ModelSpec,
    devices: list[Device],
    *,
    replica_id: str = "r1",
    node: str = "n1",
    rank: int = 0,
    generation: int = 1,
    leader: str | None = None,
) -> ReplicaAssignment:
    return ReplicaAssignment(
        replica_id=replica_id,
        generation=generation,
        model=spec,
        shard=ShardAssignment(
            node=node,
            rank=rank,
            device_numbers=[d.number for d in devices],
            device_uuids=[d.uuid for d in devices],
        ),
        nodes=spec.nodes,
        leader_address=leader,
    )


A100 = "NVIDIA A100-SXM4-80GB"
H100 = "NVIDIA H100 80GB HBM3"


def fake_migs(card: int | str, count: int, **fields: int) -> list[FakeMig]:
    """``count`` 1g.10gb instances of an A100 (MIG-<card>-<i>)."""
    return [
        FakeMig(uuid=f"MIG-{card}-{i}", profile="1g.10gb", gpu_instance_id=7 + i,
                memory_total_mib=9984, **fields)
        for i in range(count)
    ]  # fmt: skip


def fake_gpu_node(tag: str = "") -> FakeNvml:
    """A node's cards: an A100 in MIG mode (two 3g.40gb instances, its temperature and
    power), a whole H100 with utilisation, an H100 with uncorrected ECC errors.
    ``tag`` goes into the UUIDs, to tell two such nodes apart."""
    mig_card = FakeGpu(
        uuid=f"GPU-{tag}a", name=A100, memory_total_mib=81920, mig_mode=(1, 1),
        utilization_pct=55, temperature_c=61, power_mw=210_500,
        migs=[FakeMig(uuid=f"MIG-{tag}a-{i}", profile="3g.40gb", gpu_instance_id=1 + i,
                      memory_total_mib=40192, memory_used_mib=100 * (i + 1)) for i in range(2)],
    )  # fmt: skip
    whole = FakeGpu(uuid=f"GPU-{tag}h", name=H100, memory_total_mib=81559, memory_used_mib=2048,
                    utilization_pct=37, temperature_c=44, power_mw=120_000)  # fmt: skip
    broken = FakeGpu(uuid=f"GPU-{tag}x", name=H100, memory_total_mib=81559, utilization_pct=0,
                     ecc_volatile_uncorrected=3, ecc_aggregate_uncorrected=3)  # fmt: skip
    return FakeNvml([mig_card, whole, broken])


def write_gguf(path: Path, architecture: str, chat_template: str | None = None) -> str:
    """A GGUF file holding metadata only (no tensors), as llama.cpp writes its header:
    the architecture, a vocabulary array to skip, and the chat template if given."""
    def text(value: str) -> bytes:
        data = value.encode()
        return struct.pack("<Q", len(data)) + data

    entries = [text("general.architecture") + struct.pack("<I", 8) + text(architecture)]
    vocab = b"".join(text(token) for token in ("<pad>", "<bos>", "hello"))
    entries.append(text("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 3) + vocab)
    entries.append(text("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, 3) + bytes(12))
    if chat_template is not None:
        entries.append(text("tokenizer.chat_template") + struct.pack("<I", 8) + text(chat_template))
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(entries)) + b"".join(entries))
    return str(path)


@contextlib.asynccontextmanager
async def running(agent: Agent) -> AsyncIterator[Agent]:
    """``agent`` running until the block ends; then shut down, its engines stopped."""
    task = asyncio.create_task(agent.run())
    try:
        yield agent
    finally:
        await agent.shutdown(stop_engines=True)
        with contextlib.suppress(asyncio.CancelledError):
            await task
