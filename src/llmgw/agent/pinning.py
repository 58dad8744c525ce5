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


class Discoverer:
    """Calls discovery with a memory of what cards reported before.

    In MIG mode a card stops reporting utilisation and remapped rows; the
    discovery package carries the last values seen (``LastSeen``) when it is
    given the same object on every call, which this class holds.
    """

    def __init__(self, cpu_slots: int = 1, class_overrides: Mapping[str, str] | None = None):
        self.cpu_slots = cpu_slots
        self.class_overrides = dict(class_overrides or {}) or None
        make_cache = _optional("llmgw.agent.discovery", "LastSeen")
        self._cache = make_cache() if make_cache is not None else None

    def __call__(self) -> NodeInventory:
        real = _optional("llmgw.agent.discovery", "discover")
        if real is None:
            return cpu_inventory(self.cpu_slots)
        kwargs: dict[str, Any] = {
            "cpu_slots": self.cpu_slots,
            "class_overrides": self.class_overrides,
        }
        if self._cache is not None:
            kwargs["cache"] = self._cache
        return cast(NodeInventory, real(**kwargs))


def engine_env(devices: Sequence[Device], vulkan: bool = False) -> dict[str, str]:
    """The environment that pins an engine to ``devices``."""
    real = _optional("llmgw.agent.discovery.pinning", "engine_env")
    if real is None:
        return fallback_engine_env(devices, vulkan=vulkan)
    return dict(real(list(devices), vulkan=vulkan))
