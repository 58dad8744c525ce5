"""The number type an engine computes in on a CPU slot, where the catalog names none.

vLLM's CPU build takes a model's own type (``--dtype auto``): bfloat16 for
most recent checkpoints. x86 CPUs compute bfloat16 natively only with
AVX-512 BF16 or AMX; on the others (AVX2 servers, most AMD EPYC before
Zen 4) every bfloat16 product is converted in software, and prefill runs
about 6x slower than in float32 (Gemma 3 270M on a 2-core EPYC, vLLM 0.32:
1,491 prompt tokens in 31.7 s in bfloat16, 5.5 s in float32), although
vLLM's CPU platform lists bfloat16 as supported there. Such a CPU gets
float32, twice the weights' memory for a several times faster engine; a
CPU with the instructions, or a catalog entry that says ``--dtype``, keeps
what it has.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

from llmgw.memory import cpu_weights_copies, float32_on_cpu
from llmgw.wire import CPU_CLASS, Device, ModelSpec

# /proc/cpuinfo's names for the instructions that compute bfloat16.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The first processor's flags in a /proc/cpuinfo text (every core has the same)."""
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@functools.cache
def native_bf16() -> bool | None:
    """Whether this machine's CPU computes bfloat16 natively; None where it cannot be told."""
    try:
        flags = cpu_flags(CPUINFO.read_text(errors="replace"))
    except OSError:
        return None
    if not flags:
        return None
    if "avx2" not in flags:
        return None  # not x86 (an Arm CPU's own bfloat16 is another question): vLLM decides
    return bool(flags & NATIVE_BF16_FLAGS)


def on_cpu(devices: Sequence[Device]) -> bool:
    """Whether an engine given ``devices`` computes on the CPU (no devices: the CPU too)."""
    return all(d.gpu_class == CPU_CLASS for d in devices)


def names_dtype(engine_args: Sequence[str]) -> bool:
    return any(a == "--dtype" or a.startswith("--dtype=") for a in engine_args)


def cpu_dtype_args(
    devices: Sequence[Device], engine_args: Sequence[str], native: bool | None
) -> list[str]:
    """``--dtype float32`` for an engine on a CPU slow at bfloat16, unless the catalog chose."""
    if native is False and on_cpu(devices) and not names_dtype(engine_args):
        return ["--dtype", "float32"]
    return []


def computes_float32(
    devices: Sequence[Device], engine_args: Sequence[str], native: bool | None
) -> bool:  # fmt: skip
    """Whether an engine on ``devices`` computes in float32 on the CPU: chosen by the
    agent (cpu_dtype_args) or named by the catalog. A bfloat16 checkpoint then takes
    twice its size in RAM."""
    return on_cpu(devices) and float32_on_cpu(engine_args, native)


def weights_copies(spec: ModelSpec, devices: Sequence[Device], native: bool | None) -> int:
    """How many times its checkpoint's size an engine of ``spec`` holds its weights in RAM:
    on a CPU slot as placement charges it (llmgw.memory.cpu_weights_copies), else once."""
    return cpu_weights_copies(spec, native) if on_cpu(devices) else 1
