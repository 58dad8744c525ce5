"""sim.telemetry: each step moves every GPU's readings, and nothing else."""

from __future__ import annotations

import itertools

from llmgw.sim import fleetgen
from llmgw.sim.telemetry import TelemetryWalk
from llmgw.wire import NodeInventory


def _fields_but_telemetry(inventory: NodeInventory) -> list[dict[str, object]]:
    telemetry = {"memory_used_mib", "utilization_pct", "temperature_c", "power_w"}
    return [
        {k: v for k, v in d.model_dump().items() if k not in telemetry} for d in inventory.devices
    ]


def test_every_step_moves_every_gpu_and_keeps_the_rest() -> None:
    node = fleetgen.gpu_node("n1", gpus=4, mig={1: ("3g.40gb", 2), 2: ("3g.40gb", 0)})
    assert node.inventory is not None
    walk = TelemetryWalk(node.inventory, seed=7)
    before = walk.inventory()
    for _ in range(20):
        after = walk.inventory()
        assert _fields_but_telemetry(after) == _fields_but_telemetry(node.inventory)
        for old, new in zip(before.devices, after.devices, strict=True):
            # Memory in use moves on every device; the card's power with it.
            assert new.memory_used_mib != old.memory_used_mib
            assert 0 <= new.memory_used_mib <= new.memory_total_mib
            assert new.power_w is not None and 40.0 <= new.power_w <= 700.0
            assert new.temperature_c is not None and 25 <= new.temperature_c <= 92
            if new.mig is None and new.placeable:
                assert new.utilization_pct is not None and 0 <= new.utilization_pct <= 100
            else:
                # Discovery's rule: MIG instances and unplaceable cards say no utilisation.
                assert new.utilization_pct is None
        before = after


def test_the_same_seed_walks_the_same_way_and_cpu_slots_carry_nothing() -> None:
    gpu = fleetgen.gpu_node("n1", gpus=2).inventory
    assert gpu is not None
    assert TelemetryWalk(gpu, "s").step() == TelemetryWalk(gpu, "s").step()
    assert TelemetryWalk(gpu, "s").step() != TelemetryWalk(gpu, "t").step()
    cpu = fleetgen.cpu_node("c1", slots=2).inventory
    assert cpu is not None
    assert TelemetryWalk(cpu, 1).step() == [{}, {}]


def test_with_churn_processes_come_and_go_and_the_rest_stays() -> None:
    node = fleetgen.gpu_node("n1", gpus=4, mig={1: ("3g.40gb", 2)})
    assert node.inventory is not None
    walk = TelemetryWalk(node.inventory, seed=5, process_churn=0.2)
    lists = []
    for _ in range(40):
        inventory = walk.inventory()
        # As an agent sends it: the report validates with its processes.
        assert NodeInventory.model_validate_json(inventory.model_dump_json()) == inventory
        fields = _fields_but_telemetry(inventory)
        lists.append([d.pop("processes") for d in fields])
        assert fields == [{k: v for k, v in d.items() if k != "processes"}
                          for d in _fields_but_telemetry(node.inventory)]
    changed = sum(a != b for a, b in itertools.pairwise(lists))
    # Each device changes one step in five: some steps change the lists, some not.
    assert 0 < changed < len(lists) - 1
    assert any(p for devices in lists for p in devices)
    cpu = fleetgen.cpu_node("c1", slots=2).inventory
    assert cpu is not None
    assert TelemetryWalk(cpu, 1, process_churn=1.0).step() == [{}, {}]
