"""The summary's rules, one test each, as the reference (shared/seed/) states them."""

from __future__ import annotations

from tests.control.adminapi.fleetkit import Fleet, gpu, gpus, mig

from llmgw.control.adminapi.patroni import StoreMember, StoreStatus
from llmgw.control.adminapi.summary import IDLE_THRESHOLD_S, Summary, fleet_summary, summarize
from llmgw.control.adminapi.views.fleet import fleet_views
from llmgw.control.scheduler.demand import idle_for
from llmgw.wire import NodeState, ReplicaState


def summary_of(fleet: Fleet, store: StoreStatus | None = None) -> Summary:
    return fleet_summary(fleet.state, fleet.now, store or StoreStatus(members=[]))


def test_on_demand_model_asked_for_that_fits_nowhere_is_short_and_unplaceable() -> None:
    fleet = Fleet()
    fleet.node("n1", gpus(2))
    fleet.model("big", min_replicas=0, max_replicas=1, gpus=8, tp=8,
                demand_at=fleet.now - 5, unplaceable_reason="needs 8 free h100-80g; n1 has 2")
    s = summary_of(fleet)
    assert (s.models.total, s.models.satisfied, s.models.short) == (1, 0, 1)
    assert s.unplaceable == ["big"]


def test_on_demand_model_not_asked_for_is_satisfied_with_nothing() -> None:
    fleet = Fleet()
    fleet.node("n1", gpus(2))
    fleet.model("big", min_replicas=0, max_replicas=1, gpus=8, tp=8)
    s = summary_of(fleet)
    assert (s.models.satisfied, s.models.short, s.unplaceable) == (1, 0, [])


def test_short_model_with_a_replica_still_starting_is_not_unplaceable() -> None:
    fleet = Fleet()
    fleet.node("n1")
    fleet.model("m", min_replicas=2, max_replicas=2)
    fleet.replica("m", "n1", [0])
    fleet.replica("m", "n1", [1], state=ReplicaState.STARTING)
    s = summary_of(fleet)
    assert s.models.short == 1
    assert s.unplaceable == []


def test_short_model_with_nothing_starting_is_unplaceable_even_before_the_scheduler_says() -> None:
    fleet = Fleet()
    fleet.node("n1")
    fleet.model("m", min_replicas=2, max_replicas=2)
    fleet.replica("m", "n1", [0])
    assert summary_of(fleet).unplaceable == ["m"]


def test_parked_model_is_short_and_not_unplaceable_for_having_nothing_starting() -> None:
    # The reference: Unplaceable || (Total <= Ready && !Parked). Parked
    # models are exempt from the second half only.
    fleet = Fleet()
    fleet.node("n1")
    fleet.model("bad", parked=True, failures=5, last_error="engine exited (1)")
    s = summary_of(fleet)
    assert (s.models.satisfied, s.models.short) == (0, 1)
    assert s.unplaceable == []
    assert [(p.model, p.failures, p.reason) for p in s.parked] == [
        ("bad", 5, "engine exited (1)")
    ]


def test_parked_reason_is_a_string_as_the_reference_sends_it() -> None:
    fleet = Fleet()
    fleet.node("n1")
    fleet.model("bad", parked=True, failures=5, last_error=None)
    body = summary_of(fleet).model_dump(mode="json")
    assert body["parked"] == [{"model": "bad", "failures": 5, "reason": ""}]
    assert Summary.model_json_schema()["$defs"]["ParkedModel"]["properties"]["reason"] == {
        "title": "Reason", "type": "string"}


def test_parked_model_the_scheduler_calls_unplaceable_is_listed_as_both() -> None:
    # The first half of the reference's rule holds for parked models too.
    fleet = Fleet()
    fleet.node("n1")
    fleet.model("bad", parked=True, failures=5, last_error="engine exited (1)",
                unplaceable_reason="needs 8 free h100-80g; n1 has 2")
    s = summary_of(fleet)
    assert s.unplaceable == ["bad"] and [p.model for p in s.parked] == ["bad"]
    [view] = fleet_views(fleet.state, fleet.now).models
    assert view.unplaceable and view.reason == "engine exited (1)"  # parked says why first


def test_unplaceable_is_sorted_by_name() -> None:
    fleet = Fleet()
    fleet.node("n1", gpus(2))
    for name in ("zeta", "alpha", "Mid", "beta"):
        fleet.model(name, gpus=8, tp=8, unplaceable_reason="needs 8 free h100-80g; n1 has 2")
    assert summary_of(fleet).unplaceable == ["Mid", "alpha", "beta", "zeta"]  # byte order
    views = fleet_views(fleet.state, fleet.now)
    views.models.reverse()  # whatever order the views come in
    assert summarize(views, StoreStatus(members=[])).unplaceable == ["Mid", "alpha", "beta", "zeta"]


def test_parked_model_with_its_replicas_ready_is_still_not_satisfied() -> None:
    fleet = Fleet()
    fleet.node("n1")
    fleet.model("bad", parked=True, failures=5, last_error="x")
    fleet.replica("bad", "n1", [0])
    assert summary_of(fleet).models.satisfied == 0


def test_unhealthy_gpus_are_not_free() -> None:
    fleet = Fleet()
    fleet.node("n1", [gpu(0), gpu(1), gpu(2, healthy=False), gpu(3, healthy=False)])
    fleet.model("m")
    fleet.replica("m", "n1", [0])
    [use] = summary_of(fleet).gpus
    assert (use.gpu_class, use.total, use.used, use.unhealthy, use.free) == ("h100-80g", 4, 1, 2, 1)


def test_an_unhealthy_gpu_a_replica_still_holds_is_unhealthy_not_used() -> None:
    fleet = Fleet()
    fleet.node("n1", [gpu(0, healthy=False), gpu(1)])
    fleet.model("m")
    fleet.replica("m", "n1", [0])
    [use] = summary_of(fleet).gpus
    assert (use.used, use.unhealthy, use.free) == (0, 1, 1)


def test_a_mig_card_with_nothing_carved_is_neither_used_nor_free() -> None:
    fleet = Fleet()
    fleet.node("n1", [gpu(0, "a100-80g", placeable=False, reason="MIG mode, nothing carved"),
                      gpu(1, "a100-80g")])
    [use] = summary_of(fleet).gpus
    assert (use.total, use.used, use.unhealthy, use.free) == (2, 0, 1, 1)


def test_mig_instances_count_under_their_own_class() -> None:
    fleet = Fleet()
    fleet.node("n1", [mig(0, 0), mig(0, 1), gpu(1, "a100-80g")])
    fleet.model("small", gpu_classes=["a100-80g-mig-3g.40gb"])
    fleet.replica("small", "n1", [1001])
    s = summary_of(fleet)
    by_class = {u.gpu_class: (u.total, u.used, u.free) for u in s.gpus}
    assert by_class == {"a100-80g": (1, 0, 1), "a100-80g-mig-3g.40gb": (2, 1, 1)}


def test_a_node_with_one_gpu_in_use_is_not_in_the_free_block() -> None:
    fleet = Fleet()
    fleet.node("n1")
    fleet.node("n2")
    fleet.node("n3")
    fleet.model("m")
    fleet.replica("m", "n2", [3])
    [fabric] = summary_of(fleet).fabrics
    assert (fabric.nodes, fabric.largest_free_block) == (3, 2)


def test_only_ready_nodes_with_devices_are_in_the_free_block() -> None:
    fleet = Fleet()
    fleet.node("ready")
    fleet.node("cordoned", admin_state=NodeState.CORDONED)
    fleet.node("gone", seen_ago=600)
    fleet.node("empty", [])
    [fabric] = summary_of(fleet).fabrics
    assert fabric.largest_free_block == 1


def test_cpu_slots_count_toward_the_free_block() -> None:
    # A CPU replica may span nodes too, and placement's whole-node rule
    # counts every device (docs/install.md, the summary section).
    fleet = Fleet()
    fleet.node("cpu-1", [gpu(0, "cpu"), gpu(1, "cpu")])
    fleet.node("cpu-2", [gpu(0, "cpu")])
    fleet.model("m", gpu_classes=["cpu"])
    fleet.replica("m", "cpu-2", [0])
    [fabric] = summary_of(fleet).fabrics
    assert (fabric.nodes, fabric.largest_free_block) == (2, 1)


def test_weights_in_one_fabric_do_not_count_in_another() -> None:
    fleet = Fleet()
    fleet.node("a1", fabrics=("ib-a",), weights=("llama", "qwen"))
    fleet.node("a2", fabrics=("ib-a",), weights=("llama",))
    fleet.node("b1", fabrics=("ib-b",))
    fabrics = {f.fabric: f for f in summary_of(fleet).fabrics}
    assert (fabrics["ib-a"].nodes_with_weights, fabrics["ib-a"].models_present) == (2, 2)
    assert (fabrics["ib-b"].nodes_with_weights, fabrics["ib-b"].models_present) == (0, 0)


def test_idle_only_past_ten_minutes_and_only_when_ready() -> None:
    fleet = Fleet()
    fleet.node("n1")
    fleet.model("m", min_replicas=5, max_replicas=5, gpus=2, tp=2)
    young = fleet.replica("m", "n1", [0, 1], idle=IDLE_THRESHOLD_S - 1)
    old = fleet.replica("m", "n1", [2, 3], idle=IDLE_THRESHOLD_S)
    older = fleet.replica("m", "n1", [4, 5], idle=IDLE_THRESHOLD_S * 3)
    draining = fleet.replica("m", "n1", [6, 7], state=ReplicaState.DRAINING, idle=99999)
    idle = summary_of(fleet).idle_replicas
    assert [(i.id, i.idle_seconds, i.gpus) for i in idle] == [
        (older.id, IDLE_THRESHOLD_S * 3, 2),
        (old.id, IDLE_THRESHOLD_S, 2),
    ]
    assert young.id not in {i.id for i in idle} and draining.id not in {i.id for i in idle}


def test_idle_counts_from_the_last_request() -> None:
    fleet = Fleet()
    fleet.node("n1")
    fleet.model("m")
    replica = fleet.replica("m", "n1", [0], idle=7200)
    replica.last_request_at = fleet.now - 30
    assert summary_of(fleet).idle_replicas == []


def test_a_replica_with_requests_in_flight_is_idle_nowhere() -> None:
    # One request streaming for longer than the threshold is use, not idleness:
    # the summary, the replica views and the scheduler all say 0.
    fleet = Fleet()
    fleet.node("n1")
    fleet.model("m", min_replicas=0, max_replicas=1)
    replica = fleet.replica("m", "n1", [0], idle=7200)
    replica.last_request_at = fleet.now - 3 * IDLE_THRESHOLD_S
    replica.in_flight = 1
    fleet_summary(fleet.state, fleet.now - 60, StoreStatus(members=[]))  # memoised view
    assert summary_of(fleet).idle_replicas == []
    [listed] = fleet_views(fleet.state, fleet.now).replicas
    assert listed.idle_seconds == 0
    assert replica.idle_seconds(fleet.now) == 0
    assert idle_for(replica, fleet.now) == 0
    replica.in_flight = 0
    [idle] = summary_of(fleet).idle_replicas
    assert idle.idle_seconds == 3 * IDLE_THRESHOLD_S


def test_node_totals_by_state() -> None:
    fleet = Fleet()
    fleet.node("a")
    fleet.node("b", admin_state=NodeState.CORDONED)
    fleet.node("c", admin_state=NodeState.DRAINING)
    fleet.node("d", admin_state=NodeState.CORDONED, seen_ago=120)
    nodes = summary_of(fleet).nodes
    assert (nodes.total, nodes.ready, nodes.cordoned, nodes.draining, nodes.unreachable) == (
        4, 1, 1, 1, 1)


def test_replica_totals_by_state() -> None:
    fleet = Fleet()
    fleet.node("n1")
    fleet.model("m", max_replicas=4)
    for number, state in enumerate(
        [ReplicaState.READY, ReplicaState.STARTING, ReplicaState.DRAINING, ReplicaState.FAILED]
    ):
        fleet.replica("m", "n1", [number], state=state)
    r = summary_of(fleet).replicas
    assert (r.ready, r.starting, r.draining, r.failed) == (1, 1, 1, 1)


def test_store_members_and_error_pass_through() -> None:
    fleet = Fleet()
    member = StoreMember(name="pg0", host="10.0.0.1", role="leader", state="running", lag=0)
    s = summary_of(fleet, StoreStatus(members=[member], error=None))
    assert s.store == [member] and s.store_error is None
    s = summary_of(fleet, StoreStatus(members=[], error="cannot read"))
    assert s.store == [] and s.store_error == "cannot read"


def test_json_uses_the_reference_field_names() -> None:
    fleet = Fleet()
    fleet.node("n1", weights=("m",))
    fleet.model("m")
    fleet.replica("m", "n1", [0], idle=3600)
    body = summary_of(fleet).model_dump(mode="json")
    assert set(body) == {"nodes", "gpus", "fabrics", "replicas", "models", "unplaceable",
                         "parked", "idle_replicas", "store", "store_error"}
    assert set(body["gpus"][0]) == {"class", "total", "used", "unhealthy", "free"}
    assert set(body["fabrics"][0]) == {"fabric", "nodes", "nodes_with_weights",
                                       "models_present", "largest_free_block"}
    assert set(body["idle_replicas"][0]) == {"id", "model", "idle_seconds", "gpus"}
    assert set(body["models"]) == {"total", "satisfied", "short"}
    assert set(body["nodes"]) == {"total", "ready", "cordoned", "draining", "unreachable"}
    # "unreachable" is llmgw's addition (replicas whose node stopped reporting).
    assert set(body["replicas"]) == {"ready", "starting", "draining", "failed", "unreachable"}
    member = StoreMember(name="pg0", host="10.0.0.1", role="leader", state="running", lag=0)
    fleet.model("bad", parked=True, failures=5, last_error="x")
    body = summary_of(fleet, StoreStatus(members=[member])).model_dump(mode="json")
    assert body["store"] == [
        {"name": "pg0", "host": "10.0.0.1", "role": "leader", "state": "running", "lag": 0}
    ]
    assert body["parked"] == [{"model": "bad", "failures": 5, "reason": "x"}]


def test_empty_fields_are_present_and_the_openapi_description_says_so() -> None:
    body = summary_of(Fleet()).model_dump(mode="json")
    # gpus: [] where the reference sends null (a Go nil slice), said below.
    for name in ("gpus", "fabrics", "unplaceable", "parked", "idle_replicas", "store"):
        assert body[name] == []
    assert body["store_error"] is None
    description = " ".join(Summary.model_json_schema()["description"].split())
    assert "Every field is always present" in description
    assert "``gpus`` too, where the reference sends null" in description
    assert "also carries ``free``" in description


def test_views_listing_path_gives_the_same_summary() -> None:
    from llmgw.control.adminapi.summary import summarize

    fleet = Fleet()
    fleet.node("n1", weights=("m",))
    fleet.node("n2", [gpu(0, healthy=False), *gpus(3)[1:]], fabrics=("ib-b",))
    fleet.model("m", max_replicas=3)
    fleet.replica("m", "n1", [0], idle=3600)
    fleet.replica("m", "n2", [1], state=ReplicaState.STARTING)
    store = StoreStatus(members=[])
    assert summarize(fleet_views(fleet.state, fleet.now), store) == summary_of(fleet)
