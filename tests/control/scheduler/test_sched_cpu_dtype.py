"""vLLM on CPU slots placed by what each node's CPU computes in.

Where a node reports a CPU without bfloat16 instructions, its agent runs
vLLM in float32 (agent.engines.cpudtype) and the engine holds a bfloat16
checkpoint twice: placement charges that node the agent's budget, and every
other node the checkpoint once.
"""

from __future__ import annotations

from llmgw import memory
from llmgw.control.scheduler.planner import plan
from llmgw.control.scheduler.snapshot import build_snapshot
from llmgw.control.sleep import node_free_mib
from llmgw.control.state import NodeRecord, ReplicaRecord
from llmgw.sim.fleetgen import cpu_node, fleet, model
from llmgw.wire import EngineKind, ModelSpec, ReplicaState, ShardAssignment, WeightsEntry

NOW = 100.0
GIB = 1024
WEIGHTS_MIB = 4 * GIB
# vLLM's host side and the weights, once or twice (llmgw.memory).
ONCE = memory.GPU_ENGINE_HOST_MIB + WEIGHTS_MIB
TWICE = memory.GPU_ENGINE_HOST_MIB + 2 * WEIGHTS_MIB


def node(name: str, ram_mib: int, cpu_bf16: bool | None, slots: int = 4) -> NodeRecord:
    record = cpu_node(name, slots=slots, seen_at=NOW)
    assert record.inventory is not None
    record.inventory = record.inventory.model_copy(
        update={"memory_total_mib": ram_mib, "cpu_bf16": cpu_bf16}
    )
    record.weights = [WeightsEntry(model="v", size_bytes=WEIGHTS_MIB * memory.MIB)]
    return record


def vllm(*engine_args: str, replicas: int = 1) -> ModelSpec:
    spec = model("v", classes=("cpu",), min_replicas=replicas, max_replicas=replicas,
                 engine=EngineKind.VLLM)  # fmt: skip
    return spec.model_copy(update={"engine_args": list(engine_args)})


def test_the_need_by_engine_and_dtype() -> None:
    state = fleet([node("n", 64 * GIB, False)], [vllm()], NOW)
    need = build_snapshot(state, NOW).ram_need["v"]
    assert need == memory.RamNeed(ONCE, TWICE)
    # A node that cannot tell gets what its agent budgets: the checkpoint once.
    assert (need.on(True), need.on(None), need.on(False)) == (ONCE, ONCE, TWICE)
    # A type the catalog names decides on every node.
    assert memory.RamNeed.of(vllm("--dtype", "float32"), WEIGHTS_MIB * memory.MIB) == (
        memory.RamNeed(TWICE, TWICE)
    )
    assert memory.RamNeed.of(vllm("--dtype=bfloat16"), WEIGHTS_MIB * memory.MIB) == (
        memory.RamNeed(ONCE, ONCE)
    )
    llamacpp = vllm().model_copy(update={"engine": EngineKind.LLAMACPP})
    once = memory.RamNeed.of(llamacpp, WEIGHTS_MIB * memory.MIB)
    assert once.native == once.float32


def test_the_replica_goes_where_its_float32_copy_is_not_needed() -> None:
    # 16 GiB nodes give engines 14 GiB: room for the checkpoint once (12 GiB),
    # not twice (16 GiB). The node without bfloat16 comes first by name.
    nodes = [node("a-avx2", 16 * GIB, False), node("b-bf16", 16 * GIB, True)]
    (m,) = plan(fleet(nodes, [vllm()], NOW), NOW).models
    assert [r.devices for r in m.replicas if r.action == "place"] == [["b-bf16:cpu0"]]


def test_a_fleet_without_bfloat16_says_the_float32_need_can_never_fit() -> None:
    (m,) = plan(fleet([node("a-avx2", 16 * GIB, False)], [vllm()], NOW), NOW).models
    assert m.status == "can never fit"
    assert m.reason == (
        f"needs {TWICE} MiB of RAM per replica; the node with the most has 14336 MiB for engines:"
        " lower the model's memory_mib or its context (kv_capacity_tokens), or add RAM"
    )


def test_each_replica_on_a_float32_node_is_charged_twice_the_weights() -> None:
    # 48 GiB leaves engines 42 GiB: three replicas holding the checkpoint once
    # (36 GiB), two holding it twice (32 GiB).
    nodes = [node("a-avx2", 48 * GIB, False)]
    (m,) = plan(fleet(nodes, [vllm(replicas=3)], NOW), NOW).models
    assert len([r for r in m.replicas if r.action == "place"]) == 2
    assert m.status == "cannot fit now"
    assert m.reason == (
        "needs 1 free cpu on one node; 0/1 nodes fit: 1 too little free RAM"
        f" (needs {ONCE} MiB ({TWICE} MiB on CPUs without bfloat16), at most 10240 MiB free)"
        " (placed 2 of 3 missing)"
    )


def test_sleep_counts_a_nodes_free_ram_as_placement_charges_it() -> None:
    # What is left for sleepers' weights on a node running a vLLM CPU
    # replica: the checkpoint it holds, twice over where the CPU lacks bfloat16.
    for cpu_bf16, charged in ((True, ONCE), (False, TWICE)):
        state = fleet([node("n", 64 * GIB, cpu_bf16)], [vllm()], NOW)
        state.replicas["r"] = ReplicaRecord(
            id="r", model="v", created_at=0, state=ReplicaState.READY, ready_at=1,
            shards=[ShardAssignment(node="n", device_numbers=[0])],
        )
        assert node_free_mib(state, "n") == memory.usable_mib(64 * GIB) - charged
