"""GPU telemetry that moves as NVML's does between two reports of a busy node.

A real agent's inventory is never the same twice: every card's utilisation,
temperature, memory in use and power draw are read afresh for each report
(agent/discovery/nvml.py), while everything placement reads stays put. The
report benchmark and the tests of the report route need such readings: a
fleet whose reports repeat byte for byte measures only a cache.

Per card a bounded random walk, seeded, so a run is repeatable: utilisation
jumps by up to 15 points, temperature by up to 2 degrees, memory in use by
up to 64 MiB (engines hold their memory; allocators still move a little),
power by up to 40 W with NVML's two decimals. MIG instances carry their
card's temperature and power and their own memory, never a utilisation
(discovery's rule); CPU slots carry none of these.

With ``process_churn`` the walk also lists each GPU's processes, as NVML's
compute-process list does, and they come and go: every step, each device
with that probability gains a process (an engine starting, a probe) or
loses one. A report whose process list changed is no longer the node's
last report with other readings, so the control plane reads it whole.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from llmgw.wire import CPU_CLASS, MIG_NUMBER_BASE, GpuProcess, NodeInventory

PROCESS_NAMES = ("python3", "vllm", "sglang::scheduler", "llama-server", "nvidia-smi")


@dataclass
class _Card:
    utilization: int
    temperature: int
    power: float


class TelemetryWalk:
    """One node's readings, one step per report."""

    def __init__(
        self, inventory: NodeInventory, seed: int | str, process_churn: float = 0.0
    ) -> None:
        self._rng = random.Random(seed)
        self._inventory = inventory
        self._cards: dict[int, _Card] = {}
        self._memory: list[int] = []
        self._churn = process_churn
        # Per device (None for CPU slots, or without churn): its processes.
        self._processes: list[list[dict[str, int | str]] | None] = []
        rng = self._rng
        for device in inventory.devices:
            total = device.memory_total_mib
            self._memory.append(int(total * rng.uniform(0.05, 0.95)) if total else 0)
            card = _card_of(device.number, device.mig is not None)
            if card not in self._cards:
                self._cards[card] = _Card(
                    utilization=rng.randint(0, 100),
                    temperature=rng.randint(32, 78),
                    power=round(rng.uniform(60.0, 650.0), 2),
                )
        for device in inventory.devices:
            listed = process_churn > 0 and device.gpu_class != CPU_CLASS
            self._processes.append(
                [self._new_process() for _ in range(rng.randint(0, 2))] if listed else None
            )

    def _new_process(self) -> dict[str, int | str]:
        rng = self._rng
        return {
            "pid": rng.randint(1000, 4_000_000),
            "name": rng.choice(PROCESS_NAMES),
            "used_memory_mib": rng.randint(200, 40_000),
        }

    def step(self) -> list[dict[str, Any]]:
        """Every device's next reading, in inventory order: the four telemetry fields
        (and its processes, with churn), as JSON values."""
        rng = self._rng
        for card in self._cards.values():
            card.utilization = _clamp(card.utilization + _nonzero(rng, 15), 0, 100)
            card.temperature = _clamp(card.temperature + rng.randint(-2, 2), 25, 92)
            card.power = round(min(700.0, max(40.0, card.power + rng.uniform(-40.0, 40.0))), 2)
        out: list[dict[str, int | float | None]] = []
        for index, device in enumerate(self._inventory.devices):
            if device.gpu_class == CPU_CLASS:
                out.append({})
                continue
            total = device.memory_total_mib
            used = _clamp(self._memory[index] + _nonzero(rng, 64), 0, total)
            self._memory[index] = used
            card = self._cards[_card_of(device.number, device.mig is not None)]
            whole = device.mig is None and device.placeable
            reading: dict[str, Any] = {
                "memory_used_mib": used,
                "utilization_pct": card.utilization if whole else None,
                "temperature_c": card.temperature,
                "power_w": card.power,
            }
            processes = self._processes[index]
            if processes is not None:
                if rng.random() < self._churn:
                    if processes and rng.random() < 0.5:
                        processes.pop(rng.randrange(len(processes)))
                    else:
                        processes.append(self._new_process())
                reading["processes"] = [dict(p) for p in processes]
            out.append(reading)
        return out

    def inventory(self) -> NodeInventory:
        """The node's inventory with the next readings (a new object; the devices copied)."""
        readings = self.step()
        devices = [
            device.model_copy(update=_typed(reading)) if reading else device
            for device, reading in zip(self._inventory.devices, readings, strict=True)
        ]
        return self._inventory.model_copy(update={"devices": devices})


def _typed(reading: dict[str, Any]) -> dict[str, Any]:
    if "processes" not in reading:
        return reading
    return {**reading, "processes": [GpuProcess(**p) for p in reading["processes"]]}


def _card_of(number: int, mig: bool) -> int:
    return (number - MIG_NUMBER_BASE) // 100 if mig else number


def _nonzero(rng: random.Random, spread: int) -> int:
    step = rng.randint(1, spread)
    return step if rng.random() < 0.5 else -step


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))
