"""How much RAM vLLM's CPU build gives its KV cache, where the catalog says nothing of it.

Left to itself, vLLM's CPU worker (0.32, v1/worker/cpu_worker.py) takes
``--gpu-memory-utilization`` of the node's whole RAM (0.92 by default) for
the model and its KV cache: far past the replica's memory budget, so the
agent would stop the engine for outgrowing it, and on a node running
anything else it refuses to start. Where the entry sets neither
``VLLM_CPU_KVCACHE_SPACE`` (its env) nor ``--kv-cache-memory-bytes`` or
``--gpu-memory-utilization`` (its engine_args), the engine on a CPU slot
gets an explicit KV cache: what its budget leaves beside the runtime and
the weights, in the type it computes in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from llmgw.memory import MIB

# The engine's processes besides weights and KV cache: the API server, the
# engine core and its worker, each with torch. Measured with the starter
# model: 5.4 GiB of summed RSS with 0.5 GB of weights and a 1 GiB KV cache.
VLLM_CPU_RUNTIME_MIB = 4096
# Never less than this for the KV cache: a few thousand tokens of a small
# model, enough to start; a budget too small for the model fails it anyway,
# with the agent's reason.
MIN_KV_MIB = 512
KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
_KV_FLAGS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization")


def sizes_kv(engine_args: Sequence[str], env: Mapping[str, str]) -> bool:
    """Whether the catalog entry sizes vLLM's CPU KV cache itself."""
    if env.get(KV_ENV):
        return True
    flags = {a.partition("=")[0].replace("_", "-") for a in engine_args if a.startswith("--")}
    return any(flag in flags for flag in _KV_FLAGS)


def cpu_kv_args(
    budget_mib: int | None, weights_bytes: int | None, float32: bool
) -> list[str]:  # fmt: skip
    """``--kv-cache-memory-bytes`` for an engine on a CPU slot with this budget.

    ``float32``: the engine computes in float32 (cpudtype), which holds the
    weights at twice a bfloat16 checkpoint's size. None of a budget: the
    engine runs without one, and vLLM's own rule stands.
    """
    if budget_mib is None:
        return []
    weights_mib = -(-(weights_bytes or 0) // MIB) * (2 if float32 else 1)
    kv_mib = max(MIN_KV_MIB, budget_mib - VLLM_CPU_RUNTIME_MIB - weights_mib)
    return ["--kv-cache-memory-bytes", str(kv_mib * MIB)]
