"""Engine records on disk, and which assignments the agent accepts or refuses."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from tests.agent.helpers import assign, cpu_slot, gpu, mig_instance, model

from llmgw.agent.assignments import check_assignments
from llmgw.agent.engines import EngineAdapter, LlamaCppAdapter, VllmAdapter
from llmgw.agent.identity import Identity, agent_key, load_identity, save_identity
from llmgw.agent.state import EngineRecord, StateStore
from llmgw.errors import ConfigError
from llmgw.wire import EngineKind, NodeInventory, WeightsSource


def test_records_survive_a_restart_and_the_file_is_private(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "engines.json")
    a = assign(model("vllm"), [gpu(0)])
    store.put(
        EngineRecord(
            replica_id="r1",
            generation=1,
            model="m",
            assignment=a,
            port=20001,
            pid=123,
            birth="boot:1500",
        )
    )
    assert stat.S_IMODE((tmp_path / "engines.json").stat().st_mode) == 0o600
    again = StateStore(tmp_path / "engines.json").load()
    assert again["r1"].pid == 123 and again["r1"].assignment == a
    store.remove("r1")
    assert StateStore(tmp_path / "engines.json").load() == {}


def test_a_corrupt_state_file_is_kept_aside(tmp_path: Path) -> None:
    (tmp_path / "engines.json").write_text("{not json")
    assert StateStore(tmp_path / "engines.json").load() == {}
    assert (tmp_path / "engines.corrupt").read_text() == "{not json"


def test_identity_belongs_to_one_node(tmp_path: Path) -> None:
    save_identity(tmp_path, Identity(node="n1", node_token="llmgw-node-x"))
    assert stat.S_IMODE((tmp_path / "node.json").stat().st_mode) == 0o600
    loaded = load_identity(tmp_path, "n1")
    assert loaded is not None and loaded.node_token == "llmgw-node-x"
    try:
        load_identity(tmp_path, "n2")
    except ConfigError as exc:
        assert "belongs to node 'n1'" in str(exc)
    else:
        raise AssertionError("another node's data dir was accepted")


def test_agent_key_is_made_once_private_and_kept(tmp_path: Path) -> None:
    data_dir = tmp_path / "fresh"  # not there yet: the key may be its first file
    key = agent_key(data_dir)
    assert key.startswith("llmgw-agent-key-") and len(key) >= 32
    assert stat.S_IMODE((data_dir / "agent.key").stat().st_mode) == 0o600
    assert agent_key(data_dir) == key
    assert [p.name for p in data_dir.iterdir()] == ["agent.key"]  # no temp file left
    assert agent_key(tmp_path / "other") != key


def test_a_damaged_agent_key_is_refused_without_showing_it(tmp_path: Path) -> None:
    (tmp_path / "agent.key").write_text("llmgw-agent-key-trunc")
    with pytest.raises(ConfigError, match="not a valid agent key; remove it") as caught:
        agent_key(tmp_path)
    assert "trunc" not in str(caught.value)
    assert "llmgw ctl nodes delete" in str(caught.value)


ADAPTERS: dict[EngineKind, EngineAdapter] = {
    EngineKind.VLLM: VllmAdapter(),
    EngineKind.LLAMACPP: LlamaCppAdapter(server_binary=""),
}


def inventory() -> NodeInventory:
    sick = gpu(3).model_copy(update={"healthy": False, "unhealthy_reasons": ["uncorrectable ECC"]})
    return NodeInventory(hostname="n1", devices=[gpu(0), gpu(1), gpu(2), sick, mig_instance()])


def test_assignments_are_checked_whole() -> None:
    ok = assign(model("vllm", tp=2), [gpu(0), gpu(1)], replica_id="a-ok")
    mig = assign(
        model("vllm", gpu_classes=["a100-80g-mig-3g.40gb"]), [mig_instance()], replica_id="b-mig"
    )
    sick = assign(model("vllm"), [gpu(3)], replica_id="c-sick")
    stale = assign(model("vllm"), [gpu(2)], replica_id="d-stale")
    stale.shard.device_uuids = ["GPU-somebody-else"]
    sglang = assign(model("sglang"), [gpu(2)], replica_id="e-sglang")
    taken = assign(model("vllm"), [gpu(1)], replica_id="f-taken")
    bad_leader = assign(model("vllm", pp=2, nodes=2), [gpu(2)], replica_id="g-leader", rank=1)
    checked = check_assignments(
        [ok, mig, sick, stale, sglang, taken, bad_leader],
        node="n1",
        inventory=inventory(),
        adapters=ADAPTERS,
    )
    assert sorted(checked.accepted) == ["a-ok", "b-mig"]
    assert checked.refused == {
        "c-sick": "device 3 is unhealthy (uncorrectable ECC)",
        "d-stale": checked.refused["d-stale"],
        "e-sglang": "engine 'sglang' is not available on this node",
        "f-taken": "device 1 is also assigned to replica a-ok",
        "g-leader": checked.refused["g-leader"],
    }
    assert "the node's devices changed" in checked.refused["d-stale"]
    assert "leader_address" in checked.refused["g-leader"]
    assert [d.label for d in checked.accepted["b-mig"].devices] == ["0/mig1"]


def test_devices_held_by_running_replicas_are_not_given_again() -> None:
    new = assign(model("vllm"), [gpu(0)], replica_id="new")
    checked = check_assignments(
        [new], node="n1", inventory=inventory(), adapters=ADAPTERS, held={0: "running"}
    )
    assert checked.refused == {"new": "device 0 is also assigned to replica running"}


def test_mig_with_two_devices_is_refused_by_pinning() -> None:
    a = assign(
        model("llamacpp", weights=WeightsSource(kind="local", path="/m.gguf"), tp=2),
        [mig_instance(), gpu(0)],
        replica_id="m2",
    )
    checked = check_assignments([a], node="n1", inventory=inventory(), adapters=ADAPTERS)
    assert "MIG instance must be an engine's only device" in checked.refused["m2"]


def test_refusals_name_devices_by_their_labels() -> None:
    # CPU slots read "cpu3", not "3"; MIG instances "0/mig5", not "1005".
    cpu_model = model(
        "llamacpp", weights=WeightsSource(kind="local", path="/m.gguf"), gpu_classes=["cpu"]
    )
    cpu_node = NodeInventory(hostname="n1", devices=[cpu_slot(0), cpu_slot(1)])
    missing = assign(cpu_model, [cpu_slot(3)], replica_id="missing")
    twice = assign(cpu_model, [cpu_slot(0), cpu_slot(0)], replica_id="twice")
    twice.shard.device_uuids = []
    checked = check_assignments([missing, twice], node="n1", inventory=cpu_node, adapters=ADAPTERS)
    assert checked.refused == {
        "missing": "device cpu3 is not on this node",
        "twice": "the shard names a device twice: cpu0, cpu0",
    }
    gone = mig_instance().model_copy(update={"number": 1005, "uuid": "MIG-gone"})
    lost = assign(model("vllm", gpu_classes=["a100-80g-mig-3g.40gb"]), [gone], replica_id="lost")
    checked = check_assignments([lost], node="n1", inventory=inventory(), adapters=ADAPTERS)
    assert checked.refused == {"lost": "device 0/mig5 is not on this node"}


def test_a_device_out_of_placement_is_refused_with_its_reason() -> None:
    # A MIG card with nothing carved (or a mode change pending) is healthy
    # but can take no engine: the agent refuses it even if asked.
    empty = gpu(4, "a100-80g").model_copy(
        update={"placeable": False, "unplaceable_reason": "MIG mode is enabled but no instances"}
    )
    node = NodeInventory(hostname="n1", devices=[gpu(0), empty])
    wanted = assign(model("vllm", gpu_classes=["a100-80g"]), [empty], replica_id="r-empty")
    checked = check_assignments([wanted], node="n1", inventory=node, adapters=ADAPTERS)
    assert checked.accepted == {}
    assert checked.refused == {
        "r-empty": "device 4 cannot take work (MIG mode is enabled but no instances)"
    }
