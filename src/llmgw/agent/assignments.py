"""Checking what the control plane asks for, before anything is started.

The agent runs only what it was assigned, and only what it can run as
asked: an assignment for another node, an engine this agent has no adapter
for, engine arguments that fail validation, or devices this node does not
have (or that are unhealthy, or that another assignment in the same answer
also claims) is refused as a whole, with a reason the control plane shows
to a person. Nothing of a refused assignment is started, so nothing is left
half applied; the check is a pure function of the answer and the inventory.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from llmgw.agent.engines.base import EngineAdapter, LaunchContext
from llmgw.errors import EngineError
from llmgw.wire import Device, EngineKind, NodeInventory, ReplicaAssignment, device_label_on


@dataclass(frozen=True)
class Accepted:
    assignment: ReplicaAssignment
    adapter: EngineAdapter
    devices: list[Device]


@dataclass
class Checked:
    accepted: dict[str, Accepted] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)


def check_assignments(
    assignments: Iterable[ReplicaAssignment],
    *,
    node: str,
    inventory: NodeInventory,
    adapters: Mapping[EngineKind, EngineAdapter],
    held: Mapping[int, str] | None = None,
) -> Checked:
    """Sort ``assignments`` into accepted and refused.

    ``held`` maps device numbers to the replicas already running on them
    that stay (same id and generation); a new assignment may not take them.
    """
    result = Checked()
    by_number = {d.number: d for d in inventory.devices}
    claimed: dict[int, str] = dict(held or {})
    # A stable order, so that of two assignments claiming one device the same
    # one wins in every pass instead of the two taking turns.
    for assignment in sorted(assignments, key=lambda a: a.replica_id):
        rid = assignment.replica_id
        if rid in result.accepted or rid in result.refused:
            result.refused[rid] = f"replica {rid} is assigned twice in one answer"
            result.accepted.pop(rid, None)
            continue
        try:
            adapter, devices = _check_one(assignment, node, inventory, by_number, adapters)
            for device in devices:
                holder = claimed.get(device.number)
                if holder is not None:
                    raise EngineError(f"device {device.label} is also assigned to replica {holder}")
        except EngineError as exc:
            result.refused[rid] = str(exc)
            continue
        for device in devices:
            claimed[device.number] = rid
        result.accepted[rid] = Accepted(assignment=assignment, adapter=adapter, devices=devices)
    return result


def _check_one(
    assignment: ReplicaAssignment,
    node: str,
    inventory: NodeInventory,
    by_number: Mapping[int, Device],
    adapters: Mapping[EngineKind, EngineAdapter],
) -> tuple[EngineAdapter, list[Device]]:
    shard = assignment.shard
    if shard.node != node:
        raise EngineError(f"the shard is for node {shard.node!r}, this is {node!r}")
    adapter = adapters.get(assignment.model.engine)
    if adapter is None:
        raise EngineError(f"engine {assignment.model.engine.value!r} is not available on this node")
    if not shard.device_numbers:
        raise EngineError("the shard names no devices")
    if len(set(shard.device_numbers)) != len(shard.device_numbers):
        labels = [device_label_on(inventory.devices, n) for n in shard.device_numbers]
        raise EngineError(f"the shard names a device twice: {', '.join(labels)}")
    if shard.device_uuids and len(shard.device_uuids) != len(shard.device_numbers):
        raise EngineError("device_uuids and device_numbers differ in length")
    devices: list[Device] = []
    for index, number in enumerate(shard.device_numbers):
        device = by_number.get(number)
        if device is None:
            label = device_label_on(inventory.devices, number)
            raise EngineError(f"device {label} is not on this node")
        if shard.device_uuids and shard.device_uuids[index] != device.uuid:
            raise EngineError(
                f"device {device.label} is {device.uuid}, not {shard.device_uuids[index]}"
                " (the node's devices changed)"
            )
        if not device.healthy:
            why = ", ".join(device.unhealthy_reasons) or "unhealthy"
            raise EngineError(f"device {device.label} is unhealthy ({why})")
        if not device.placeable:
            why = device.unplaceable_reason or "unplaceable"
            raise EngineError(f"device {device.label} cannot take work ({why})")
        devices.append(device)
    # A dry build runs every check the real launch will (flags, leader
    # address, device pinning), so an assignment that would fail there is
    # refused here instead of failing after its weights were fetched.
    weights = None if assignment.model.weights.kind == "none" else "/dry-run/weights"
    adapter.build(
        LaunchContext(
            assignment=assignment, weights_path=weights, host="127.0.0.1", port=1, devices=devices
        )
    )
    return adapter, devices
