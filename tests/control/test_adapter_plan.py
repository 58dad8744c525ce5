"""control.adapters and control.sleep as pure functions of a fleet built by hand."""

from __future__ import annotations

from llmgw.control.adapters import plan_adapters
from llmgw.control.reports import assignments_for
from llmgw.control.sleep import plan_sleep
from llmgw.control.state import FleetState, ModelRecord, NodeRecord, ReplicaRecord
from llmgw.sleepmode import can_sleep, sleeps_by_itself
from llmgw.wire import ModelSpec, NodeInventory, ReplicaState, ShardAssignment

NOW = 1_000_000.0


def fleet(slots: int = 2, replicas: int = 1, adapters: int = 3,
          memory_total_mib: int | None = None) -> FleetState:  # fmt: skip
    state = FleetState()
    state.nodes["n1"] = NodeRecord(
        name="n1", registered_at=0, last_seen=NOW,
        inventory=NodeInventory(hostname="n1", memory_total_mib=memory_total_mib),
    )
    base = ModelSpec(name="base", engine="sim", sim={"max_loras": slots})
    state.models["base"] = ModelRecord(spec=base, created_at=0, updated_at=0)
    for i in range(adapters):
        name = f"ad-{i}"
        spec = ModelSpec(name=name, engine="sim", base="base", min_replicas=0)
        state.models[name] = ModelRecord(spec=spec, created_at=0, updated_at=0)
    for i in range(replicas):
        state.replicas[f"r{i}"] = ReplicaRecord(
            id=f"r{i}", model="base", created_at=0, state=ReplicaState.READY, ready_at=1,
            shards=[ShardAssignment(node="n1", device_numbers=[i])],
        )
    return state


def asked(state: FleetState, name: str, at: float) -> None:
    state.models[name].demand_at = at


def settle(state: FleetState, now: float = NOW) -> dict[str, tuple[str, ...]]:
    """One pass's lists applied, and the engines reporting them loaded."""
    for rid, names in plan_adapters(state, now).changes.items():
        state.replicas[rid].adapters = names
        state.replicas[rid].loaded_adapters = frozenset(names)
    return {rid: r.adapters or () for rid, r in state.replicas.items()}


def test_asked_adapters_load_and_the_least_recently_used_makes_room() -> None:
    state = fleet(slots=2)
    assert settle(state) == {"r0": ()}  # nobody asked: nothing loaded
    asked(state, "ad-0", NOW - 30)
    asked(state, "ad-1", NOW - 20)
    assert settle(state) == {"r0": ("ad-0", "ad-1")}
    asked(state, "ad-0", NOW - 10)  # used again: now ad-1 is the older
    asked(state, "ad-2", NOW - 5)
    assert settle(state) == {"r0": ("ad-0", "ad-2")}


def test_a_second_replica_with_free_slots_is_preferred_to_an_unload() -> None:
    state = fleet(slots=1, replicas=2)
    asked(state, "ad-0", NOW - 3)
    asked(state, "ad-1", NOW - 2)
    lists = settle(state)
    assert sorted(lists.values()) == [("ad-0",), ("ad-1",)]


def test_idle_adapters_are_unloaded_and_unplaceable_ones_say_why() -> None:
    state = fleet(slots=1)
    asked(state, "ad-0", NOW - 10_000)  # past its idle timeout (900 s)
    state.replicas["r0"].adapters = ("ad-0",)
    assert settle(state) == {"r0": ()}
    state.replicas["r0"].adapter_errors = {"ad-1": "load refused: HTTP 400: rank"}
    asked(state, "ad-1", NOW)
    plan = plan_adapters(state, NOW)
    assert plan.bases["base"].not_loaded == {
        "ad-1": "refused by 1 of 1 replica(s) of 'base': load refused: HTTP 400: rank"
    }
    state.replicas["r0"].state = ReplicaState.DRAINING
    assert plan_adapters(state, NOW).bases["base"].not_loaded["ad-1"] == (
        "no ready replica of its base 'base'"
    )


def sleepy_fleet(memory_total_mib: int | None, weights_mib: int) -> FleetState:
    state = fleet(adapters=0, memory_total_mib=memory_total_mib)
    spec = ModelSpec(name="s", engine="sim", min_replicas=0, idle_timeout_s=60,
                     sim={"sleep_s": 0.1, "weights_mib": weights_mib})  # fmt: skip
    state.models["s"] = ModelRecord(spec=spec, created_at=0, updated_at=0, demand_at=NOW - 100)
    state.replicas["s1"] = ReplicaRecord(
        id="s1", model="s", created_at=0, state=ReplicaState.READY, ready_at=NOW - 100,
        last_request_at=NOW - 100, shards=[ShardAssignment(node="n1", device_numbers=[5])],
    )
    return state


def test_an_idle_replica_sleeps_where_the_nodes_ram_holds_its_weights() -> None:
    state = sleepy_fleet(memory_total_mib=64 * 1024, weights_mib=16 * 1024)
    plan = plan_sleep(state, NOW)
    assert [r.id for r in plan.sleep] == ["s1"] and not plan.no_room
    tight = sleepy_fleet(memory_total_mib=16 * 1024, weights_mib=16 * 1024)
    plan = plan_sleep(tight, NOW)
    assert plan.sleep == [] and "do not fit in node n1's free RAM" in plan.no_room["s1"]


def test_a_sleeping_replica_is_woken_by_a_request_after_it_fell_asleep() -> None:
    state = sleepy_fleet(memory_total_mib=64 * 1024, weights_mib=1024)
    replica = state.replicas["s1"]
    replica.asleep, replica.asleep_since = True, NOW - 50
    assert plan_sleep(state, NOW).wake == []
    state.models["s"].demand_at = NOW - 1
    assert [r.id for r in plan_sleep(state, NOW).wake] == ["s1"]


def test_a_new_leader_keeps_a_sleeper_asleep_and_takes_the_loaded_adapters_as_they_are() -> None:
    from llmgw.control.reports import apply_report, assignments_for
    from llmgw.wire import AgentReport, ReplicaStatus

    state = sleepy_fleet(memory_total_mib=64 * 1024, weights_mib=1024)
    state.models["s"].demand_at = None
    replica = state.replicas["s1"]
    replica.port = 9000
    assert replica.asleep is None  # nothing decided since this instance began to lead
    report = AgentReport(node="n1", inventory=NodeInventory(hostname="n1"), replicas=[
        ReplicaStatus(replica_id="s1", state=ReplicaState.READY, port=9000, sleeping=True),
        ReplicaStatus(replica_id="r0", state=ReplicaState.READY, port=9001,
                      adapters=["ad-1"]),
    ])  # fmt: skip
    effects = apply_report(state, state.nodes["n1"], report, NOW)
    assert effects.routing_changed
    assert replica.asleep and not state.routable(replica, NOW)
    (told,) = [a for a in assignments_for(state, "n1") if a.replica_id == "s1"]
    assert told.asleep  # not woken by a leader that never decided it
    assert state.replicas["r0"].adapters == ("ad-1",)
    assert plan_sleep(state, NOW).wake == []  # nobody asked since


def test_an_adapter_whose_replicas_are_all_busy_is_loaded_on_one_more() -> None:
    from llmgw.control.adapters import adapter_load_demand

    state = fleet(slots=2, replicas=2)
    adapter = state.models["ad-0"]
    adapter.spec = adapter.spec.model_copy(update={"max_replicas": 2})
    asked(state, "ad-0", NOW - 1)
    assert list(settle(state).values()).count(("ad-0",)) == 1
    holder = next(r for r in state.replicas.values() if r.adapters)
    assert adapter_load_demand(state, adapter, busy=8) == 0
    holder.in_flight = 9
    adapter.load_demand = adapter_load_demand(state, adapter, busy=8)
    assert adapter.load_demand == 1
    assert settle(state) == {"r0": ("ad-0",), "r1": ("ad-0",)}
    asked(state, "ad-0", NOW - 10_000)  # unused since: load no longer keeps it anywhere
    assert settle(state) == {"r0": (), "r1": ()}


def test_a_llama_server_base_serves_the_adapters_it_started_with_and_says_why_not_others() -> None:
    state = fleet(replicas=2, adapters=3)
    base = ModelSpec(name="base", engine="llama-server",
                     weights={"kind": "local", "path": "/m/base.gguf"})  # fmt: skip
    state.models["base"] = ModelRecord(spec=base, created_at=0, updated_at=0)
    for i in range(3):
        spec = ModelSpec(name=f"ad-{i}", engine="llama-server", base="base",
                         weights={"kind": "local", "path": f"/m/{i}.gguf"})  # fmt: skip
        state.models[spec.name] = ModelRecord(spec=spec, created_at=0, updated_at=0)
    # r0 started before ad-2 was added; r1 after. Nobody asked for any:
    # each is served anyway, since the engine holds it whatever is asked.
    state.replicas["r0"].loaded_adapters = frozenset({"ad-0", "ad-1"})
    state.replicas["r0"].adapter_errors = {"ad-2": "llama-server takes adapters only at its start"}
    state.replicas["r1"].loaded_adapters = frozenset({"ad-0", "ad-1", "ad-2"})
    plan = plan_adapters(state, NOW)
    assert plan.changes == {"r0": ("ad-0", "ad-1"), "r1": ("ad-0", "ad-1", "ad-2")}
    assert plan.bases["base"].slots_per_replica == 3 and not plan.bases["base"].not_loaded
    state.replicas["r1"].loaded_adapters = frozenset()
    why = plan_adapters(state, NOW).bases["base"].not_loaded
    assert list(why) == ["ad-2"] and "takes adapters only at its start" in why["ad-2"]


def test_a_llama_server_replica_is_assigned_every_adapter_of_its_base_by_name() -> None:
    state = fleet(replicas=1, adapters=0)
    state.models["base"] = ModelRecord(spec=ModelSpec(
        name="base", engine="llama-server", weights={"kind": "local", "path": "/m/b.gguf"},
    ), created_at=0, updated_at=0)  # fmt: skip
    for name in ("zz", "aa"):
        spec = ModelSpec(name=name, engine="llama-server", base="base",
                         weights={"kind": "local", "path": f"/m/{name}.gguf"})  # fmt: skip
        state.models[name] = ModelRecord(spec=spec, created_at=0, updated_at=0)
    (only,) = assignments_for(state, "n1")
    assert [a.name for a in only.adapters] == ["aa", "zz"]  # the engine's numbering


def test_a_llama_server_that_sleeps_by_itself_sleeps_in_no_extra_ram() -> None:
    # It frees its weights as it falls asleep: a node whose RAM could not
    # hold a vLLM's weights a second time still lets it sleep.
    state = sleepy_fleet(memory_total_mib=16 * 1024, weights_mib=1024)
    spec = ModelSpec(name="s", engine="llama-server", min_replicas=0, idle_timeout_s=60,
                     weights={"kind": "local", "path": "/m/s.gguf"}, gpu_classes=["h100-80g"],
                     engine_args=["--sleep_idle_seconds", "30"])  # fmt: skip
    state.models["s"].spec = spec
    assert can_sleep(spec) and sleeps_by_itself(spec)
    assert [r.id for r in plan_sleep(state, NOW).sleep] == ["s1"]
    vllm = ModelSpec.model_validate({**spec.model_dump(), "engine": "vllm",
                                     "engine_args": ["--enable-sleep-mode"],
                                     "memory_mib": 64 * 1024})  # fmt: skip
    state.models["s"].spec = vllm  # its 64 GiB of weights would move to the node's RAM
    assert "do not fit" in plan_sleep(state, NOW).no_room["s1"]
    off = spec.model_copy(update={"engine_args": ["--sleep-idle-seconds", "-1"]})
    assert not can_sleep(off) and not can_sleep(spec.model_copy(update={"engine_args": []}))


def test_an_asleep_llama_server_stays_routable_where_an_asleep_vllm_does_not() -> None:
    # One rule for the gateways' table, the scheduler's "is this model
    # stranded" and the summary: llama-server wakes itself for a request, so
    # its dozing replica serves; vLLM's waits for the control plane to wake it.
    state = sleepy_fleet(memory_total_mib=64 * 1024, weights_mib=1024)
    replica = state.replicas["s1"]
    assert state.routable(replica, NOW)
    replica.sleeping = True  # reported asleep
    dozing = ModelSpec(name="s", engine="llama-server", min_replicas=0, idle_timeout_s=60,
                       weights={"kind": "local", "path": "/m/s.gguf"},
                       engine_args=["--sleep-idle-seconds", "30"])  # fmt: skip
    state.models["s"].spec = dozing
    assert state.routable(replica, NOW)
    state.models["s"].spec = dozing.model_copy(update={"engine_args": []})
    assert not state.routable(replica, NOW)
    state.models["s"].spec = ModelSpec(name="s", engine="vllm", min_replicas=0,
                                       engine_args=["--enable-sleep-mode"],
                                       weights={"kind": "local", "path": "/m/s"})  # fmt: skip
    assert not state.routable(replica, NOW)
