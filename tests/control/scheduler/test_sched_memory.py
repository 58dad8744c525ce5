"""CPU replicas placed against the node's RAM: the filter alone, the pass, the planner's words."""

from __future__ import annotations

from tests.control.scheduler.schedkit import fail_starts

from llmgw import memory
from llmgw.control.catalog import validate_catalog
from llmgw.control.scheduler import filters as f
from llmgw.control.scheduler.decisions import PARKED, Policy
from llmgw.control.scheduler.placementnode import placement_node
from llmgw.control.scheduler.planner import plan
from llmgw.control.scheduler.snapshot import build_snapshot
from llmgw.control.state import FleetState, NodeRecord, ReplicaRecord
from llmgw.errors import ValidationError
from llmgw.sim.fleetgen import cpu_node, fleet, gpu_node, model
from llmgw.wire import EngineKind, ModelSpec, ReplicaState, ShardAssignment, WeightsEntry

NOW = 100.0


def with_ram(node: NodeRecord, total_mib: int) -> NodeRecord:
    assert node.inventory is not None
    node.inventory = node.inventory.model_copy(update={"memory_total_mib": total_mib})
    return node


def cpu_model(name: str, memory_mib: int | None, **kwargs: object) -> ModelSpec:
    spec = model(name, classes=("cpu",), **kwargs)  # type: ignore[arg-type]
    return spec.model_copy(update={"memory_mib": memory_mib})


def test_the_filter_names_need_free_and_capacity() -> None:
    check = f.EnoughMemory()
    node = placement_node(with_ram(cpu_node("n1", slots=4, seen_at=NOW), 16384), NOW)
    usable = memory.usable_mib(16384)  # an eighth (2 GiB) stays with the system
    assert usable == 14336
    fits = f.Request.for_spec(cpu_model("m", 4096), memory=memory.RamNeed(4096, 4096))
    assert check.check(node, fits) is None
    big = f.Request.for_spec(cpu_model("m", 20000), memory=memory.RamNeed(20000, 20000))
    rejection = check.check(node, big)
    assert rejection is not None
    assert (rejection.reason, rejection.dimension) == (f.TOO_LITTLE_RAM, "ram")
    assert (rejection.requested, rejection.available, rejection.capacity) == (20000, 14336, 14336)
    # No need stated by placement, or no RAM reported by the node: not refused.
    assert check.check(node, f.Request.for_spec(cpu_model("m", 20000))) is None
    unknown = placement_node(cpu_node("n2", slots=4, seen_at=NOW), NOW)
    assert check.check(unknown, big) is None


def test_a_node_takes_cpu_replicas_until_its_ram_is_spent() -> None:
    # Four slots but RAM for two replicas of 5 GiB: the third waits, with a
    # sentence that says it is RAM, how much is needed and how much is left.
    nodes = [with_ram(cpu_node("n1", slots=4, seen_at=NOW), 12 * 1024)]
    spec = cpu_model("m", 5 * 1024, min_replicas=3, max_replicas=3)
    result = plan(fleet(nodes, [spec], NOW), NOW)
    (m,) = result.models
    assert [r.devices for r in m.replicas if r.action == "place"] == [["n1:cpu0"], ["n1:cpu1"]]
    assert m.status == "cannot fit now"
    # 12 GiB, less 1.5 GiB kept for the system, less two replicas: 512 MiB.
    assert m.reason == (
        "needs 1 free cpu on one node; 0/1 nodes fit: 1 too little free RAM"
        " (needs 5120 MiB, at most 512 MiB free) (placed 2 of 3 missing)"
    )


def test_a_replica_larger_than_any_node_can_never_fit_and_says_what_to_change() -> None:
    nodes = [with_ram(cpu_node(f"n{i}", slots=2, seen_at=NOW), 8192) for i in range(2)]
    spec = cpu_model("m", 16384)
    (m,) = plan(fleet(nodes, [spec], NOW), NOW).models
    assert m.status == "can never fit"
    assert m.reason == (
        "needs 16384 MiB of RAM per replica; the node with the most has 7168 MiB for engines:"
        " lower the model's memory_mib or its context (kv_capacity_tokens), or add RAM"
    )


def test_gpu_replicas_and_nodes_without_ram_figures_are_not_placed_on_ram() -> None:
    gpu = with_ram(gpu_node("g1", gpus=2, seen_at=NOW), 1024)
    spec = model("g", gpus=1).model_copy(update={"memory_mib": 65536})
    cpu_unknown = cpu_node("c1", slots=1, seen_at=NOW)
    small = cpu_model("c", 65536)
    result = plan(fleet([gpu, cpu_unknown], [spec, small], NOW), NOW)
    assert {m.name: m.status for m in result.models} == {"g": "placing", "c": "placing"}


def test_the_default_need_counts_the_weights_a_node_reports() -> None:
    node = with_ram(cpu_node("n1", slots=2, seen_at=NOW), 8192)
    node.weights = [WeightsEntry(model="m", size_bytes=3 * 1024 * memory.MIB)]
    spec = cpu_model("m", None).model_copy(
        update={"engine": EngineKind.LLAMACPP, "kv_capacity_tokens": 8192}
    )
    snapshot = build_snapshot(fleet([node], [spec], NOW), NOW)
    # runtime + weights + KV of 8192 tokens at 32 KiB + prompt-cache headroom
    need = 768 + 3072 + 256 + 512
    assert snapshot.ram_need == {"m": memory.RamNeed(need, need)}
    assert memory.need_mib(spec, None) == 768 + 256 + 512  # before any node holds them


def test_catalog_refuses_a_llamacpp_need_below_its_runtime_and_context() -> None:
    spec = cpu_model("m", 512).model_copy(
        update={"engine": EngineKind.LLAMACPP, "kv_capacity_tokens": 4096}
    )
    try:
        validate_catalog([spec])
    except ValidationError as exc:
        assert "field 'memory_mib': 512 MiB is below what llama.cpp needs" in str(exc)
        assert "896 MiB" in str(exc) and "lower the context" in str(exc)
    else:
        raise AssertionError("a need below llama.cpp's floor was accepted")
    validate_catalog([spec.model_copy(update={"memory_mib": 1024})])


BUDGET_REASON = (
    "out of memory budget: engine used 1.62 GB of its 1.50 GB budget (cgroup v1); killed."
    " Raise the model's memory_mib (now 1536 MiB, estimated) or lower its context"
    " (kv_capacity_tokens, now 8192); last output: ..."
)


def two_nodes_one_serving() -> FleetState:
    # b's replica has served all along; a is the only free place, so every
    # new start goes there (the scenario where a node's fault does not park).
    nodes = [cpu_node("a", seen_at=NOW), cpu_node("b", seen_at=NOW)]
    state = fleet(nodes, [cpu_model("m", None, min_replicas=2)], NOW)
    state.replicas["good"] = ReplicaRecord(
        id="good",
        model="m",
        created_at=NOW - 500,
        shards=[ShardAssignment(node="b", device_numbers=[0], device_uuids=["CPU-b-0"])],
        state=ReplicaState.READY,
    )
    return state


def test_running_out_of_its_budget_again_and_again_parks_the_model_even_on_one_node() -> None:
    policy = Policy(backoff_base_s=0.0, failure_limit=3)
    state = two_nodes_one_serving()
    events, _ = fail_starts(state, policy, 5, NOW, BUDGET_REASON)
    record = state.models["m"]
    assert record.parked and record.failures == 3 and list(record.node_failures) == ["a"]
    parked = [e for e in events if e.startswith("parked:")]
    assert parked == [
        "parked: m parked after 3 consecutive failed starts on 1 node (a); last error: "
        + BUDGET_REASON
    ]
    # The failure events name the cause each time, with what to change.
    failed = [e for e in events if e.startswith("failed:")]
    assert len(failed) == 3 and all("Raise the model's memory_mib" in e for e in failed)
    (planned,) = plan(state, NOW + 10, policy=policy).models
    assert planned.status == PARKED and planned.reason is not None
    assert planned.reason.endswith(
        "or lower its context (kv_capacity_tokens, now 8192); last output: ..."
    )
    # Another cause on one node while another node serves: the node's fault,
    # retried there (test_sched_node_failures), never parked.
    other = two_nodes_one_serving()
    fail_starts(other, policy, 5, NOW, "engine exited with code 1")
    assert not other.models["m"].parked and other.models["m"].failures > policy.failure_limit


def test_a_budget_failure_is_told_from_other_failures() -> None:
    assert memory.budget_failure(BUDGET_REASON)
    assert memory.budget_failure(
        "killed by the kernel's OOM killer at its memory limit (cgroup v2): engine used ..."
    )
    # The whole node ran out: not the model's budget.
    assert not memory.budget_failure(
        "killed by the kernel's OOM killer while the node ran out of memory: engine used ..."
    )
    assert not memory.budget_failure("engine killed by SIGKILL") and not memory.budget_failure(None)


def test_default_needs_by_engine() -> None:
    gpu = model("v", gpus=2).model_copy(update={"engine": EngineKind.VLLM})
    # The host side of a GPU engine: 8 GiB + its weights + 2 GiB per GPU.
    assert memory.need_mib(gpu, 16 * 1024 * memory.MIB, devices=2) == 8192 + 16384 + 4096
    assert memory.need_mib(model("s"), None) == memory.SIM_ENGINE_MIB
    stated = gpu.model_copy(update={"memory_mib": 4096})
    assert memory.need_mib(stated, 16 * 1024 * memory.MIB, devices=2) == 4096
    assert not memory.places_on_ram(gpu) and memory.places_on_ram(cpu_model("c", None))
