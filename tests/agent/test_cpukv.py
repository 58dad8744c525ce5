"""vLLM on a CPU slot gets a KV cache its memory budget holds (engines.cpukv).

Left to itself, vLLM's CPU worker takes 0.92 of the node's RAM: past any
replica's budget. Where the catalog sizes the cache (its env or flags),
or the engine runs on a GPU, nothing is added.
"""

from __future__ import annotations

import pytest
from tests.agent.helpers import assign, cpu_slot, gpu, model

from llmgw.agent.engines.base import LaunchContext
from llmgw.agent.engines.cpukv import MIN_KV_MIB, VLLM_CPU_RUNTIME_MIB
from llmgw.agent.engines.vllm import VllmAdapter
from llmgw.memory import MIB
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
