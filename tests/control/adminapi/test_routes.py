"""The admin API over real HTTP: a uvicorn on loopback, a SQLite store, httpx."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.control.adminapi.fleetkit import Fleet, Served, gpu, gpus, served_control_plane

from llmgw.control.adminapi.patroni import StoreStatus
from llmgw.control.adminapi.summary import fleet_summary
from llmgw.wire import AgentRegistration, ReplicaState, ReplicaStatus, UsageRecord

MIG_TP2 = {"name": "bad", "engine": "sim", "gpu_classes": ["a100-80g-mig-3g.40gb"],
           "gpus": 2, "tp": 2}


def live_fleet() -> Fleet:
    fleet = Fleet(now=time.time())
    fleet.node("n1", weights=("llama",))
    fleet.node("n2", [gpu(0, healthy=False), *gpus(4)[1:]], fabrics=("ib-b",))
    fleet.model("llama", max_replicas=3)
    fleet.model("parked", parked=True, failures=5, last_error="engine exited (1)")
    fleet.replica("llama", "n1", [0, 1], idle=3600)
    fleet.replica("llama", "n2", [1], state=ReplicaState.STARTING)
    return fleet


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    with served_control_plane(tmp_path, live_fleet().state) as s:
        yield s


def client(served: Served, token: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=served.url + "/admin/v1", headers=headers, timeout=30)


def admin(served: Served) -> httpx.Client:
    return client(served, served.admin_token)


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code"}
    return dict(body["error"])


# -- the auth matrix -----------------------------------------------------------------------

BODIES: dict[tuple[str, str], Any] = {
    ("put", "/models/{name}"): {"name": "llama", "engine": "sim", "max_replicas": 3,
                                "gpu_classes": ["h100-80g"]},
    ("post", "/apply"): {"models": [{"name": "new", "engine": "sim"}], "dry_run": True},
    ("post", "/plan"): {"models": [{"name": "new", "engine": "sim"}]},
    ("post", "/keys"): {"name": "k"},
}
PARAMS = {"name": "n1", "replica_id": "r0001", "key_id": "nope", "token_id": "nope", "team": "nope",
          "address": "10.0.0.99"}


def admin_routes(served: Served) -> list[tuple[str, str]]:
    with httpx.Client(base_url=served.url, timeout=30) as c:
        schema = c.get("/admin/v1/openapi.json").json()
    routes = [
        (method, path.removeprefix("/admin/v1"))
        for path, ops in schema["paths"].items() if path.startswith("/admin/v1/")
        for method in ops if method in {"get", "post", "put", "delete"}
    ]
    assert len(routes) >= 24, routes  # every resource of the issue is there
    return routes


def test_every_admin_route_takes_the_admin_token_and_nothing_else(served: Served) -> None:
    wrong = {
        "no credential": None,
        "gateway API key": served.api_key,
        "gateway token": served.gateway_token,
        "node token": served.node_token("node-x"),
        "garbage": "llmgw-admin-not-the-token",
    }
    routes = admin_routes(served)
    clients = {label: client(served, token) for label, token in wrong.items()}
    for method, template in routes:
        path = template.format(**PARAMS)
        body = BODIES.get((method, template))
        for label, c in clients.items():
            response = c.request(method.upper(), path, json=body)
            assert response.status_code == 401, (method, path, label, response.text)
            assert error_of(response)["type"] == "authentication_error"
            assert response.headers["www-authenticate"] == "Bearer"
    for c in clients.values():
        c.close()
    # The admin token works everywhere (mutations last, so each finds its target;
    # rotating the admin token itself last of all, since it ends this token).
    with admin(served) as c:
        for method, template in sorted(
            routes, key=lambda r: (r[1] == "/admin-token/rotate", r[0] == "delete")
        ):
            response = c.request(method.upper(), template.format(**PARAMS),
                                 json=BODIES.get((method, template)))
            assert response.status_code not in (401, 403), (method, template, response.text)
            assert response.status_code < 500, (method, template, response.text)


# -- summary -------------------------------------------------------------------------------


def test_summary_over_http_is_the_fleet_summary(served: Served) -> None:
    with admin(served) as c:
        body = c.get("/summary").json()
    direct = fleet_summary(served.cp.state, time.time(), StoreStatus(members=[]))
    assert body == direct.model_dump(mode="json")
    assert body["nodes"]["total"] == 2
    assert {g["class"]: g["free"] for g in body["gpus"]} == {"h100-80g": 8}
    assert body["parked"] == [{"model": "parked", "failures": 5, "reason": "engine exited (1)"}]
    assert [i["gpus"] for i in body["idle_replicas"]] == [2]


def test_summary_names_an_unreachable_patroni(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_PATRONI_URL", "http://127.0.0.1:9")
    with served_control_plane(tmp_path) as served, admin(served) as c:
        body = c.get("/summary").json()
    assert body["store"] == []
    assert "http://127.0.0.1:9/cluster" in body["store_error"]


# -- nodes ---------------------------------------------------------------------------------


def test_nodes_listing_and_one_node(served: Served) -> None:
    with admin(served) as c:
        nodes = c.get("/nodes").json()
        assert [n["name"] for n in nodes] == ["n1", "n2"]
        n2 = c.get("/nodes/n2").json()
        assert [c.get("/nodes", params={"fabric": "ib-b"}).json()[0]["name"]] == ["n2"]
        assert c.get("/nodes", params={"state": "cordoned"}).json() == []
        missing = c.get("/nodes/none")
    assert n2["classes"] == [{"gpu_class": "h100-80g", "total": 4, "used": 1, "free": 2,
                              "unhealthy": 1}]
    assert n2["devices"][0]["status"] == "unhealthy"
    assert n2["devices"][0]["unhealthy_reasons"] == ["uncorrectable ECC errors: 1"]
    assert n2["devices"][1]["used_by"] == "r0002"
    assert missing.status_code == 404 and error_of(missing)["code"] == "not_found"


def test_nodes_paged_and_filtered_by_name(tmp_path: Path) -> None:
    fleet = Fleet(now=time.time())
    for i in range(25):
        fleet.node(f"gpu-{i:02d}", fabrics=("ib-a",) if i % 2 else ("ib-b",))
    fleet.node("cpu-box", [])
    with served_control_plane(tmp_path, fleet.state) as s, admin(s) as c:
        page = c.get("/nodes", params={"name": "gpu-", "offset": 10, "limit": 5})
        assert page.headers["X-Total-Count"] == "25"
        assert [n["name"] for n in page.json()] == [f"gpu-{i:02d}" for i in range(10, 15)]
        assert len(page.json()[0]["devices"]) == 8
        last = c.get("/nodes", params={"name": "gpu-", "fabric": "ib-a", "offset": 10,
                                       "limit": 5})
        assert last.headers["X-Total-Count"] == "12"
        assert [n["name"] for n in last.json()] == ["gpu-21", "gpu-23"]
        everything = c.get("/nodes")
        assert everything.headers["X-Total-Count"] == "26" and len(everything.json()) == 26
        assert page.headers["X-Fleet-Count"] == "26"
        assert c.get("/nodes", params={"name": "GPU-0"}).headers["X-Total-Count"] == "10"
        assert c.get("/nodes", params={"limit": 0}).status_code == 422


def test_cordon_uncordon_drain_delete(served: Served) -> None:
    with admin(served) as c:
        assert c.post("/nodes/n1/cordon").json()["state"] == "cordoned"
        assert c.get("/summary").json()["nodes"]["cordoned"] == 1
        assert c.post("/nodes/n1/uncordon").json()["state"] == "ready"
        assert c.post("/nodes/n1/drain").json()["state"] == "draining"
        assert c.delete("/nodes/n2").status_code == 200
        assert c.get("/nodes/n2").status_code == 404
        assert c.post("/nodes/n2/cordon").status_code == 404
        kinds = [e["kind"] for e in c.get("/events").json()]
    assert "drain" in kinds and "node" in kinds


# -- replicas ------------------------------------------------------------------------------


def test_replicas_with_filters_and_drain(served: Served) -> None:
    served.cp.state.nodes["n2"].statuses["r0002"] = ReplicaStatus(
        replica_id="r0002", state=ReplicaState.STARTING, log_tail=["loading"],
        download={"bytes_done": 5, "bytes_total": 10},
    )
    with admin(served) as c:
        assert [r["id"] for r in c.get("/replicas").json()] == ["r0001", "r0002"]
        assert [r["id"] for r in c.get("/replicas", params={"node": "n2"}).json()] == ["r0002"]
        assert c.get("/replicas", params={"state": "ready"}).json()[0]["id"] == "r0001"
        assert c.get("/replicas", params={"model": "parked"}).json() == []
        starting = c.get("/replicas/r0002").json()
        ready = c.get("/replicas/r0001").json()
        drained = c.post("/replicas/r0001/drain").json()
        bad_state = c.get("/replicas", params={"state": "sleeping"})
    assert starting["download"]["bytes_total"] == 10 and starting["log_tail"] == ["loading"]
    assert ready["shards"] == [{"node": "n1", "rank": 0, "devices": ["0", "1"],
                                "device_numbers": [0, 1]}]
    assert ready["url"].startswith("http://127.0.0.1:") and ready["gpus"] == 2
    assert drained["state"] == "draining" and drained["draining"] is True
    assert bad_state.status_code == 422 and "state" in error_of(bad_state)["message"]


# -- models --------------------------------------------------------------------------------


def test_models_put_get_delete_unpark(served: Served) -> None:
    with admin(served) as c:
        listed = {m["name"]: m for m in c.get("/models").json()}
        assert listed["llama"]["ready"] == 1 and listed["llama"]["starting"] == 1
        assert listed["parked"]["reason"] == "engine exited (1)"
        put = c.put("/models/qwen", json={"name": "qwen", "engine": "sim"})
        assert put.status_code == 200 and put.json()["desired"] == 1
        assert c.get("/models/qwen").json()["spec"]["engine"] == "sim"
        unparked = c.post("/models/parked/unpark").json()
        assert unparked["parked"] is False and unparked["failures"] == 0
        assert c.delete("/models/qwen").status_code == 200
        assert c.get("/models/qwen").status_code == 404
        assert c.delete("/models/qwen").status_code == 404


def test_model_names_with_slashes_work(served: Served) -> None:
    with admin(served) as c:
        put = c.put("/models/meta-llama/Llama-3-8B",
                    json={"name": "meta-llama/Llama-3-8B", "engine": "sim"})
        assert put.status_code == 200, put.text
        assert c.get("/models/meta-llama/Llama-3-8B").json()["name"] == "meta-llama/Llama-3-8B"


def test_invalid_entries_get_422_with_the_rule(served: Served) -> None:
    with admin(served) as c:
        mig = c.put("/models/bad", json=MIG_TP2)
        mismatch = c.put("/models/other", json={"name": "x", "engine": "sim"})
        typo = c.put("/models/x", json={"name": "x", "engine": "sim", "gpuz": 1})
        bad_yaml = c.post("/apply", json={"document": "models: [", "source": "m.yaml"})
        both = c.post("/apply", json={"document": "[]", "models": []})
    assert mig.status_code == 422 and "MIG" in error_of(mig)["message"]
    assert mismatch.status_code == 422 and "'x'" in error_of(mismatch)["message"]
    assert typo.status_code == 422 and "gpuz" in error_of(typo)["message"]
    assert bad_yaml.status_code == 422 and "m.yaml" in error_of(bad_yaml)["message"]
    assert both.status_code == 422


def test_apply_dry_run_shows_diff_and_plan_and_changes_nothing(served: Served) -> None:
    document = (
        "models:\n"
        "  - {name: llama, engine: sim, max_replicas: 2, gpu_classes: [h100-80g]}\n"
        "  - {name: fresh, engine: sim, gpu_classes: [h100-80g]}\n"
    )
    with admin(served) as c:
        dry = c.post("/apply", json={"document": document, "dry_run": True}).json()
        assert c.get("/models/fresh").status_code == 404
        real = c.post("/apply", json={"document": document}).json()
        again = c.post("/apply", json={"document": document, "dry_run": True}).json()
        fresh = c.get("/models/fresh")
    assert (dry["added"], dry["changed"], dry["dry_run"]) == (["fresh"], ["llama"], True)
    assert dry["changed_fields"] == {"llama": ["max_replicas"]}
    assert "fresh" in [m["name"] for m in dry["plan"]["models"]]
    assert real["plan"] is None and real["added"] == ["fresh"]
    assert again["unchanged"] == ["fresh", "llama"]
    assert fresh.status_code == 200


def test_plan_and_what_if(served: Served) -> None:
    with admin(served) as c:
        plan = c.get("/plan").json()
        what_if = c.post("/plan", json={"models": [{"name": "huge", "engine": "sim",
                                                    "gpus": 16, "tp": 16,
                                                    "gpu_classes": ["h100-80g"]}]}).json()
    assert {m["name"] for m in plan["models"]} == {"llama", "parked"}
    assert what_if["what_if"] == ["huge"] and "huge" in what_if["unplaceable"]


# -- events, keys, usage, join token -----------------------------------------------------


def test_events_filters(served: Served) -> None:
    with admin(served) as c:
        for node in ("n1", "n2"):
            c.post(f"/nodes/{node}/cordon")
        events = c.get("/events").json()
        ids = [e["id"] for e in events]
        assert ids == sorted(ids)  # oldest first
        assert [e["subject"] for e in c.get("/events", params={"subject": "n2"}).json()] == ["n2"]
        assert c.get("/events", params={"since": ids[-1]}).json() == []
        assert len(c.get("/events", params={"limit": 1}).json()) == 1
        assert c.get("/events", params={"kind": "nothing-like-it"}).json() == []
        assert c.get("/events", params={"limit": 0}).status_code == 422


def test_keys_secret_shown_once(served: Served) -> None:
    with admin(served) as c:
        created = c.post("/keys", json={"name": "ci", "models": ["llama"], "rpm": 60})
        assert created.status_code == 201
        body = created.json()
        assert body["secret"].startswith("sk-llmgw-")
        listed = c.get("/keys").json()
        assert body["secret"] not in created.text.replace(body["secret"], "", 1)
        revoked = c.delete(f"/keys/{body['key']['key_id']}").json()
        missing = c.delete("/keys/nope")
        bad = c.post("/keys", json={"rpm": 0})
    assert all(set(k) == {"key_id", "name", "models", "expires_at", "rpm", "tpm", "revoked",
                          "team_id", "tokens_per_day", "tokens_per_month", "budget_usd",
                          "budget_period", "priority"}
               for k in listed)
    assert body["secret"] not in str(listed)
    assert revoked["revoked"] is True
    assert missing.status_code == 404 and bad.status_code == 422


def test_usage_per_key_and_model(served: Served) -> None:
    minute = int(time.time()) // 60 * 60
    records = [
        UsageRecord(minute=minute - 60, key_id="k1", model="llama", requests=2,
                    prompt_tokens=10, completion_tokens=5),
        UsageRecord(minute=minute, key_id="k1", model="llama", requests=1, prompt_tokens=3),
        UsageRecord(minute=minute, key_id="k2", model="qwen", requests=4, errors=1),
        UsageRecord(minute=minute - 7200, key_id="k1", model="llama", requests=100),
    ]
    served.call(lambda: served.cp.gateways.record_usage(records))
    with admin(served) as c:
        hour = c.get("/usage").json()
        k1 = c.get("/usage", params={"key_id": "k1", "since": minute - 86400}).json()
        qwen = c.get("/usage", params={"model": "qwen"}).json()
    assert hour["total"]["requests"] == 7 and len(hour["rows"]) == 3
    assert hour["by_key_model"][0] == {"key_id": "k2", "model": "qwen", "requests": 4,
                                       "prompt_tokens": 0, "completion_tokens": 0,
                                       "cached_tokens": 0, "errors": 1, "spend_usd": 0.0}
    assert k1["total"]["requests"] == 103
    assert qwen["total"]["requests"] == 4


def test_join_token_rotation(served: Served) -> None:
    with admin(served) as c:
        token = c.post("/join-token/rotate").json()["join_token"]
    assert token.startswith("llmgw-join-")
    answer = served.call(lambda: served.cp.nodes.register(AgentRegistration(node="new",
                                                                      join_token=token)))
    assert answer.node == "new"
    with pytest.raises(Exception, match=r"was revoked|invalid join token"):
        served.call(lambda: served.cp.nodes.register(
            AgentRegistration(node="old", join_token=served.join_token)))
