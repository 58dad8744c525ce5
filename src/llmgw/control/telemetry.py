"""A report's device readings, taken without validating the whole report again.

A real agent's report is never the same twice: every card's utilisation,
temperature, memory in use and power draw are read afresh for it (NVML),
while everything else, placement's facts, weights, replicas, stays put for
hours. Validating each report whole (``AgentReport``, every device) and
taking in a new inventory object for four numbers per device was most of a
10,000-node control plane's CPU, and the new objects made the scheduler
and the views digest every node again as if its devices had changed.

So the report route keeps, per node, the *shape* of its last validated
report: the digest of its JSON with the four telemetry fields taken out of
every device. A body of the same shape is that report with other readings;
only the readings need checking (their types, :func:`_reading`), and they
are kept beside the node's inventory (:class:`Readings`) rather than in it.
Any other body is validated whole, as before.

Sound because the shape is taken from the parsed document, not from the
bytes: two bodies of equal shape are the same JSON values in the same order
except the telemetry fields, and those are the only values the readings path
reads. A shape is kept only where the readings this module finds in the
validated body are exactly the ones pydantic found (:func:`shape_of`), and
tests/control/test_telemetry.py holds the readings it accepts to pydantic's
for random bodies.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, cast

import orjson

from llmgw.wire import NodeInventory

# Per device, in this order: the fields NVML reads afresh for every report.
TELEMETRY_FIELDS = ("memory_used_mib", "utilization_pct", "temperature_c", "power_w")
PER_DEVICE = len(TELEMETRY_FIELDS)

Reading = int | float | None
# One device's: memory in use, utilisation, temperature, power.
DeviceReading = tuple[int, int | None, int | None, float | None]


@dataclass(frozen=True, slots=True)
class Readings:
    """The telemetry of every device of ``inventory``, flat, four values a device in
    :data:`TELEMETRY_FIELDS` order; newer than what the inventory's devices say.

    Valid only with that inventory object: a node whose inventory was replaced
    since (a report that changed its devices, a registration) has none.
    """

    inventory: NodeInventory
    values: tuple[Reading, ...]

    def of(self, index: int) -> DeviceReading:
        start = index * PER_DEVICE
        return cast(DeviceReading, self.values[start : start + PER_DEVICE])


def readings_of(inventory: NodeInventory) -> tuple[Reading, ...]:
    """What the inventory's own devices say, flat as :attr:`Readings.values`."""
    out: list[Reading] = []
    for device in inventory.devices:
        out += (
            device.memory_used_mib,
            device.utilization_pct,
            device.temperature_c,
            device.power_w,
        )
    return tuple(out)


def current(inventory: NodeInventory | None, readings: Readings | None) -> Readings | None:
    """``readings`` if they belong to ``inventory`` (the node's now), else None."""
    if readings is not None and readings.inventory is inventory:
        return readings
    return None


def shape_of(body: bytes, report_inventory: NodeInventory) -> bytes | None:
    """The shape of a body that validated to a report with ``report_inventory``.

    None where the readings path could not vouch for the body's like: it
    parses differently here (a duplicate key, a number orjson refuses), or
    a reading is written in a way only full validation takes (``5.0`` for
    an integer): such a node's reports are validated whole.
    """
    split = _split(body)
    if split is None or split[1] != readings_of(report_inventory):
        return None
    return split[0]


def read(body: bytes, shape: bytes) -> tuple[Reading, ...] | None:
    """The readings of a body of shape ``shape``; None if it has another shape
    (or cannot be read here): then it must be validated whole."""
    split = _split(body)
    if split is None or split[0] != shape:
        return None
    return split[1]


def _split(body: bytes) -> tuple[bytes, tuple[Reading, ...]] | None:
    """The body's shape and its devices' readings; None if it has no devices list
    of objects or a reading of a type the fields' validation might treat otherwise."""
    try:
        document = orjson.loads(body)
        devices = document["inventory"]["devices"]
        if type(devices) is not list:
            return None
        values: list[Reading] = []
        for device in devices:
            # A field left out is its default, as validation reads it.
            memory = device.pop("memory_used_mib", 0)
            utilization = device.pop("utilization_pct", None)
            temperature = device.pop("temperature_c", None)
            power = device.pop("power_w", None)
            if (
                type(memory) is not int
                or not _optional_int(utilization)
                or not _optional_int(temperature)
            ):
                return None
            if power is not None:
                if type(power) is int:
                    power = float(power)
                elif type(power) is not float:
                    return None
            values += (memory, utilization, temperature, power)
        shape = hashlib.sha256(orjson.dumps(document)).digest()
    except (orjson.JSONDecodeError, TypeError, KeyError, AttributeError, ValueError):
        return None
    return shape, tuple(values)


def _optional_int(value: Any) -> bool:
    # bool is an int subclass, and validation refuses it here: type(), not isinstance.
    return value is None or type(value) is int
