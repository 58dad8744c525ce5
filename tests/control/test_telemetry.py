"""control.telemetry: a body of a kept report's shape reads as that report with its readings.

The readings path skips validating the report whole, so it must never take
a body that full validation would read otherwise: for random bodies (random
readings, each written in any way JSON allows, and random changes to the
rest), what it accepts is exactly what ``AgentReport`` validation makes of
the body, and a body it cannot vouch for is refused (then validated whole).
"""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.control import telemetry
from llmgw.control.rows import node_from_row, node_row
from llmgw.sim import fleetgen
from llmgw.wire import AgentReport, NodeInventory, ReplicaState, ReplicaStatus

_NODE = fleetgen.gpu_node("n1", gpus=3, mig={2: ("3g.40gb", 2)})
assert _NODE.inventory is not None
_BASE = AgentReport(
    node="n1",
    inventory=_NODE.inventory,
    replicas=[ReplicaStatus(replica_id="r1", state=ReplicaState.READY, port=20001)],
)
_DOCUMENT = _BASE.model_dump(mode="json")
_DEVICES = len(_DOCUMENT["inventory"]["devices"])


def _body(document: dict[str, Any]) -> bytes:
    return json.dumps(document).encode()


def _validated_inventory(body: bytes) -> NodeInventory | None:
    try:
        return AgentReport.model_validate_json(body).inventory
    except pydantic.ValidationError:
        return None


# A reading as an agent (or anything else) might write it: the types the
# fields take, the ones validation coerces (5.0, "5", true), and nonsense.
_VALUE = st.one_of(
    st.none(),
    st.integers(-(2**63), 2**63 - 1),
    st.integers(0, 120),
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(0, 700).map(lambda x: round(x, 2)),
    st.integers(0, 100).map(float),
    st.booleans(),
    st.integers(0, 100).map(str),
    st.just("hot"),
    st.just([]),
)
_ABSENT = object()
_READING = st.one_of(st.just(_ABSENT), _VALUE)


def _with_readings(readings: list[dict[str, Any]]) -> dict[str, Any]:
    document = json.loads(json.dumps(_DOCUMENT))
    for device, reading in zip(document["inventory"]["devices"], readings, strict=True):
        for field, value in reading.items():
            if value is _ABSENT:
                device.pop(field, None)
            else:
                device[field] = value
    return document


_READINGS = st.lists(
    st.fixed_dictionaries({field: _READING for field in telemetry.TELEMETRY_FIELDS}),
    min_size=_DEVICES,
    max_size=_DEVICES,
)


def _shape() -> bytes:
    body = _BASE.model_dump_json().encode()
    shape = telemetry.shape_of(body, _BASE.inventory)
    assert shape is not None
    return shape


@settings(max_examples=400, deadline=None)
@given(_READINGS)
def test_accepted_readings_are_what_validation_reads(readings: list[dict[str, Any]]) -> None:
    body = _body(_with_readings(readings))
    read = telemetry.read(body, _shape())
    validated = _validated_inventory(body)
    if read is None:
        return  # validated whole instead: nothing to hold
    # Accepted: validation takes the body too, and reads the same numbers,
    # of the same types, with everything else the kept report's.
    assert validated is not None
    expected = telemetry.readings_of(validated)
    assert read == expected
    assert [type(v) for v in read] == [type(v) for v in expected]
    strip = set(telemetry.TELEMETRY_FIELDS)
    assert [d.model_dump(exclude=strip) for d in validated.devices] == [
        d.model_dump(exclude=strip) for d in _BASE.inventory.devices
    ]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.fixed_dictionaries(
            {
                "memory_used_mib": st.integers(0, 2**40),
                "utilization_pct": st.one_of(st.none(), st.integers(0, 100)),
                "temperature_c": st.one_of(st.none(), st.integers(-40, 120)),
                "power_w": st.one_of(st.none(), st.floats(0, 1000), st.integers(0, 1000)),
            }
        ),
        min_size=_DEVICES,
        max_size=_DEVICES,
    )
)
def test_an_agents_readings_take_the_readings_path(readings: list[dict[str, Any]]) -> None:
    # What agents send (NVML's types) is never sent to full validation.
    body = _body(_with_readings(readings))
    read = telemetry.read(body, _shape())
    validated = _validated_inventory(body)
    assert validated is not None and read == telemetry.readings_of(validated)


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d["inventory"]["devices"][0].update(healthy=False),
        lambda d: d["inventory"]["devices"][1].update(uuid="GPU-other"),
        lambda d: d["inventory"]["devices"][0].update(memory_total_mib=1),
        lambda d: d["inventory"]["devices"].pop(),
        lambda d: d["inventory"]["devices"][0].update(surprise=1),
        lambda d: d["inventory"].update(hostname="n2"),
        lambda d: d.update(node="n2"),
        lambda d: d.update(address="10.0.0.2"),
        lambda d: d["replicas"][0].update(state="failed"),
        lambda d: d.update(weights=[{"model": "m"}]),
        lambda d: d.update(inventory=[]),
        lambda d: d["inventory"].update(devices={}),
        lambda d: d["inventory"]["devices"].append("x"),
    ],
)
def test_any_other_change_is_another_shape(change: Any) -> None:
    document = _with_readings([{"temperature_c": 50}] * _DEVICES)
    change(document)
    assert telemetry.read(_body(document), _shape()) is None


@pytest.mark.parametrize("body", [b"", b"{", b"[]", b"null", b'{"inventory": 1}', b"\xff"])
def test_what_is_not_a_report_is_no_shape(body: bytes) -> None:
    assert telemetry.read(body, _shape()) is None


def test_a_body_written_otherwise_than_validation_reads_it_keeps_no_shape() -> None:
    # 40.0 for an integer: validation takes it as 40, this module would not
    # say so; that node's reports are all validated whole.
    document = _with_readings([{"temperature_c": 40.0}] * _DEVICES)
    body = _body(document)
    validated = AgentReport.model_validate_json(body)
    assert telemetry.shape_of(body, validated.inventory) is None
    # Duplicate keys: the parsers here and in validation must not disagree.
    duplicated = body.replace(b'"temperature_c": 40.0', b'"temperature_c": 41, "temperature_c": 42')
    read = telemetry.read(duplicated, _shape())
    if read is not None:
        assert read == telemetry.readings_of(AgentReport.model_validate_json(duplicated).inventory)


def test_readings_belong_to_one_inventory_object() -> None:
    inventory = _BASE.inventory
    readings = telemetry.Readings(inventory, telemetry.readings_of(inventory))
    assert telemetry.current(inventory, readings) is readings
    assert telemetry.current(inventory.model_copy(), readings) is None
    assert telemetry.current(None, readings) is None
    assert readings.of(0) == (
        inventory.devices[0].memory_used_mib,
        inventory.devices[0].utilization_pct,
        inventory.devices[0].temperature_c,
        inventory.devices[0].power_w,
    )


def test_a_stored_node_carries_its_latest_readings() -> None:
    node = fleetgen.gpu_node("n1", gpus=2)
    assert node.inventory is not None
    newer = tuple(v for i in range(2) for v in (1000 + i, 50 + i, 60 + i, 300.5 + i))
    node.readings = telemetry.Readings(node.inventory, newer)
    stored = node_from_row(node_row(node))
    assert stored.inventory is not None
    assert telemetry.readings_of(stored.inventory) == newer
    # Readings of an inventory since replaced are not the node's.
    node.inventory = node.inventory.model_copy()
    stored = node_from_row(node_row(node))
    assert stored.inventory is not None
    assert telemetry.readings_of(stored.inventory) == telemetry.readings_of(node.inventory)
