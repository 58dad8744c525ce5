"""The NVML source (nvidia-ml-py, module ``pynvml``), behind a small Protocol.

Only the calls below are used, so a fake (:mod:`.fake`) can stand in for the
driver in tests. Errors are NVML's own exception classes, and each is sorted
once, here, into one of three meanings:

* the source is absent (no library, no driver): the caller tries nvidia-smi;
* the card is lost or failing (GPU_IS_LOST, UNKNOWN, ...): the card is
  reported unhealthy with the reason, not dropped -- a card that vanished is
  exactly what an operator needs to see;
* a metric is not available (NOT_SUPPORTED, NO_PERMISSION, ...): that value
  is None. Utilisation on MIG instances always lands here.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Protocol

import pynvml

from llmgw.agent.discovery.base import (
    CardFacts,
    HealthFacts,
    InstanceFacts,
    ProcessFacts,
    SourceName,
    SourceReading,
    SourceUnavailable,
)
from llmgw.agent.discovery.health import LastSeen
from llmgw.agent.discovery.smi_list import PROFILE_PATTERN
from llmgw.errors import DiscoveryError

_MIB = 1024 * 1024
_MIG_ENABLE = 1
_TEMPERATURE_GPU = 0
_UNCORRECTED, _VOLATILE, _AGGREGATE = 1, 0, 1
# NVML return codes (nvml.h).
INVALID_ARGUMENT, NOT_SUPPORTED, NOT_FOUND = 2, 3, 6
DRIVER_NOT_LOADED, LIBRARY_NOT_FOUND, FUNCTION_NOT_FOUND = 9, 12, 13
GPU_IS_LOST, RESET_REQUIRED, LIB_RM_VERSION_MISMATCH, UNKNOWN = 15, 16, 18, 999
_CARD_FAILING = frozenset({GPU_IS_LOST, RESET_REQUIRED, UNKNOWN})
_ABSENT_HINTS = {
    LIBRARY_NOT_FOUND: "NVML library not found",
    DRIVER_NOT_LOADED: "NVIDIA driver not loaded",
    LIB_RM_VERSION_MISMATCH: "NVML and driver versions differ (reboot after a driver upgrade)",
}


class NvmlApi(Protocol):
    """The part of pynvml that discovery uses; the module itself satisfies it."""

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlSystemGetDriverVersion(self) -> str: ...
    def nvmlSystemGetCudaDriverVersion(self) -> int: ...
    def nvmlSystemGetProcessName(self, pid: int) -> str | bytes: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str: ...
    def nvmlDeviceGetName(self, handle: Any) -> str: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...  # .total .used, bytes
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...  # .gpu, percent
    def nvmlDeviceGetTemperatureV(self, handle: Any, sensor: int) -> int: ...
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int: ...
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int: ...  # milliwatts
    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]: ...  # [current, pending]
    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int: ...
    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: int) -> Any: ...
    def nvmlDeviceGetGpuInstanceId(self, handle: Any) -> int: ...
    def nvmlDeviceGetComputeInstanceId(self, handle: Any) -> int: ...
    def nvmlDeviceGetAttributes(self, handle: Any) -> Any: ...
    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]: ...
    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error: int, counter: int) -> int: ...
    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any) -> int: ...
    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]: ...


class _CardFailing(Exception):  # a state of the card
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(exc, pynvml.NVMLError) and isinstance(value, int) else None


def profile_from_attributes(attrs: Any, card_total_mib: int) -> str | None:
    """go-nvlib's profile name from slice counts and memory, when the name has none.

    ``Mgb`` is the instance's eighths of the card times the card's GB, rounded
    half up (Python's round() would name H200's 3g.71gb "3g.70gb").
    """
    try:
        gi, ci = int(attrs.gpuInstanceSliceCount), int(attrs.computeInstanceSliceCount)
        mem_mib = int(attrs.memorySizeMB)
    except (AttributeError, TypeError, ValueError):
        return None
    if card_total_mib <= 0 or gi <= 0 or ci <= 0 or mem_mib <= 0:
        return None
    fraction = math.ceil(mem_mib / card_total_mib * 8) / 8
    gb = math.floor(fraction * math.ceil(card_total_mib / 1024) + 0.5)
    return f"{gi}g.{gb}gb" if gi == ci else f"{ci}c.{gi}g.{gb}gb"


class NvmlSource:
    name: SourceName = "nvml"

    def __init__(self, api: NvmlApi | None = None, *, cache: LastSeen | None = None) -> None:
        self.api: NvmlApi = api if api is not None else pynvml
        # Where a card that vanishes finds the UUID it had a moment ago.
        self.cache = cache if cache is not None else LastSeen()

    # -- calls, sorted into the three meanings ------------------------------

    def _must(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except pynvml.NVMLError as exc:
            code = _code(exc)
            if code in _CARD_FAILING:
                raise _CardFailing(code or UNKNOWN, f"{what}: {exc}") from None
            raise DiscoveryError(f"NVML {what} failed: {exc}") from None

    def _may(self, card: CardFacts | None, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except pynvml.NVMLLibraryMismatchError:
            return None  # driver older than the binding's struct: no data
        except pynvml.NVMLError as exc:
            self._note(card, exc)
            return None

    @staticmethod
    def _note(card: CardFacts | None, exc: BaseException) -> None:
        """What a failed optional call says about the card (usually: nothing)."""
        code = _code(exc)
        if card is None or code not in _CARD_FAILING:
            return
        if code == GPU_IS_LOST:
            raise _CardFailing(code, str(exc))
        card.health.unknown_error |= code == UNKNOWN
        card.health.reset_required = card.health.reset_required or code == RESET_REQUIRED

    # -- reading ---------------------------------------------------------------

    def read(self) -> SourceReading:
        api = self.api
        try:
            api.nvmlInit()
        except pynvml.NVMLError as exc:
            code = _code(exc)
            hint = _ABSENT_HINTS.get(code or 0, f"NVML cannot start: {exc}")
            raise SourceUnavailable(hint, warning=code != LIBRARY_NOT_FOUND) from None
        try:
            return self._read_all()
        except _CardFailing as failing:  # lost while answering about the whole system
            raise DiscoveryError(f"NVML: {failing}") from None
        finally:
            # Nothing to release on failure that the process exit will not.
            with contextlib.suppress(pynvml.NVMLError):
                api.nvmlShutdown()

    def _read_all(self) -> SourceReading:
        api = self.api
        driver = self._may(None, api.nvmlSystemGetDriverVersion)
        cuda = self._may(None, api.nvmlSystemGetCudaDriverVersion)
        count = self._must("device count", api.nvmlDeviceGetCount)
        snapshot = SourceReading(
            source="nvml",
            driver_version=str(driver) if driver else None,
            cuda_version=f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else None,
        )
        for index in range(int(count)):
            snapshot.cards.append(self._read_card(index, snapshot.warnings))
        return snapshot

    def _lost_card(self, index: int, code: int, message: str, warnings: list[str]) -> CardFacts:
        known = self.cache.identity(index)
        uuid, name, total = known or (f"GPU-unknown-index-{index}", "unknown", 0)
        warnings.append(f"GPU {index}: {message}")
        health = HealthFacts(lost=code == GPU_IS_LOST, unknown_error=code == UNKNOWN)
        health.reset_required = code == RESET_REQUIRED or None
        if code == NOT_FOUND:
            health.lost = True
        return CardFacts(index=index, uuid=uuid, name=name, memory_total_mib=total, health=health)

    def _read_card(self, index: int, warnings: list[str]) -> CardFacts:
        api = self.api
        try:
            handle = api.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError as exc:
            code = _code(exc) or UNKNOWN
            if code in _CARD_FAILING or code in (NOT_FOUND, INVALID_ARGUMENT):
                # Counted a moment ago and gone now: fell off the bus.
                return self._lost_card(
                    index,
                    code if code != INVALID_ARGUMENT else NOT_FOUND,
                    f"vanished during discovery ({exc})",
                    warnings,
                )
            raise DiscoveryError(f"NVML handle of GPU {index} failed: {exc}") from None
        try:
            card = self._card_facts(index, handle)
        except _CardFailing as failing:
            return self._lost_card(index, failing.code, str(failing), warnings)
        self.cache.remember_identity(index, card.uuid, card.name, card.memory_total_mib)
        return card

    def _card_facts(self, index: int, handle: Any) -> CardFacts:
        api = self.api
        uuid = str(self._must("UUID", api.nvmlDeviceGetUUID, handle))
        self.cache.remember_identity(index, uuid, "unknown")
        name = str(self._must("name", api.nvmlDeviceGetName, handle))
        self.cache.remember_identity(index, uuid, name)
        card = CardFacts(index=index, uuid=uuid, name=name)
        memory = self._may(card, api.nvmlDeviceGetMemoryInfo, handle)
        if memory is not None:
            card.memory_total_mib = int(memory.total) // _MIB
            card.memory_used_mib = int(memory.used) // _MIB
        util = self._may(card, api.nvmlDeviceGetUtilizationRates, handle)
        card.utilization_pct = int(util.gpu) if util is not None else None
        card.temperature_c = self._temperature(card, handle)
        power = self._may(card, api.nvmlDeviceGetPowerUsage, handle)
        card.power_w = round(power / 1000, 2) if power is not None else None
        self._wear(card, handle)
        mode = self._may(card, api.nvmlDeviceGetMigMode, handle)
        if mode is not None:
            card.mig_current = int(mode[0]) == _MIG_ENABLE
            card.mig_pending = int(mode[1]) == _MIG_ENABLE
        if card.mig_current:
            card.utilization_pct = None
            card.instances = self._instances(card, handle)
        if not card.instances:
            # A card shown whole, in MIG mode or not, lists the processes on
            # it, as nvidia-smi does: the parent handle answers for the whole
            # card whatever its mode.
            card.processes = self._processes(card, handle)
        return card

    def _temperature(self, card: CardFacts, handle: Any) -> int | None:
        try:
            return int(self.api.nvmlDeviceGetTemperatureV(handle, _TEMPERATURE_GPU))
        except pynvml.NVMLError as exc:
            if _code(exc) not in (FUNCTION_NOT_FOUND, NOT_SUPPORTED):
                self._note(card, exc)
                return None
        # Drivers older than the V call: the deprecated one still answers.
        value = self._may(card, self.api.nvmlDeviceGetTemperature, handle, _TEMPERATURE_GPU)
        return int(value) if value is not None else None

    def _wear(self, card: CardFacts, handle: Any) -> None:
        api, health = self.api, card.health
        ecc = api.nvmlDeviceGetTotalEccErrors
        volatile = self._may(card, ecc, handle, _UNCORRECTED, _VOLATILE)
        aggregate = self._may(card, ecc, handle, _UNCORRECTED, _AGGREGATE)
        health.ecc_volatile_uncorrected = int(volatile) if volatile is not None else None
        health.ecc_aggregate_uncorrected = int(aggregate) if aggregate is not None else None
        pending = self._may(card, api.nvmlDeviceGetRetiredPagesPendingStatus, handle)
        health.retired_pages_pending = bool(pending) if pending is not None else None
        rows = self._may(card, api.nvmlDeviceGetRemappedRows, handle)
        if rows is not None:  # NOT_SUPPORTED in MIG mode: LastSeen fills it in
            health.remapped_rows_pending = bool(rows[2])
            health.remapping_failed = bool(rows[3])

    def _processes(self, card: CardFacts, handle: Any) -> list[ProcessFacts]:
        found = self._may(card, self.api.nvmlDeviceGetComputeRunningProcesses, handle) or []
        processes = []
        for proc in found:
            used = getattr(proc, "usedGpuMemory", None)
            name = self._may(None, self.api.nvmlSystemGetProcessName, int(proc.pid))
            if isinstance(name, bytes):
                name = name.decode("utf-8", errors="replace")
            processes.append(
                ProcessFacts(
                    pid=int(proc.pid),
                    name=str(name or ""),
                    used_memory_mib=int(used) // _MIB if isinstance(used, int) else 0,
                )
            )
        return processes

    def _instances(self, card: CardFacts, handle: Any) -> list[InstanceFacts]:
        api = self.api
        slots = self._may(card, api.nvmlDeviceGetMaxMigDeviceCount, handle) or 0
        instances = []
        for slot in range(int(slots)):
            try:
                mig = api.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except pynvml.NVMLError as exc:
                if _code(exc) in (NOT_FOUND, INVALID_ARGUMENT):
                    continue  # slots are sparse: an empty one is not an error
                self._note(card, exc)
                continue
            instances.append(self._instance(card, mig))
        return instances

    def _instance(self, card: CardFacts, mig: Any) -> InstanceFacts:
        api = self.api
        uuid = str(self._must("MIG UUID", api.nvmlDeviceGetUUID, mig))
        name = str(self._may(card, api.nvmlDeviceGetName, mig) or "")
        profile = name.rsplit(" MIG ", 1)[1].strip() if " MIG " in name else ""
        if not PROFILE_PATTERN.match(profile):
            attrs = self._may(card, api.nvmlDeviceGetAttributes, mig)
            profile = profile_from_attributes(attrs, card.memory_total_mib) or ""
        if not profile:
            raise DiscoveryError(f"NVML gives no MIG profile for {uuid} on GPU {card.index}")
        gi = self._must("GPU instance id", api.nvmlDeviceGetGpuInstanceId, mig)
        ci = self._must("compute instance id", api.nvmlDeviceGetComputeInstanceId, mig)
        inst = InstanceFacts(
            uuid=uuid, profile=profile, gpu_instance_id=int(gi), compute_instance_id=int(ci)
        )
        memory = self._may(card, api.nvmlDeviceGetMemoryInfo, mig)
        if memory is not None:
            inst.memory_total_mib = int(memory.total) // _MIB
            inst.memory_used_mib = int(memory.used) // _MIB
        inst.processes = self._processes(card, mig)
        for proc in inst.processes:
            proc.gpu_instance_id = inst.gpu_instance_id
            proc.compute_instance_id = inst.compute_instance_id
        return inst
