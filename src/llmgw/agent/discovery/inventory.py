"""``discover()``: the node's inventory, from the best source that answers.

NVML first (one library call per fact, no process to spawn), nvidia-smi when
NVML is unavailable, and a CPU-only inventory when neither exists: a machine
without GPUs is a node with CPU slots, not an error. A source that answers
with something unreadable raises DiscoveryError -- the caller reports it as a
warning -- rather than producing a half-filled inventory.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

from llmgw.agent.discovery.base import Source, SourceReading, SourceUnavailable
from llmgw.agent.discovery.devices import build_devices
from llmgw.agent.discovery.health import LastSeen
from llmgw.agent.discovery.nvidia_smi import NvidiaSmiSource
from llmgw.agent.discovery.nvml import NvmlApi, NvmlSource
from llmgw.agent.discovery.xid import XidMarks
from llmgw.errors import ConfigError, DiscoveryError
from llmgw.wire import CPU_CLASS, Device, NodeInventory, device_label

# Shared by every discover() call that brings no cache of its own, so wear seen
# before a card entered MIG mode survives from one report to the next.
_DEFAULT_CACHE = LastSeen()


def cpu_devices(cpu_slots: int, hostname: str) -> list[Device]:
    """``cpu_slots`` placeable CPU slots; their UUIDs stay the same across restarts."""
    if cpu_slots < 0:
        raise ConfigError(f"cpu_slots must be 0 or more, not {cpu_slots}")
    return [
        Device(
            number=n,
            label=device_label(n, CPU_CLASS),
            uuid=f"CPU-{hostname}-{n}",
            name="cpu",
            gpu_class=CPU_CLASS,
        )
        for n in range(cpu_slots)
    ]


def inventory_from(
    snapshot: SourceReading,
    *,
    hostname: str,
    cpu_slots: int = 1,
    class_overrides: Mapping[str, str] | None = None,
    cache: LastSeen | None = None,
    xids: XidMarks | None = None,
) -> NodeInventory:
    """The inventory one source's snapshot describes, with the Xid marks in ``xids``."""
    seen = cache if cache is not None else _DEFAULT_CACHE
    for card in snapshot.cards:
        seen.apply(card)
        if xids is not None:
            xids.apply(card)
    warnings = list(snapshot.warnings)
    devices = build_devices(snapshot.cards, class_overrides=class_overrides, warnings=warnings)
    if not devices:  # the driver answers but has no GPU: a CPU node after all
        devices = cpu_devices(cpu_slots, hostname)
    return NodeInventory(
        hostname=hostname,
        source=snapshot.source,
        driver_version=snapshot.driver_version,
        cuda_version=snapshot.cuda_version,
        devices=devices,
        warnings=warnings,
    )


def discover(
    *,
    cpu_slots: int = 1,
    class_overrides: dict[str, str] | None = None,
    nvml: NvmlApi | None = None,
    nvidia_smi: str | None = None,
    cache: LastSeen | None = None,
    hostname: str | None = None,
    xids: XidMarks | None = None,
) -> NodeInventory:
    """What this node has: GPUs (as cards or MIG instances) or CPU slots.

    ``nvml`` replaces the pynvml module (tests pass a FakeNvml); ``nvidia_smi``
    the executable (else ``LLMGW_NVIDIA_SMI``, else ``nvidia-smi``); ``xids``
    the marks an :class:`~llmgw.agent.discovery.xid.XidWatcher` records.
    """
    host = hostname or socket.gethostname()
    if cpu_slots < 0:
        raise ConfigError(f"cpu_slots must be 0 or more, not {cpu_slots}")
    seen = cache if cache is not None else _DEFAULT_CACHE
    sources: list[Source] = [NvmlSource(nvml, cache=seen), NvidiaSmiSource(nvidia_smi)]
    notes: list[str] = []
    failures: list[str] = []
    for source in sources:
        try:
            snapshot = source.read()
            inventory = inventory_from(
                snapshot,
                hostname=host,
                cpu_slots=cpu_slots,
                class_overrides=class_overrides,
                cache=seen,
                xids=xids,
            )
        except SourceUnavailable as absent:
            if absent.warning:
                notes.append(f"{source.name}: {absent.message}")
            continue
        except DiscoveryError as exc:  # the next source may still describe the node
            failures.append(str(exc))
            continue
        inventory.warnings[:0] = notes + failures
        return inventory
    if failures:
        raise DiscoveryError("; ".join(failures))
    return NodeInventory(
        hostname=host, source="none", devices=cpu_devices(cpu_slots, host), warnings=notes
    )
