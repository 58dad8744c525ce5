"""The agent's single door to discovery: inventory and device-pinning environment.

Discovery (``llmgw.agent.discovery``) owns the rules for reading GPUs and for
pinning an engine to them; the agent calls it through these two names and
nothing else, so the supervisor and the engine adapters never depend on how
discovery is laid out inside.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from llmgw.agent.discovery import LastSeen, discover
from llmgw.agent.discovery import pinning as _pinning
from llmgw.wire import Device, NodeInventory


class Discoverer:
    """Calls discovery with a memory of what cards reported before.

    In MIG mode a card stops reporting utilisation and remapped rows; the
    discovery package carries the last values seen (``LastSeen``) when it is
    given the same object on every call, which this class holds.
    """

    def __init__(self, cpu_slots: int = 1, class_overrides: Mapping[str, str] | None = None):
        self.cpu_slots = cpu_slots
        self.class_overrides = dict(class_overrides or {}) or None
        self._cache = LastSeen()

    def __call__(self) -> NodeInventory:
        return discover(
            cpu_slots=self.cpu_slots, class_overrides=self.class_overrides, cache=self._cache
        )


def engine_env(devices: Sequence[Device], vulkan: bool = False) -> dict[str, str]:
    """The environment that pins an engine to ``devices``."""
    return dict(_pinning.engine_env(list(devices), vulkan=vulkan))
