"""A fake NVML for tests and simulated nodes, built from plain specs or fixtures.

It answers the calls of :class:`llmgw.agent.discovery.nvml.NvmlApi` the way
the driver does -- including its failures, raised as pynvml's own exception
classes so the code under test sorts them exactly as it would on hardware:
utilisation and remapped rows are NOT_SUPPORTED in MIG mode, MIG slots are
sparse (NOT_FOUND), and a card can be made to fail any call, or to fall off
the bus after a number of calls.

:func:`fake_from_cards` builds one from parsed nvidia-smi fixtures, so the
same real capture drives both sources.
"""

from __future__ import annotations

import queue
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

from llmgw.agent.discovery.base import CardFacts, InstanceFacts, ProcessFacts
from llmgw.agent.discovery.devices import pending_mode
from llmgw.agent.discovery.nvml import GPU_IS_LOST, LIBRARY_NOT_FOUND, NOT_FOUND, NOT_SUPPORTED
from llmgw.agent.discovery.xid import EVENT_XID_CRITICAL, TIMEOUT, WHOLE_GPU

_MIB = 1024 * 1024


@dataclass
class FakeProcess:
    pid: int
    used_mib: int | None = 0
    name: str = ""


@dataclass
class FakeMig:
    uuid: str
    profile: str
    gpu_instance_id: int
    compute_instance_id: int = 0
    memory_total_mib: int = 0
    memory_used_mib: int = 0
    processes: list[FakeProcess] = field(default_factory=list)
    slot: int | None = None  # MIG handle index; defaults to its position
    parent: FakeGpu | None = field(default=None, repr=False, compare=False)


@dataclass
class FakeGpu:
    uuid: str
    name: str
    memory_total_mib: int = 0
    memory_used_mib: int = 0
    utilization_pct: int | None = 0
    temperature_c: int | None = 40
    power_mw: int | None = 100_000
    mig_mode: tuple[int, int] | None = None  # None: not MIG capable
    max_mig_devices: int = 7
    migs: list[FakeMig] = field(default_factory=list)
    processes: list[FakeProcess] = field(default_factory=list)
    ecc_volatile_uncorrected: int | None = 0
    ecc_aggregate_uncorrected: int | None = 0
    retired_pages_pending: bool | None = None
    remapped_rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)
    # Call name -> NVML error code it raises ("*" for every call on this card).
    fail: dict[str, int] = field(default_factory=dict)
    # After this many calls on its handles, every call raises GPU_IS_LOST.
    lost_after_calls: int | None = None
    calls: int = 0
    # Event types the card supports (nvmlDeviceGetSupportedEventTypes).
    event_types: int = EVENT_XID_CRITICAL


class FakeEventSet:
    """An NVML event set: the cards registered on it and the events waiting."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # id(FakeGpu) -> event mask
        self.events: queue.Queue[Any] = queue.Queue()
        self.freed = False


class FakeNvml:
    """Implements :class:`~llmgw.agent.discovery.nvml.NvmlApi` over FakeGpu specs."""

    def __init__(
        self,
        gpus: list[FakeGpu] | None = None,
        *,
        driver_version: str = "550.90.07",
        cuda_version: int = 12040,
        init_error: int | None = None,
    ) -> None:
        self.gpus = gpus if gpus is not None else []
        self.driver_version = driver_version
        self.cuda_version = cuda_version
        self.init_error = init_error
        self.initialised = False
        self.event_sets: list[FakeEventSet] = []
        # An NVML error code the next nvmlEventSetWait raises instead of waiting.
        self.wait_error: int | None = None

    @classmethod
    def absent(cls) -> FakeNvml:
        """NVML as on a machine without the driver: nvmlInit fails."""
        return cls(init_error=LIBRARY_NOT_FOUND)

    # -- plumbing ------------------------------------------------------------

    def _gpu(self, handle: Any, call: str) -> FakeGpu:
        gpu = handle.parent if isinstance(handle, FakeMig) else handle
        if not isinstance(gpu, FakeGpu):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu.calls += 1
        if gpu.lost_after_calls is not None and gpu.calls > gpu.lost_after_calls:
            raise pynvml.NVMLError(GPU_IS_LOST)
        code = gpu.fail.get(call, gpu.fail.get("*"))
        if code is not None:
            raise pynvml.NVMLError(code)
        return gpu

    # -- system --------------------------------------------------------------

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.initialised = False

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.cuda_version

    def nvmlSystemGetProcessName(self, pid: int) -> bytes:
        for gpu in self.gpus:
            for proc in [*gpu.processes, *(p for m in gpu.migs for p in m.processes)]:
                if proc.pid == pid and proc.name:
                    return proc.name.encode()
        raise pynvml.NVMLError(NOT_FOUND)

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._gpu(self.gpus[index], "nvmlDeviceGetHandleByIndex")

    # -- per device (cards and MIG handles) ---------------------------------

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        self._gpu(handle, "nvmlDeviceGetUUID")
        return str(handle.uuid)

    def nvmlDeviceGetName(self, handle: Any) -> str:
        gpu = self._gpu(handle, "nvmlDeviceGetName")
        return f"{gpu.name} MIG {handle.profile}" if isinstance(handle, FakeMig) else gpu.name

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        self._gpu(handle, "nvmlDeviceGetMemoryInfo")
        total, used = handle.memory_total_mib * _MIB, handle.memory_used_mib * _MIB
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        gpu = self._gpu(handle, "nvmlDeviceGetUtilizationRates")
        if isinstance(handle, FakeMig) or _mig_on(gpu) or gpu.utilization_pct is None:
            raise pynvml.NVMLError(NOT_SUPPORTED)
        return SimpleNamespace(gpu=gpu.utilization_pct, memory=0)

    def nvmlDeviceGetTemperatureV(self, handle: Any, sensor: int) -> int:
        return self.nvmlDeviceGetTemperature(handle, sensor)

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetTemperature")
        if isinstance(handle, FakeMig) or gpu.temperature_c is None:
            raise pynvml.NVMLError(NOT_SUPPORTED)
        return gpu.temperature_c

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetPowerUsage")
        if isinstance(handle, FakeMig) or gpu.power_mw is None:
            raise pynvml.NVMLError(NOT_SUPPORTED)
        return gpu.power_mw

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        gpu = self._gpu(handle, "nvmlDeviceGetMigMode")
        if gpu.mig_mode is None:
            raise pynvml.NVMLError(NOT_SUPPORTED)
        return list(gpu.mig_mode)

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetMaxMigDeviceCount")
        return gpu.max_mig_devices if _mig_on(gpu) else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: int) -> FakeMig:
        gpu = self._gpu(handle, "nvmlDeviceGetMigDeviceHandleByIndex")
        for position, mig in enumerate(gpu.migs):
            if (mig.slot if mig.slot is not None else position) == index:
                mig.parent = gpu
                return mig
        raise pynvml.NVMLError(NOT_FOUND)

    def nvmlDeviceGetGpuInstanceId(self, handle: Any) -> int:
        self._gpu(handle, "nvmlDeviceGetGpuInstanceId")
        return int(handle.gpu_instance_id)

    def nvmlDeviceGetComputeInstanceId(self, handle: Any) -> int:
        self._gpu(handle, "nvmlDeviceGetComputeInstanceId")
        return int(handle.compute_instance_id)

    def nvmlDeviceGetAttributes(self, handle: Any) -> Any:
        self._gpu(handle, "nvmlDeviceGetAttributes")
        raise pynvml.NVMLError(NOT_SUPPORTED)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        self._gpu(handle, "nvmlDeviceGetComputeRunningProcesses")
        return [
            SimpleNamespace(
                pid=p.pid, usedGpuMemory=None if p.used_mib is None else p.used_mib * _MIB
            )
            for p in handle.processes
        ]

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error: int, counter: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetTotalEccErrors")
        value = gpu.ecc_aggregate_uncorrected if counter == 1 else gpu.ecc_volatile_uncorrected
        if value is None:
            raise pynvml.NVMLError(NOT_SUPPORTED)
        return value

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetRetiredPagesPendingStatus")
        if gpu.retired_pages_pending is None:
            raise pynvml.NVMLError(NOT_SUPPORTED)
        return int(gpu.retired_pages_pending)

    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]:
        gpu = self._gpu(handle, "nvmlDeviceGetRemappedRows")
        if _mig_on(gpu) or gpu.remapped_rows is None:
            raise pynvml.NVMLError(NOT_SUPPORTED)  # "If MIG is enabled" (nvml.h)
        return gpu.remapped_rows

    # -- events -------------------------------------------------------------------

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetSupportedEventTypes").event_types

    def nvmlEventSetCreate(self) -> FakeEventSet:
        event_set = FakeEventSet()
        self.event_sets.append(event_set)
        return event_set

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: Any) -> None:
        if isinstance(handle, FakeMig):  # NVML: events on parent GPUs only
            raise pynvml.NVMLError(NOT_SUPPORTED)
        gpu = self._gpu(handle, "nvmlDeviceRegisterEvents")
        event_set.registered[id(gpu)] = event_types

    def nvmlEventSetWait(self, event_set: Any, timeout_ms: int) -> Any:
        if self.wait_error is not None:
            raise pynvml.NVMLError(self.wait_error)
        try:
            return event_set.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise pynvml.NVMLError(TIMEOUT) from None

    def nvmlEventSetFree(self, event_set: Any) -> None:
        event_set.freed = True

    def deliver_xid(
        self,
        index: int,
        xid: int,
        *,
        gpu_instance_id: int = WHOLE_GPU,
        compute_instance_id: int = WHOLE_GPU,
    ) -> int:
        """Raise Xid ``xid`` on card ``index``; returns how many event sets received it."""
        gpu = self.gpus[index]
        delivered = 0
        for event_set in self.event_sets:
            if event_set.freed or not event_set.registered.get(id(gpu), 0) & EVENT_XID_CRITICAL:
                continue
            event_set.events.put(
                SimpleNamespace(
                    device=gpu,
                    eventType=EVENT_XID_CRITICAL,
                    eventData=xid,
                    gpuInstanceId=gpu_instance_id,
                    computeInstanceId=compute_instance_id,
                )
            )
            delivered += 1
        return delivered


def _mig_on(gpu: FakeGpu) -> bool:
    return gpu.mig_mode is not None and gpu.mig_mode[0] == 1


def _fake_processes(processes: Iterable[ProcessFacts]) -> list[FakeProcess]:
    return [FakeProcess(p.pid, p.used_memory_mib, p.name) for p in processes]


def _fake_mig(instance: InstanceFacts, processes: list[ProcessFacts]) -> FakeMig:
    """The MIG device NVML would show for ``instance``, with the card's processes on it."""
    ids = (instance.gpu_instance_id, instance.compute_instance_id)
    return FakeMig(
        uuid=instance.uuid,
        profile=instance.profile,
        gpu_instance_id=instance.gpu_instance_id,
        compute_instance_id=instance.compute_instance_id,
        memory_total_mib=instance.memory_total_mib,
        memory_used_mib=instance.memory_used_mib,
        processes=_fake_processes(
            p for p in processes if (p.gpu_instance_id, p.compute_instance_id) == ids
        ),
    )

def fake_from_cards(cards: list[CardFacts]) -> FakeNvml:
    """A fake NVML answering what an nvidia-smi capture showed, card for card."""
    gpus = []
    for card in sorted(cards, key=lambda c: c.index):
        mode = None
        if card.mig_current is not None:
            # NVML always answers both modes; a capture without <pending_mig>
            # has no change pending, so the pending mode is the current one.
            mode = (int(card.mig_current), int(bool(pending_mode(card))))
        migs = [_fake_mig(i, card.processes) for i in card.instances]
        health = card.health
        rows = None
        if health.remapped_rows_pending is not None:
            rows = (0, 0, int(health.remapped_rows_pending), int(bool(health.remapping_failed)))
        gpus.append(
            FakeGpu(
                uuid=card.uuid,
                name=card.name,
                memory_total_mib=card.memory_total_mib,
                memory_used_mib=card.memory_used_mib,
                utilization_pct=card.utilization_pct,
                temperature_c=card.temperature_c,
                power_mw=None if card.power_w is None else round(card.power_w * 1000),
                mig_mode=mode,
                migs=migs,
                # The parent answers for the whole card in MIG mode too.
                processes=_fake_processes(card.processes),
                ecc_volatile_uncorrected=health.ecc_volatile_uncorrected,
                ecc_aggregate_uncorrected=health.ecc_aggregate_uncorrected,
                retired_pages_pending=health.retired_pages_pending,
                remapped_rows=rows,
                # A card the capture shows as lost answers who it is, then nothing.
                fail={"nvmlDeviceGetMemoryInfo": GPU_IS_LOST} if health.lost else {},
            )
        )
    return FakeNvml(gpus)
