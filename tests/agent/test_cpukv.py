"""vLLM on a CPU slot gets a KV cache its memory budget holds (engines.cpukv).

Left to itself, vLLM's CPU worker takes 0.92 of the node's RAM: past any
replica's budget. Where the catalog sizes the cache (its env or flags),
or the engine runs on a GPU, nothing is added.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tests.agent.helpers import assign, cpu_slot, gpu, model

from llmgw.agent.engines.base import LaunchContext
from llmgw.agent.engines.cpukv import MIN_KV_MIB, VLLM_CPU_RUNTIME_MIB
from llmgw.agent.engines.vllm import VllmAdapter
from llmgw.agent.replicalaunch import launch_context
from llmgw.memory import GPU_ENGINE_HOST_MIB, GPU_ENGINE_HOST_MIB_PER_DEVICE, MIB
from llmgw.wire import Device, WeightsSource

W = "/models/m"
WEIGHTS = 512 * MIB


def argv(
    monkeypatch: pytest.MonkeyPatch, devices: list[Device], args: list[str],
    env: dict[str, str] | None = None, budget: int | None = 8192, native: bool = True,
) -> list[str]:  # fmt: skip
    monkeypatch.setattr("llmgw.agent.engines.vllm.native_bf16", lambda: native)
    spec = model("vllm", name="m", weights=WeightsSource(kind="local", path=W),
                 engine_args=args, gpu_classes=[d.gpu_class for d in devices],
                 env=env or {})  # fmt: skip
    ctx = LaunchContext(assignment=assign(spec, devices), weights_path=W, host="h", port=1,
                        devices=devices, memory_budget_mib=budget,
                        weights_bytes=WEIGHTS)  # fmt: skip
    return VllmAdapter("/opt/vllm/bin/vllm").build(ctx).argv


def kv_mib(argv: list[str]) -> int | None:
    if "--kv-cache-memory-bytes" not in argv:
        return None
    return int(argv[argv.index("--kv-cache-memory-bytes") + 1]) // MIB


def test_the_budget_left_beside_runtime_and_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kv_mib(argv(monkeypatch, [cpu_slot(0)], [])) == 8192 - VLLM_CPU_RUNTIME_MIB - 512


def test_float32_holds_the_weights_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen = argv(monkeypatch, [cpu_slot(0)], [], native=False)  # the agent picks float32
    assert kv_mib(chosen) == 8192 - VLLM_CPU_RUNTIME_MIB - 1024
    named = argv(monkeypatch, [cpu_slot(0)], ["--dtype", "float32"])
    assert kv_mib(named) == 8192 - VLLM_CPU_RUNTIME_MIB - 1024


def test_never_below_the_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kv_mib(argv(monkeypatch, [cpu_slot(0)], [], budget=4096)) == MIN_KV_MIB


@pytest.mark.parametrize(
    ("args", "env"),
    [
        ([], {"VLLM_CPU_KVCACHE_SPACE": "1"}),
        (["--kv-cache-memory-bytes", "1000000000"], None),
        (["--gpu-memory-utilization=0.3"], None),
        (["--gpu_memory_utilization", "0.3"], None),
    ],
)
def test_the_catalog_s_own_size_wins(
    monkeypatch: pytest.MonkeyPatch, args: list[str], env: dict[str, str] | None
) -> None:
    built = argv(monkeypatch, [cpu_slot(0)], args, env)
    assert built.count("--kv-cache-memory-bytes") == (1 if "--kv-cache-memory-bytes" in args else 0)


def test_a_gpu_or_no_budget_leaves_it_to_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kv_mib(argv(monkeypatch, [gpu(0)], [])) is None
    assert kv_mib(argv(monkeypatch, [cpu_slot(0)], [], budget=None)) is None


# The replica's budget (agent.replicalaunch.launch_context), which the KV
# cache is sized to and the agent enforces.


class _Deps:
    host = "h"

    @staticmethod
    def engine_tls() -> None:
        return None


async def budget_and_kv(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, engine: str, devices: list[Device],
    args: list[str], native: bool, weights: int,
) -> tuple[int, int | None]:  # fmt: skip
    monkeypatch.setattr("llmgw.agent.replicalaunch.native_bf16", lambda: native)
    monkeypatch.setattr("llmgw.agent.engines.vllm.native_bf16", lambda: native)
    (tmp_path / "model.safetensors").write_bytes(b"")
    os.truncate(tmp_path / "model.safetensors", weights)  # sparse: the size is what counts
    spec = model(engine, name="m", weights=WeightsSource(kind="local", path=str(tmp_path)),
                 engine_args=args, gpu_classes=[d.gpu_class for d in devices])  # fmt: skip
    ctx, budget = await launch_context(assign(spec, devices), devices, _Deps(),  # type: ignore[arg-type]
                                       str(tmp_path), 1)  # fmt: skip
    if engine != "vllm":
        return budget, None
    return budget, kv_mib(VllmAdapter("/opt/vllm/bin/vllm").build(ctx).argv)


async def test_float32_on_a_cpu_counts_the_weights_twice_in_the_budget(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    weights_mib = 5 * 1024  # past what one count of them left room for
    budget, kv = await budget_and_kv(monkeypatch, tmp_path, "vllm", [cpu_slot(0)], [],
                                     native=False, weights=weights_mib * MIB)  # fmt: skip
    assert budget == GPU_ENGINE_HOST_MIB + 2 * weights_mib
    # The engine fits its budget with a KV cache above the floor.
    assert kv is not None and kv > MIN_KV_MIB
    assert VLLM_CPU_RUNTIME_MIB + 2 * weights_mib + kv <= budget
    named, _ = await budget_and_kv(monkeypatch, tmp_path, "vllm", [cpu_slot(0)],
                                   ["--dtype=float32"], native=True,
                                   weights=weights_mib * MIB)  # fmt: skip
    assert named == budget


@pytest.mark.parametrize(
    ("engine", "gpu_slot", "args", "native"),
    [
        ("vllm", False, [], True),  # computes bfloat16 natively
        ("vllm", False, ["--dtype", "bfloat16"], False),  # the catalog chose
        ("vllm", True, [], False),  # on a GPU
        ("sglang", False, [], False),  # the float32 rule is vLLM's
    ],
)
async def test_the_weights_count_once_otherwise(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, engine: str, gpu_slot: bool,
    args: list[str], native: bool,
) -> None:  # fmt: skip
    devices = [gpu(0)] if gpu_slot else [cpu_slot(0)]
    budget, _ = await budget_and_kv(monkeypatch, tmp_path, engine, devices, args, native,
                                    weights=1024 * MIB)  # fmt: skip
    per_device = GPU_ENGINE_HOST_MIB_PER_DEVICE if gpu_slot else 0
    assert budget == GPU_ENGINE_HOST_MIB + 1024 + per_device
