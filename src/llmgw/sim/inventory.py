"""Inventories of simulated nodes, built the way discovery builds real ones.

The devices go through the agent's own :func:`build_devices` (the code that
turns nvidia-smi/NVML facts into placeable devices), fed with made-up card
facts. A simulated node therefore shows exactly what a real one with those
cards would: MIG instances numbered ``1000 + 100 * card + i`` with the class
``<card>-mig-<profile>``, a MIG card with nothing carved as one unplaceable
device with the reason, an unhealthy card with its ECC reason. A second,
hand-written rule here could drift from the real one unnoticed.

Names, UUIDs and product names are derived from the node name, so the same
spec gives the same fleet on every run (a restarted fleet is the same nodes).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from llmgw.agent.discovery.base import CardFacts, HealthFacts, InstanceFacts
from llmgw.agent.discovery.devices import build_devices
from llmgw.agent.discovery.inventory import cpu_devices
from llmgw.sim.fleetspec import FleetSpec, NodeGroup, card_memory_gb
from llmgw.wire import CPU_CLASS, NodeInventory

_NAMESPACE = uuid.UUID("6c1f3f0e-9b1e-4a8e-9c57-2f6d0f1c5a10")
# Reported memory sits a little below the label, as on real cards (GB vs GiB,
# reserved regions); the class is pinned by an override, so this is cosmetic.
_REPORTED_FRACTION = 0.995


@dataclass(frozen=True)
class SimNode:
    """One simulated node: its name, fabrics and the inventory its agent reports."""

    name: str
    fabrics: list[str]
    inventory: NodeInventory
    cpu_slots: int


def _uuid(prefix: str, *parts: object) -> str:
    return f"{prefix}-{uuid.uuid5(_NAMESPACE, '/'.join(str(p) for p in parts))}"


def _product_name(gpu_class: str) -> str:
    # "h100-80g" -> "NVIDIA H100 80GB (sim)": readable in views; the class
    # itself comes from the override below, never from parsing this name.
    model, _, size = gpu_class.rpartition("-")
    if model and size.endswith("g") and size[:-1].isdigit():
        return f"NVIDIA {model.upper()} {size[:-1]}GB (sim)"
    return f"NVIDIA {gpu_class.upper()} (sim)"


def _profile_memory_mib(profile: str) -> int:
    # "3g.40gb" -> 40 GB; "1c.3g.40gb+me" -> 40 GB.
    size = profile.split(".")[-1].removesuffix("+me").removesuffix("gb")
    return int(int(size) * 1024 * _REPORTED_FRACTION) if size.isdigit() else 0


def _cards(node: str, group: NodeGroup) -> list[CardFacts]:
    gb = card_memory_gb(group.gpu_class)
    memory = group.memory_mib or int((gb or 0) * 1024 * _REPORTED_FRACTION)
    name = _product_name(group.gpu_class)
    mig = group.mig
    cards = []
    for index in range(group.gpus):
        card_uuid = _uuid("GPU", node, index)
        in_mig = mig is not None and index < mig.cards
        instances = []
        if in_mig and mig is not None:
            instances = [
                InstanceFacts(
                    uuid=_uuid("MIG", node, index, i),
                    profile=mig.profile,
                    gpu_instance_id=i + 1,
                    compute_instance_id=0,
                    memory_total_mib=_profile_memory_mib(mig.profile),
                )
                for i in range(mig.instances)
            ]
        sick = index >= group.gpus - group.unhealthy
        health = HealthFacts(ecc_volatile_uncorrected=2 if sick else 0)
        cards.append(
            CardFacts(
                index=index,
                uuid=card_uuid,
                name=name,
                memory_total_mib=memory,
                utilization_pct=0,
                temperature_c=35,
                power_w=70.0,
                mig_current=in_mig,
                mig_pending=in_mig,
                instances=instances,
                health=health,
            )
        )
    return cards


def node_inventory(node: str, group: NodeGroup) -> NodeInventory:
    if group.gpu_class == CPU_CLASS:
        return NodeInventory(
            hostname=node, source="fake", devices=cpu_devices(group.cpu_slots, node)
        )
    warnings: list[str] = []
    name = _product_name(group.gpu_class)
    devices = build_devices(
        _cards(node, group), class_overrides={name: group.gpu_class}, warnings=warnings
    )
    return NodeInventory(
        hostname=node,
        source="fake",
        driver_version="550.54.15",
        cuda_version="12.4",
        devices=devices,
        warnings=warnings,
    )


def fleet_nodes(spec: FleetSpec) -> Iterator[SimNode]:
    """Every node of the spec, in order; names are ``<prefix>-<n>``, numbered per prefix."""
    counters: dict[str, int] = {}
    width = max(3, len(str(spec.node_count)))
    for group in spec.nodes:
        for _ in range(group.count):
            n = counters.get(group.prefix, 0)
            counters[group.prefix] = n + 1
            name = f"{group.prefix}-{n:0{width}d}"
            yield SimNode(
                name=name,
                fabrics=group.node_fabrics,
                inventory=node_inventory(name, group),
                cpu_slots=group.cpu_slots,
            )
