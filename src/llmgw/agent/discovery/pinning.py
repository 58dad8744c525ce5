"""The environment that pins an engine process to the devices it was given.

Without it an engine sees every GPU on the node and takes the first, which is
usually another replica's.

* Whole cards: ``CUDA_VISIBLE_DEVICES`` by UUID, never by index -- CUDA's
  default order (fastest first) differs from NVML's (PCI bus), so an index
  from discovery can name a different card inside the engine. The UUIDs
  make the order irrelevant; ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` keeps any
  index the engine prints consistent with ours.
* Vulkan engines (llama.cpp's Vulkan build) also get ``GGML_VK_VISIBLE_DEVICES``:
  indices into Vulkan's own enumeration, which has no UUID form. By default
  the card's NVML index is used, which matches Vulkan's order on a node
  whose GPUs are all NVIDIA; pass ``vulkan_order`` (card UUIDs in Vulkan's
  order) where that is not so.
* A MIG instance: ``CUDA_VISIBLE_DEVICES=MIG-<uuid>``. A CUDA process can open
  only one MIG device, and Vulkan cannot see instances at all, so a Vulkan
  engine on an instance is refused rather than left to grab whole cards.
* CPU slots: ``CUDA_VISIBLE_DEVICES=""`` so that a CUDA-capable build stays on
  the CPU it was placed on, and ``GGML_VK_VISIBLE_DEVICES=""`` for a Vulkan
  build, which ignores CUDA's variable and would otherwise use every GPU
  (ggml-vulkan takes the listed indices, none here, whenever the variable is set).
"""

from __future__ import annotations

from collections.abc import Sequence

from llmgw.errors import EngineError
from llmgw.wire import CPU_CLASS, Device


def _is_cpu(device: Device) -> bool:
    return device.gpu_class == CPU_CLASS


def engine_env(
    devices: Sequence[Device],
    *,
    vulkan: bool,
    vulkan_order: Sequence[str] | None = None,
) -> dict[str, str]:
    """Variables to add to an engine's environment for ``devices``."""
    if not devices or all(_is_cpu(d) for d in devices):
        if vulkan:  # a Vulkan build reads no CUDA variable; an empty list hides every GPU
            return {"CUDA_VISIBLE_DEVICES": "", "GGML_VK_VISIBLE_DEVICES": ""}
        return {"CUDA_VISIBLE_DEVICES": ""}
    if any(_is_cpu(d) for d in devices):
        raise EngineError("an engine cannot run on CPU slots and GPUs at once")
    migs = [d for d in devices if d.mig is not None]
    if migs:
        if len(devices) > 1:
            raise EngineError(
                f"a MIG instance must be an engine's only device, got {len(devices)} devices "
                "(a CUDA process opens one MIG device, and instances share no NVLink)"
            )
        if vulkan:
            raise EngineError(
                f"{migs[0].label} is a MIG instance, which Vulkan cannot see: "
                "run a CUDA build of the engine there"
            )
        return {"CUDA_VISIBLE_DEVICES": migs[0].uuid, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    uuids = [d.uuid for d in devices]
    if len(set(uuids)) != len(uuids):
        raise EngineError(f"a device is listed twice: {', '.join(uuids)}")
    env = {"CUDA_VISIBLE_DEVICES": ",".join(uuids), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    if vulkan:
        env["GGML_VK_VISIBLE_DEVICES"] = ",".join(_vulkan_indices(devices, vulkan_order))
    return env


def _vulkan_indices(devices: Sequence[Device], order: Sequence[str] | None) -> list[str]:
    if order is None:
        return [str(d.number) for d in devices]
    position = {uuid: n for n, uuid in enumerate(order)}
    missing = [d.uuid for d in devices if d.uuid not in position]
    if missing:
        raise EngineError(f"Vulkan does not list {', '.join(missing)}")
    return [str(position[d.uuid]) for d in devices]
