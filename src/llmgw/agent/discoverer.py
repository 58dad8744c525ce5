"""The agent's inventory provider: discovery with a memory, and the Xid watch.

Discovery (``llmgw.agent.discovery``) owns the rules for reading GPUs; the
agent calls it through :class:`Discoverer` and nothing else, so the agent
never depends on how discovery is laid out inside.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from llmgw.agent.discovery import (
    LastSeen,
    NvmlEventsApi,
    XidMarks,
    XidWatcher,
    discover,
    ignored_xids_from_env,
)
from llmgw.wire import NodeInventory


class Discoverer:
    """Calls discovery with a memory of what cards reported before.

    In MIG mode a card stops reporting utilisation and remapped rows; the
    discovery package carries the last values seen (``LastSeen``) when it is
    given the same object on every call, which this class holds. It also holds
    the Xid marks its watcher records, so every inventory carries them.
    """

    def __init__(
        self,
        cpu_slots: int = 1,
        class_overrides: Mapping[str, str] | None = None,
        *,
        ignored_xids: Iterable[int] | None = None,
        nvml: NvmlEventsApi | None = None,
    ):
        self.cpu_slots = cpu_slots
        self.nvml = nvml  # None: the pynvml module; a FakeNvml in tests and simulations
        self.class_overrides = dict(class_overrides or {}) or None
        self._cache = LastSeen()
        self.xids = XidMarks()
        # Read here so a malformed LLMGW_IGNORED_XIDS stops the agent before it starts.
        ignored = ignored_xids_from_env() if ignored_xids is None else ignored_xids
        self._watcher = XidWatcher(self.xids, nvml, ignored=ignored)

    def __call__(self) -> NodeInventory:
        return discover(
            cpu_slots=self.cpu_slots,
            class_overrides=self.class_overrides,
            cache=self._cache,
            xids=self.xids,
            nvml=self.nvml,
        )

    def start_watching(self) -> bool:
        """Watch for Xid errors (blocks briefly to register); False where there is no NVML."""
        return self._watcher.start()

    @property
    def watching(self) -> bool:
        return self._watcher.running

    def stop_watching(self) -> None:
        """Stop the watch; the marks stay (an in-process restart keeps them)."""
        self._watcher.stop()

