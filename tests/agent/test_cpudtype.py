"""vLLM on a CPU slot computes in float32 where the CPU is slow at bfloat16 (engines.cpudtype)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.agent.helpers import assign, cpu_slot, gpu, model

from llmgw.agent.engines import cpudtype
from llmgw.agent.engines.base import LaunchContext
from llmgw.agent.engines.vllm import VllmAdapter
from llmgw.wire import Device, WeightsSource

W = "/models/m"
# Flags lines of /proc/cpuinfo, trimmed: a 2-core AMD EPYC VM (AVX2 only), a
# Sapphire Rapids core (AMX), an Arm core.
EPYC = "processor\t: 0\nflags\t\t: fpu sse2 avx f16c fma avx2 bmi2\n"
SPR = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n"


def argv(
    monkeypatch: pytest.MonkeyPatch, native: bool | None, devices: list[Device], args: list[str]
) -> list[str]:
    monkeypatch.setattr("llmgw.agent.engines.vllm.native_bf16", lambda: native)
    classes = [d.gpu_class for d in devices]
    spec = model("vllm", name="m", weights=WeightsSource(kind="local", path=W),
                 engine_args=args, gpu_classes=classes)  # fmt: skip
    ctx = LaunchContext(assignment=assign(spec, devices), weights_path=W, host="h", port=1,
                        devices=devices)  # fmt: skip
    return VllmAdapter("/opt/vllm/bin/vllm").build(ctx).argv


def dtype(argv: list[str]) -> str | None:
    return argv[argv.index("--dtype") + 1] if "--dtype" in argv else None


def test_a_cpu_slot_without_native_bfloat16_gets_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    assert dtype(argv(monkeypatch, False, [cpu_slot(0)], [])) == "float32"


@pytest.mark.parametrize("native", [True, None])
def test_a_cpu_with_bfloat16_or_unknown_keeps_the_model_s_type(
    monkeypatch: pytest.MonkeyPatch, native: bool | None
) -> None:
    assert dtype(argv(monkeypatch, native, [cpu_slot(0)], [])) is None


def test_a_gpu_keeps_the_model_s_type(monkeypatch: pytest.MonkeyPatch) -> None:
    assert dtype(argv(monkeypatch, False, [gpu(0)], [])) is None


@pytest.mark.parametrize("args", [["--dtype", "bfloat16"], ["--dtype=float16"]])
def test_the_catalog_s_dtype_wins(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> None:
    built = argv(monkeypatch, False, [cpu_slot(0)], args)
    assert built.count("--dtype") + sum(a.startswith("--dtype=") for a in built) == 1


@pytest.mark.parametrize(
    ("text", "native"), [(EPYC, False), (SPR, True), (ARM, None), ("", None)]
)
def test_native_bf16_read_from_cpuinfo(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str, native: bool | None
) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(text)
    monkeypatch.setattr(cpudtype, "CPUINFO", info)
    cpudtype.native_bf16.cache_clear()
    try:
        assert cpudtype.native_bf16() is native
    finally:
        cpudtype.native_bf16.cache_clear()


def test_no_cpuinfo_is_unknown(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cpudtype, "CPUINFO", tmp_path / "missing")
    cpudtype.native_bf16.cache_clear()
    try:
        assert cpudtype.native_bf16() is None
    finally:
        cpudtype.native_bf16.cache_clear()
