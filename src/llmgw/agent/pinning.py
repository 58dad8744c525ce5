"""The agent's single door to discovery: inventory and device-pinning environment.

Discovery (``llmgw.agent.discovery``) owns the rules for reading GPUs and for
pinning an engine to them. The agent calls it through these two functions and
nothing else; when the discovery package does not provide them (a trimmed
install, or while it is being built), the fallbacks below keep a CPU node
working and pin GPUs the documented way (DESIGN.md §3, discovery issue item 5).
"""

from __future__ import annotations

import importlib
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from llmgw.wire import CPU_CLASS, Device, NodeInventory


def cpu_inventory(cpu_slots: int = 1) -> NodeInventory:
    """A node with no GPUs: ``cpu_slots`` placeable CPU slots of class ``cpu``."""
    hostname = socket.gethostname()
    devices = [
        Device(
            number=i, label=f"cpu{i}", uuid=f"CPU-{hostname}-{i}", name="cpu", gpu_class=CPU_CLASS
        )
        for i in range(max(0, cpu_slots))
    ]
    return NodeInventory(hostname=hostname, source="none", devices=devices)


def fallback_engine_env(devices: Sequence[Device], vulkan: bool = False) -> dict[str, str]:
    """Pin an engine to ``devices``: by UUID for CUDA, by index for Vulkan.

    An empty ``CUDA_VISIBLE_DEVICES`` for CPU slots keeps a CPU engine that
    was built with CUDA from quietly taking a GPU another replica holds.
    """
    gpus = [d for d in devices if d.gpu_class != CPU_CLASS]
    if not gpus:
        return {"CUDA_VISIBLE_DEVICES": ""}
    env = {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": ",".join(d.uuid for d in gpus),
    }
    # Vulkan does not see MIG instances: pinning one by index would name a
    # whole card that other replicas share.
    if vulkan and not any(d.mig is not None for d in gpus):
        env["GGML_VK_VISIBLE_DEVICES"] = ",".join(str(d.number) for d in gpus)
    return env


def _optional(module: str, name: str) -> Callable[..., Any] | None:
    try:
        found = getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None
    return cast(Callable[..., Any], found) if callable(found) else None


def discover(cpu_slots: int = 1, class_overrides: Mapping[str, str] | None = None) -> NodeInventory:
    """This node's inventory from discovery, or the CPU-only fallback."""
    real = _optional("llmgw.agent.discovery", "discover")
    if real is None:
        return cpu_inventory(cpu_slots)
    return cast(NodeInventory, real(cpu_slots=cpu_slots, class_overrides=class_overrides))


def engine_env(devices: Sequence[Device], vulkan: bool = False) -> dict[str, str]:
    """The environment that pins an engine to ``devices``."""
    real = _optional("llmgw.agent.discovery.pinning", "engine_env")
    if real is None:
        return fallback_engine_env(devices, vulkan=vulkan)
    return dict(real(devices, vulkan=vulkan))
