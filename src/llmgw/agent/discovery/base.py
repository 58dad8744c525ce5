"""What a discovery source reads, before it becomes wire devices.

Both sources (NVML and nvidia-smi) fill the same plain facts -- one
:class:`CardFacts` per physical card, with its MIG instances -- and a single
function (:mod:`llmgw.agent.discovery.devices`) turns those facts into
:class:`llmgw.wire.Device` entries. The MIG rules (numbering, classes, shared
memory, "nothing carved") therefore live in one place: two sources that each
applied them would sooner or later disagree about the same card.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

SourceName = Literal["nvml", "nvidia-smi"]


class SourceUnavailable(Exception):  # a state, not a failure
    """The source does not exist on this machine (no library, no driver, no tool).

    Not an error: a machine without NVIDIA software is a CPU node. ``warning``
    is set when the absence is worth telling an operator (the tool exists but
    the driver does not answer); it is None for the ordinary "not installed".
    Never leaves the discovery package.
    """

    def __init__(self, message: str, *, warning: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.warning = warning


@dataclass
class ProcessFacts:
    pid: int
    name: str = ""
    used_memory_mib: int = 0
    # Set in MIG mode: nvidia-smi lists processes on the parent card with the
    # instance they run on; None for a process on a whole card.
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


@dataclass
class HealthFacts:
    """The card's own word on its health and wear; None means "cannot say"."""

    ecc_volatile_uncorrected: int | None = None
    ecc_aggregate_uncorrected: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_pending: bool | None = None
    remapping_failed: bool | None = None
    reset_required: bool | None = None
    unrepairable_memory: bool | None = None
    lost: bool = False  # fallen off the bus ("GPU is lost")
    unknown_error: bool = False  # the driver answers "Unknown Error"
    detail: list[str] = field(default_factory=list)  # raw messages worth showing
    # Xid errors NVML delivered for the whole card (discovery.xid), each a full reason.
    xid_errors: list[str] = field(default_factory=list)


@dataclass
class InstanceFacts:
    """One MIG compute instance, as the source saw it."""

    uuid: str  # MIG-<uuid>, or the legacy MIG-GPU-<uuid>/<gi>/<ci>
    profile: str  # "3g.40gb", "1c.3g.71gb", "1g.10gb+me"
    gpu_instance_id: int
    compute_instance_id: int
    memory_total_mib: int = 0
    memory_used_mib: int = 0
    processes: list[ProcessFacts] = field(default_factory=list)
    # Failures of this instance alone (an Xid event naming its GI/CI); the
    # card's own health applies to every instance on top of these.
    unhealthy_reasons: list[str] = field(default_factory=list)


@dataclass
class CardFacts:
    """One physical card and, in MIG mode, its instances."""

    index: int  # NVML / nvidia-smi index (PCI bus order)
    uuid: str
    name: str
    memory_total_mib: int = 0
    memory_used_mib: int = 0
    utilization_pct: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    # None: the card or driver predates MIG (no such setting at all).
    mig_current: bool | None = None
    mig_pending: bool | None = None
    instances: list[InstanceFacts] = field(default_factory=list)
    processes: list[ProcessFacts] = field(default_factory=list)
    health: HealthFacts = field(default_factory=HealthFacts)
    pci_bus_id: str | None = None


@dataclass
class SourceReading:
    """Everything one source read in one pass."""

    source: SourceName
    driver_version: str | None = None
    cuda_version: str | None = None
    cards: list[CardFacts] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


class Source(Protocol):
    """A way to read the node's GPUs.

    ``read`` returns a complete snapshot, raises :class:`SourceUnavailable`
    when the source does not exist here, or raises
    :class:`llmgw.errors.DiscoveryError` when it answered with something that
    cannot be understood -- never a half-read snapshot.
    """

    name: SourceName

    def read(self) -> SourceReading: ...
