"""What a node has (agent -> control plane): its devices, as placement counts them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Literal

from pydantic import Field, field_validator

from llmgw.wire.base import INT32_MAX, Int64, Wire

CPU_CLASS = "cpu"
MIG_CLASS_MARKER = "-mig-"
MIG_NUMBER_BASE = 1000


def is_mig_class(gpu_class: str) -> bool:
    return MIG_CLASS_MARKER in gpu_class


def mig_number(card_index: int, instance: int) -> int:
    """The placement number of a MIG instance: ``1000 + 100 x card + instance``.

    Instances need numbers that can never collide with a card index and still
    say which card they live on; ``card/migN`` is how they are shown.
    """
    return MIG_NUMBER_BASE + 100 * card_index + instance


def device_label(number: int, gpu_class: str | None = None) -> str:
    """How every view and message names a device: ``"3"`` for card 3,
    ``"0/mig1"`` for instance 1 of card 0, ``"cpu0"`` for CPU slot 0.

    A CPU slot's number looks like a card's, so the label needs the class
    (``gpu_class``) to tell them apart; MIG numbers say what they are.
    """
    if gpu_class == CPU_CLASS:
        return f"cpu{number}"
    if number >= MIG_NUMBER_BASE:
        card, instance = divmod(number - MIG_NUMBER_BASE, 100)
        return f"{card}/mig{instance}"
    return str(number)


def device_label_on(devices: Sequence[Device], number: int) -> str:
    """:func:`device_label` of device ``number`` on a node that lists ``devices``.

    For views and messages that hold only a shard's device numbers: the class
    comes from the node's inventory. A number the inventory does not list is
    named as a CPU slot on a node of CPU slots, and as a card otherwise.
    """
    for device in devices:
        if device.number == number:
            return device_label(number, device.gpu_class)
    cpu_node = bool(devices) and all(d.gpu_class == CPU_CLASS for d in devices)
    return device_label(number, CPU_CLASS if cpu_node else None)



class GpuProcess(Wire):
    pid: Int64
    name: str = ""
    used_memory_mib: Int64 = 0


class MigInfo(Wire):
    """Where a MIG instance lives on its card."""

    parent_uuid: str
    parent_index: Int64
    gpu_instance_id: Int64
    compute_instance_id: Int64
    profile: str  # e.g. "3g.40gb" or "1c.3g.40gb"


class Device(Wire):
    """One placeable unit: a whole card, a MIG instance, or a CPU slot.

    The scheduler places replicas on devices, never on cards, so a card in MIG
    mode appears only as its instances and a CPU-only node as its slots.
    """

    # Card index, MIG number (1000 + 100 x card + instance) or CPU slot. The
    # bounds (here and on the memory) are the store's integer columns': a
    # report past them failed its write, a 503 for the node's every report.
    number: int = Field(ge=0, le=INT32_MAX)
    label: str  # "0", "0/mig1", "cpu0"
    uuid: str  # GPU-…, MIG-…, or a stable id for a CPU slot
    name: str  # product name, "NVIDIA A100-SXM4-80GB"; "cpu" for slots
    gpu_class: str  # "a100-80g", "a100-80g-mig-3g.40gb", "cpu"
    memory_total_mib: int = Field(default=0, ge=0, le=INT32_MAX)
    memory_used_mib: Int64 = 0
    # None when the source cannot say (always for MIG instances): a 0 would
    # claim an idle device that may be saturated.
    utilization_pct: Int64 | None = None
    temperature_c: Int64 | None = None
    power_w: float | None = None
    healthy: bool = True
    unhealthy_reasons: list[str] = Field(default_factory=list)
    # False for a device that is healthy but cannot take work, e.g. a card in
    # MIG mode with no instances carved, or a mode change pending a reset.
    placeable: bool = True
    unplaceable_reason: str | None = None
    mig: MigInfo | None = None
    processes: list[GpuProcess] = Field(default_factory=list)
    # Wear counters, the card's (also for its instances).
    ecc_uncorrected: Int64 | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_pending: bool | None = None
    remapping_failed: bool | None = None


class NodeInventory(Wire):
    hostname: str
    source: Literal["nvml", "nvidia-smi", "fake", "none"] = "none"
    driver_version: str | None = None
    cuda_version: str | None = None
    devices: list[Device] = Field(default_factory=list)
    # Problems met while discovering, e.g. "nvidia-smi -L: exit 9"; the node
    # still registers, with what could be found.
    warnings: list[str] = Field(default_factory=list)
    # The node's RAM (llmgw.memory): CPU replicas are placed against it.
    # None from an agent that does not report it: placement then takes the
    # node's word that it fits, as it did before RAM was reported.
    memory_total_mib: Int64 | None = Field(None, ge=0)
    # Whether the node's CPU computes bfloat16 natively (AVX-512 BF16, AMX);
    # None where the agent cannot tell. Without them the agent runs vLLM on a
    # CPU slot in float32, which holds the weights twice: placement charges
    # that (llmgw.memory.RamNeed).
    cpu_bf16: bool | None = None
    # Catalog env names this node's admin allows beyond each engine's own
    # settings (``llmgw agent --engine-env-allow``; llmgw.engine_env).
    engine_env_allow: list[str] = Field(default_factory=list, max_length=256)

    @field_validator("devices")
    @classmethod
    def _one_device_per_number(cls, devices: list[Device]) -> list[Device]:
        # A number names one device (placement, the store's rows): two
        # devices under one failed the store's write, a 503 for each of the
        # node's reports (found by schemathesis over the agent API).
        if len({device.number for device in devices}) != len(devices):
            counts = Counter(device.number for device in devices)
            twice = sorted(number for number, count in counts.items() if count > 1)
            raise ValueError(f"device numbers must be unique; {twice} given more than once")
        return devices

