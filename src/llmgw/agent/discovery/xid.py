"""Xid errors: NVML's word that a GPU (or one MIG instance) broke while running.

A card that falls off the bus or hits an uncontained ECC error often still
answers discovery's polls for a while, so the periodic read alone would keep
placing engines on it. NVML delivers these as XidCriticalError events, so the
agent watches for them in a background thread and marks the device:

* events are registered on each *parent* GPU (NVML does not report events on
  MIG handles); an event carries the GPU/compute instance ids it concerns,
  0xFFFFFFFF meaning the whole GPU, which marks the card and all its instances;
* Xids that mean "an application misbehaved" (page fault, graphics exception,
  preemptive cleanup, ...) leave the GPU healthy: fencing a card because one
  engine crashed would take good hardware out of service;
* a mark stays until the agent restarts, as NVIDIA's device plugin does: the
  driver never says "fixed", and a card flapping between healthy and unhealthy
  would be handed work between its failures.

:class:`XidMarks` holds the marks (written by the watcher thread, read by
discovery); :class:`XidWatcher` is the thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import pynvml

from llmgw.agent.discovery.base import CardFacts
from llmgw.agent.discovery.nvml import INVALID_ARGUMENT, NOT_FOUND, NOT_SUPPORTED, NvmlApi
from llmgw.errors import ConfigError

log = logging.getLogger("llmgw.agent.xid")

EVENT_XID_CRITICAL = 0x8  # nvmlEventTypeXidCriticalError
TIMEOUT = 10  # NVML_ERROR_TIMEOUT: nvmlEventSetWait found nothing
WHOLE_GPU = 0xFFFFFFFF  # GPU/compute instance id of an event about the whole card
ENV_IGNORED = "LLMGW_IGNORED_XIDS"

# Application errors: the process that caused them dies, the GPU stays good
# (NVIDIA's k8s device plugin and DRA driver ignore the same list).
DEFAULT_IGNORED_XIDS = frozenset({13, 31, 43, 45, 68, 109})

XID_MEANINGS: Mapping[int, str] = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    32: "invalid or corrupted push buffer stream",
    38: "driver firmware error",
    43: "GPU stopped processing",
    45: "preemptive cleanup, due to previous errors",
    48: "double-bit ECC error",
    54: "auxiliary power is not connected to the GPU board",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failed",
    68: "video processor exception",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
    121: "C2C link error",
    140: "unrecovered ECC error",
}

STICKY_HINT = "restart the agent after the GPU is fixed"


def describe(xid: int) -> str:
    """``Xid 79 (GPU has fallen off the bus)``; an Xid without a known meaning is just ``Xid N``."""
    meaning = XID_MEANINGS.get(xid)
    return f"Xid {xid} ({meaning})" if meaning else f"Xid {xid}"


def parse_ignored_xids(text: str, *, source: str = ENV_IGNORED) -> frozenset[int]:
    """A comma-separated Xid list; it replaces the default. Empty ignores none."""
    found: set[int] = set()
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if not item.isdigit() or int(item) == 0:
            raise ConfigError(
                f"{source}: {item!r} is not an Xid number; expected a comma-separated list "
                f"of positive integers such as {','.join(map(str, sorted(DEFAULT_IGNORED_XIDS)))}"
            )
        found.add(int(item))
    return frozenset(found)


def ignored_xids_from_env(environ: Mapping[str, str] | None = None) -> frozenset[int]:
    """``LLMGW_IGNORED_XIDS`` when set, else :data:`DEFAULT_IGNORED_XIDS`."""
    env = os.environ if environ is None else environ
    text = env.get(ENV_IGNORED)
    return DEFAULT_IGNORED_XIDS if text is None else parse_ignored_xids(text)


@dataclass(frozen=True)
class _InstanceMark:
    parent_uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    # Resolved when the event arrived: GI ids are reused after a re-carve, so
    # the UUID is what keeps a mark on the instance that actually failed.
    mig_uuid: str | None
    reason: str


class XidMarks:
    """The Xid reasons per device, kept until the process ends.

    One reason per (device, Xid): a card that falls off the bus repeats Xid 79
    many times, and the first time is the one an operator needs.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Keyed by Xid, or by the failure's wording for marks that are no Xid.
        self._cards: dict[str, dict[int | str, str]] = {}
        self._instances: dict[tuple[str, int, int, str | None, int], _InstanceMark] = {}

    def mark_card(self, uuid: str, key: int | str, reason: str) -> None:
        with self._lock:
            self._cards.setdefault(uuid, {}).setdefault(key, reason)

    def mark_instance(
        self,
        parent_uuid: str,
        gpu_instance_id: int,
        compute_instance_id: int,
        mig_uuid: str | None,
        xid: int,
        reason: str,
    ) -> None:
        key = (parent_uuid, gpu_instance_id, compute_instance_id, mig_uuid, xid)
        mark = _InstanceMark(parent_uuid, gpu_instance_id, compute_instance_id, mig_uuid, reason)
        with self._lock:
            self._instances.setdefault(key, mark)

    def card_reasons(self, uuid: str) -> list[str]:
        with self._lock:
            return list(self._cards.get(uuid, {}).values())

    def apply(self, card: CardFacts) -> None:
        """Put the marks for this card and its instances into its facts."""
        with self._lock:
            whole = list(self._cards.get(card.uuid, {}).values())
            partial = [m for m in self._instances.values() if m.parent_uuid == card.uuid]
        card.health.xid_errors = whole
        for inst in card.instances:
            inst.unhealthy_reasons = []
        for mark in partial:
            if not card.mig_current or not card.instances:
                # An instance event on a card reported whole (MIG turned off
                # since): the card is the device that ran the failing work.
                card.health.xid_errors.append(mark.reason)
                continue
            for inst in card.instances:
                if mark.mig_uuid is not None:
                    hit = inst.uuid == mark.mig_uuid
                else:
                    hit = (inst.gpu_instance_id, inst.compute_instance_id) == (
                        mark.gpu_instance_id,
                        mark.compute_instance_id,
                    )
                if hit:
                    inst.unhealthy_reasons.append(mark.reason)


class NvmlEventsApi(NvmlApi, Protocol):
    """The event calls of pynvml, beside discovery's; the module satisfies it."""

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int: ...
    def nvmlEventSetCreate(self) -> Any: ...
    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: Any) -> None: ...
    def nvmlEventSetWait(self, event_set: Any, timeout_ms: int) -> Any: ...
    def nvmlEventSetFree(self, event_set: Any) -> None: ...


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _utc(now: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(now))


class XidWatcher:
    """Waits for Xid events on every GPU in a thread and records them in ``marks``.

    ``wait_ms`` bounds each wait, so :meth:`stop` returns within about that
    long: NVML has no way to interrupt a wait from another thread.
    """

    def __init__(
        self,
        marks: XidMarks,
        api: NvmlEventsApi | None = None,
        *,
        ignored: Iterable[int] = DEFAULT_IGNORED_XIDS,
        wait_ms: int = 1000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if wait_ms <= 0:
            raise ConfigError(f"Xid wait_ms must be positive, not {wait_ms}")
        self.marks = marks
        self.api: NvmlEventsApi = api if api is not None else pynvml
        self.ignored = frozenset(ignored)
        self.wait_ms = wait_ms
        self.clock = clock
        self.watched: list[str] = []  # parent GPU UUIDs with events registered
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> bool:
        """Register on every GPU and start the thread; False when there is nothing to watch."""
        if self.running:
            return True
        api = self.api
        try:
            api.nvmlInit()
        except pynvml.NVMLError as exc:
            log.debug("no Xid watch: NVML unavailable (%s)", exc)
            return False
        try:
            event_set = api.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            log.warning("no Xid watch: NVML cannot create an event set (%s)", exc)
            self._shutdown(None)
            return False
        self.watched = self._register_all(event_set)
        if not self.watched:
            self._shutdown(event_set)
            return False
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._loop, args=(event_set,), name="llmgw-xid-watch", daemon=True
        )
        self._thread.start()
        return True

    def stop(self, timeout_s: float = 10.0) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout_s)
        if thread.is_alive():
            log.warning("Xid watch did not stop within %.0f s", timeout_s)

    # -- registration -----------------------------------------------------------

    def _register_all(self, event_set: Any) -> list[str]:
        api = self.api
        try:
            count = int(api.nvmlDeviceGetCount())
        except pynvml.NVMLError as exc:
            log.warning("no Xid watch: NVML device count failed (%s)", exc)
            return []
        watched = []
        for index in range(count):
            try:
                handle = api.nvmlDeviceGetHandleByIndex(index)
                uuid = str(api.nvmlDeviceGetUUID(handle))
            except pynvml.NVMLError as exc:  # discovery reports the card as lost
                log.warning("GPU %d: no Xid watch, NVML cannot name it (%s)", index, exc)
                continue
            if self._register(index, uuid, handle, event_set):
                watched.append(uuid)
        return watched

    def _register(self, index: int, uuid: str, handle: Any, event_set: Any) -> bool:
        api = self.api
        try:
            supported = int(api.nvmlDeviceGetSupportedEventTypes(handle))
            if not supported & EVENT_XID_CRITICAL:
                raise pynvml.NVMLError(NOT_SUPPORTED)
            api.nvmlDeviceRegisterEvents(handle, EVENT_XID_CRITICAL, event_set)
        except pynvml.NVMLError as exc:
            if _code(exc) == NOT_SUPPORTED:
                log.info("GPU %d (%s): too old for Xid events; not watched", index, uuid)
                return False
            # A card that cannot be watched could fail unseen: it gets no work.
            reason = f"cannot watch for Xid errors ({exc}); {STICKY_HINT}"
            log.error("GPU %d (%s): %s", index, uuid, reason)
            self.marks.mark_card(uuid, "registration", reason)
            return False
        return True

    # -- the thread ---------------------------------------------------------------

    def _loop(self, event_set: Any) -> None:
        try:
            while not self._stop.is_set():
                try:
                    event = self.api.nvmlEventSetWait(event_set, self.wait_ms)
                except pynvml.NVMLError as exc:
                    if _code(exc) == TIMEOUT:
                        continue
                    # The driver stopped answering for every card at once:
                    # none of them can be vouched for any more.
                    self._mark_all(f"NVML stopped delivering Xid events ({exc})")
                    return
                self._record(event)
        except Exception:  # a bug here must not pass silently as "no Xids"
            log.exception("Xid watch failed")
            self._mark_all("the Xid watch failed")
        finally:
            self._shutdown(event_set)

    def _record(self, event: Any) -> None:
        if not int(event.eventType) & EVENT_XID_CRITICAL:
            return
        xid = int(event.eventData)
        if xid in self.ignored:
            log.info("%s ignored: an application error, the GPU stays usable", describe(xid))
            return
        reason = f"{describe(xid)} at {_utc(self.clock())}; {STICKY_HINT}"
        try:
            uuid = str(self.api.nvmlDeviceGetUUID(event.device))
        except pynvml.NVMLError as exc:
            self._mark_all(f"{describe(xid)} on a GPU NVML cannot name ({exc})", xid)
            return
        gi, ci = int(event.gpuInstanceId), int(event.computeInstanceId)
        if gi == WHOLE_GPU or ci == WHOLE_GPU:
            log.error("GPU %s: %s", uuid, reason)
            self.marks.mark_card(uuid, xid, reason)
            return
        mig_uuid = self._mig_uuid(event.device, gi, ci)
        log.error("GPU %s instance %d/%d (%s): %s", uuid, gi, ci, mig_uuid or "?", reason)
        self.marks.mark_instance(uuid, gi, ci, mig_uuid, xid, reason)

    def _mig_uuid(self, parent: Any, gi: int, ci: int) -> str | None:
        """The UUID of the instance with these ids now; None when NVML cannot say."""
        api = self.api
        try:
            slots = int(api.nvmlDeviceGetMaxMigDeviceCount(parent))
            for slot in range(slots):
                try:
                    mig = api.nvmlDeviceGetMigDeviceHandleByIndex(parent, slot)
                except pynvml.NVMLError as exc:
                    if _code(exc) in (NOT_FOUND, INVALID_ARGUMENT):
                        continue  # an empty slot
                    raise
                ids = (api.nvmlDeviceGetGpuInstanceId(mig), api.nvmlDeviceGetComputeInstanceId(mig))
                if (int(ids[0]), int(ids[1])) == (gi, ci):
                    return str(api.nvmlDeviceGetUUID(mig))
        except pynvml.NVMLError as exc:
            log.warning("cannot name MIG instance %d/%d (%s)", gi, ci, exc)
        return None

    def _mark_all(self, what: str, xid: int | None = None) -> None:
        reason = f"{what} at {_utc(self.clock())}; {STICKY_HINT}"
        log.error("all watched GPUs: %s", reason)
        for uuid in self.watched:
            self.marks.mark_card(uuid, what if xid is None else xid, reason)

    def _shutdown(self, event_set: Any) -> None:
        # Errors here change nothing: the process is letting go of NVML anyway.
        with contextlib.suppress(pynvml.NVMLError):
            if event_set is not None:
                self.api.nvmlEventSetFree(event_set)
        with contextlib.suppress(pynvml.NVMLError):
            self.api.nvmlShutdown()
