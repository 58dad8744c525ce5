"""How much host RAM one replica's engine may use: its memory budget.

Without a budget an engine grows until the kernel's OOM killer ends
*something* -- on a laptop running ``llmgw up``, maybe the browser, the
desktop or the agent itself -- and the replica is then retried on the same
node to do it again. With one, the scheduler places CPU replicas only where
their RAM fits, the llama.cpp adapter sizes the engine to it, and the agent
fails a replica that outgrows it with a reason that says so.

The control plane (placement) and the agent (enforcement) both compute the
budget here, from the same catalog entry and the same weights size, so the
RAM a node was charged for is the RAM its engine may use. A catalog entry
states its need with ``memory_mib``; without it the default is an estimate
per engine (see ``default_need_mib``). Pure functions: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmgw.wire import CPU_CLASS, LLAMACPP_KINDS, EngineKind, ModelSpec

MIB = 1024 * 1024

# llama.cpp: the Python server, the llama.cpp libraries and their compute
# buffers, plus the logits buffer llama-cpp-python keeps for one batch
# (n_batch x vocabulary floats: 512 MiB for Gemma's 262,144-token vocabulary).
# Measured: the gemma-3-270m engine is at 514 MiB of RSS when first ready.
LLAMACPP_RUNTIME_MIB = 768
# KV cache per token of context: f16 keys and values of a small or mid-size
# model with grouped-query attention (gemma-3-270m needs 18 KiB, a Llama 3
# 8B 128 KiB). Models larger than that should state ``memory_mib``.
LLAMACPP_KV_KIB_PER_TOKEN = 32
# Headroom: the rows of the logits buffer a long prompt touches, allocator
# slack, and the prompt cache when a catalog entry turns llama_cpp.server's
# ``--cache`` on (see agent.engines.llamacpp). Measured: with the cache off,
# the gemma-3-270m engine (n_ctx 8192) stays near 590 MiB under traffic.
LLAMACPP_PROMPT_CACHE_MIB = 512
# vLLM / SGLang: the host side of a GPU engine (API server, tokenizer,
# CUDA context, pinned staging buffers, CPU swap space) besides the weights
# it reads through the page cache while loading.
GPU_ENGINE_HOST_MIB = 8192
GPU_ENGINE_HOST_MIB_PER_DEVICE = 2048
# The simulated engine: one small Python process.
SIM_ENGINE_MIB = 512


def context_tokens(spec: ModelSpec) -> int:
    """The context the engine runs with (the agent passes kv_capacity_tokens as its n_ctx)."""
    return spec.kv_capacity_tokens


def flag_value(args: Sequence[str], flags: Sequence[str]) -> str | None:
    """The value of the last of ``flags`` in ``args`` (``--f v`` or ``--f=v``), or None."""
    found: str | None = None
    for index, item in enumerate(args):
        name, sep, value = item.partition("=")
        if name not in flags:
            continue
        if sep:
            found = value
        elif index + 1 < len(args):
            found = args[index + 1]
    return found


def kv_cache_mib(spec: ModelSpec) -> int:
    return -(-context_tokens(spec) * LLAMACPP_KV_KIB_PER_TOKEN // 1024)


def default_need_mib(
    spec: ModelSpec, weights_bytes: int | None, devices: int = 0, weights_copies: int = 1
) -> int:  # fmt: skip
    """The estimated RAM of one engine of ``spec`` when its catalog entry states none.

    ``weights_bytes``: the size of the model's weights, None while no node
    has fetched them (the estimate then holds the fixed part only; the agent,
    which knows the file, enforces the full one). ``devices``: GPUs the
    shard holds (0 on CPU slots). ``weights_copies``: how many times that
    size the engine holds (2 for vLLM computing a bfloat16 checkpoint in
    float32 on a CPU: the agent's word, agent.engines.cpudtype).
    """
    weights = -(-(weights_bytes or 0) // MIB) * weights_copies
    if spec.engine in LLAMACPP_KINDS:
        # The GGUF is memory-mapped: its pages count in the engine's RSS.
        return LLAMACPP_RUNTIME_MIB + weights + kv_cache_mib(spec) + LLAMACPP_PROMPT_CACHE_MIB
    if spec.engine is EngineKind.SIM:
        return SIM_ENGINE_MIB
    return GPU_ENGINE_HOST_MIB + weights + GPU_ENGINE_HOST_MIB_PER_DEVICE * devices


def float32_on_cpu(engine_args: Sequence[str], native_bf16: bool | None) -> bool:
    """Whether vLLM on a CPU slot computes in float32: named by the catalog
    (``--dtype float32``), or chosen by the agent where the node's CPU is known
    to lack bfloat16 instructions and the catalog names no type
    (agent.engines.cpudtype: bfloat16 in software is several times slower)."""
    dtype = flag_value(engine_args, ("--dtype",))
    if dtype is None:
        return native_bf16 is False
    return dtype in ("float32", "float")


def cpu_weights_copies(spec: ModelSpec, native_bf16: bool | None) -> int:
    """How many times its checkpoint's size an engine of ``spec`` on a CPU slot
    holds its weights in RAM: twice for vLLM computing in float32 (checkpoints
    are most often bfloat16; a float32 one counted twice errs on the safe
    side), once otherwise. ``native_bf16``: the node's CPU computes bfloat16
    natively; None where it cannot be told."""
    if spec.engine is EngineKind.VLLM and float32_on_cpu(spec.engine_args, native_bf16):
        return 2
    return 1


@dataclass(frozen=True, slots=True)
class RamNeed:
    """What placement charges one CPU shard of a model, by its node's CPU.

    ``float32`` where the node reports a CPU without bfloat16 instructions
    (the agent runs vLLM there in float32, its weights twice over),
    ``native`` elsewhere: a node that cannot tell gets what its agent, which
    cannot tell either, budgets.
    """

    native: int
    float32: int

    def on(self, cpu_bf16: bool | None) -> int:
        return self.float32 if cpu_bf16 is False else self.native

    @classmethod
    def of(cls, spec: ModelSpec, weights_bytes: int | None) -> RamNeed:
        return cls(
            need_mib(spec, weights_bytes, 0, cpu_weights_copies(spec, True)),
            need_mib(spec, weights_bytes, 0, cpu_weights_copies(spec, False)),
        )


def need_mib(
    spec: ModelSpec, weights_bytes: int | None, devices: int = 0, weights_copies: int = 1
) -> int:  # fmt: skip
    """The RAM budget of one engine of ``spec``: its ``memory_mib``, else the estimate."""
    if spec.memory_mib is not None:
        return spec.memory_mib
    return default_need_mib(spec, weights_bytes, devices, weights_copies)


def usable_mib(total_mib: int) -> int:
    """The part of a node's RAM placement hands to engines.

    The rest is left to the operating system, the agent and whatever else
    the machine runs (a desktop, on a laptop running ``llmgw up``): an
    eighth of it, at least 1 GiB and at most 8 GiB.
    """
    return max(0, total_mib - min(8192, max(1024, total_mib // 8)))


def places_on_ram(spec: ModelSpec) -> bool:
    """Whether placement charges this model's need against a node's RAM.

    CPU replicas live entirely in RAM, so RAM is what decides whether one
    fits. A GPU replica's host side is enforced by the agent but not placed
    against: GPU nodes are sized for their cards, and a default estimate
    that refused a card over host RAM would strand the GPU.
    """
    return CPU_CLASS in spec.gpu_classes


def gb(value_bytes: float) -> str:
    """Bytes as GB for reasons: "1.3 GB", "0.25 GB" (two figures under 10)."""
    value = value_bytes / (1024 * MIB)
    return f"{value:.2f} GB" if value < 10 else f"{value:.1f} GB"


def budget_sentence(used_bytes: float, budget_bytes: float) -> str:
    """``used 1.3 GB of its 1.0 GB budget``: the words every memory reason carries."""
    return f"used {gb(used_bytes)} of its {gb(budget_bytes)} budget"


# How the agent's reasons start when an engine ran out of its own budget
# (agent.memguard): the model's need is wrong, not the node.
BUDGET_FAILURE_STARTS = ("out of memory budget:", "killed by the kernel's OOM killer at its memory")


def budget_failure(reason: str | None) -> bool:
    """Whether a replica failed for running out of its memory budget."""
    return reason is not None and any(s in reason for s in BUDGET_FAILURE_STARTS)


def advice(spec: ModelSpec, budget_mib: int) -> str:
    """What to change when a replica of ``spec`` runs out of its budget."""
    stated = "" if spec.memory_mib is not None else ", estimated"
    text = f"Raise the model's memory_mib (now {budget_mib} MiB{stated})"
    if spec.engine in LLAMACPP_KINDS:
        text += f" or lower its context (kv_capacity_tokens, now {context_tokens(spec)})"
    # No full stop: the agent appends "; last output: ..." to reasons.
    return text
