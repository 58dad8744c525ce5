"""``llmgw ctl`` against a running control plane (uvicorn on loopback, SQLite store)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from rich.console import Console
from tests.control.adminapi.fleetkit import Fleet, Served, gpu, gpus, mig, served_control_plane
from tests.waiting import eventually_sync
from typer.testing import CliRunner, Result

from llmgw.cli.ctl import app
from llmgw.cli.ctl.catalog import plan_view
from llmgw.cli.ctl.gateways import headline
from llmgw.cli.ctl.status import status_view
from llmgw.control.adminapi.patroni import StoreStatus
from llmgw.control.adminapi.summary import fleet_summary
from llmgw.control.gateway_count import GatewayCount
from llmgw.wire import (
    DownloadProgress,
    GatewayLoadReport,
    ReplicaLoad,
    ReplicaState,
    ReplicaStatus,
    UsageRecord,
)


def ctl_fleet() -> Fleet:
    fleet = Fleet(now=time.time())
    fleet.node("gpu-1", [mig(0, 0), mig(0, 1), gpu(1, "a100-80g"),
                         gpu(2, "a100-80g", healthy=False, reason="pending row remap")],
               weights=("llama",))
    fleet.node("gpu-2", gpus(4), fabrics=("ib-b",))
    fleet.model("llama", gpu_classes=["a100-80g"], max_replicas=2)
    fleet.model("huge", min_replicas=0, gpus=8, tp=8, demand_at=fleet.now - 5,
                unplaceable_reason="needs 8 free h100-80g on one node; gpu-2 has 4")
    fleet.model("broken", parked=True, failures=5, last_error="engine exited (1)")
    fleet.replica("llama", "gpu-1", [1], idle=3600)
    starting = fleet.replica("llama", "gpu-2", [0], state=ReplicaState.STARTING)
    fleet.state.nodes["gpu-2"].statuses[starting.id] = ReplicaStatus(
        replica_id=starting.id, state=ReplicaState.STARTING,
        download=DownloadProgress(bytes_done=8 << 30, bytes_total=16 << 30, eta_s=90),
    )
    return fleet


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    with served_control_plane(tmp_path, ctl_fleet().state) as s:
        yield s


def run(served: Served | None, *args: str, token: str | None = None,
        env: dict[str, str] | None = None, data_dir: Path | None = None) -> Result:
    base = ["--url", served.url, "--token", token or served.admin_token] if served else []
    # None unsets: the suite's own environment must not leak into the command.
    environment: dict[str, str | None] = {
        "COLUMNS": "220", "LLMGW_DATA_DIR": str(data_dir or "/nonexistent-llmgw"),
        "LLMGW_URL": None, "LLMGW_ADMIN_TOKEN": None, **(env or {}),
    }
    return CliRunner().invoke(app, [*base, *args], env=environment)


def ok(result: Result) -> str:
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    return result.stdout


def one_line_error(result: Result) -> str:
    assert result.exit_code == 1, (result.stdout, result.stderr)
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("llmgw ctl: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def test_status_screen(served: Served) -> None:
    out = ok(run(served, "status"))
    assert "3 total" not in out.splitlines()[0]  # nodes line says 2
    assert "2 total: 2 ready" in out
    assert "a100-80g-mig-3g.40gb" in out and "Devices by class" in out
    assert "huge: needs 8 free h100-80g on one node; gpu-2 has 4" in out
    assert "broken: 5 failures: engine exited (1)" in out
    assert "Idle replicas (10 min or more)" in out
    assert any(line.split()[:3] == ["r0001", "llama", "60m"] for line in out.splitlines())
    assert "Store: a single database" in out


def test_status_json_is_the_summary(served: Served) -> None:
    summary = json.loads(ok(run(served, "status", "--json")))
    assert summary["unplaceable"] == ["huge"]
    assert summary["models"] == {"total": 3, "satisfied": 1, "short": 2}


def test_nodes_show_devices_by_class_mig_labels_and_health(served: Served) -> None:
    out = ok(run(served, "nodes"))
    assert "a100-80g-mig-3g.40gb 2/2 free [0/mig0 0/mig1]" in out
    assert "2 unhealthy: pending row remap" in out
    detail = ok(run(served, "nodes", "show", "gpu-1"))
    assert "0/mig1" in detail and "r0001" in detail and "pending row remap" in detail
    listed = json.loads(ok(run(served, "nodes", "--json", "--fabric", "ib-b")))
    assert [n["name"] for n in listed] == ["gpu-2"]


def test_models_and_replicas_with_download_progress(served: Served) -> None:
    out = ok(run(served, "models"))
    assert "llama" in out and "1/1" in out and "parked" in out and "unplaceable" in out
    replicas = ok(run(served, "replicas"))
    assert "weights 50% of 16.0 GiB, 90s left" in replicas
    assert "gpu-2:0" in replicas
    only = json.loads(ok(run(served, "replicas", "--json", "--state", "ready")))
    assert [r["id"] for r in only] == ["r0001"]
    shown = json.loads(ok(run(served, "replicas", "show", "r0002")))
    assert shown["download"]["bytes_total"] == 16 << 30


def test_cordon_uncordon_drain_and_delete(served: Served) -> None:
    assert ok(run(served, "cordon", "gpu-2")).strip() == "node gpu-2 is cordoned"
    assert json.loads(ok(run(served, "status", "--json")))["nodes"]["cordoned"] == 1
    assert ok(run(served, "uncordon", "gpu-2")).strip() == "node gpu-2 is ready"
    assert ok(run(served, "drain", "gpu-2")).strip() == "node gpu-2 is draining"
    assert "gpu-2" in ok(run(served, "nodes", "delete", "gpu-2"))
    assert "does not exist" in one_line_error(run(served, "cordon", "gpu-2"))


def test_apply_dry_run_then_for_real(served: Served, tmp_path: Path) -> None:
    catalog = tmp_path / "models.yaml"
    catalog.write_text(
        "models:\n"
        "  - {name: fresh, engine: sim, gpu_classes: [h100-80g]}\n"
        "  - {name: llama, engine: sim, gpu_classes: [a100-80g], max_replicas: 3}\n"
    )
    dry = ok(run(served, "apply", "-f", str(catalog), "--dry-run"))
    assert "+ fresh" in dry and "~ llama  (max_replicas)" in dry and "would be applied" in dry
    assert "Devices by class" in dry
    assert "fresh" not in ok(run(served, "models"))
    assert "1 added, 1 changed (were applied)" in ok(run(served, "apply", "-f", str(catalog)))
    assert "fresh" in ok(run(served, "models"))


def test_apply_refuses_a_bad_file_in_one_line(served: Served, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [{name: x, engine: sim, gpu_classes: [a100-80g-mig-3g.40gb], "
                   "gpus: 2, tp: 2}]\n")
    result = run(served, "apply", "-f", str(bad))
    assert result.exit_code == 1 and "MIG" in result.stderr
    assert "cannot read" in one_line_error(run(served, "apply", "-f", str(tmp_path / "no")))


def test_plan_and_what_if(served: Served, tmp_path: Path) -> None:
    out = ok(run(served, "plan"))
    assert "llama" in out and "huge" in out
    what_if = tmp_path / "what-if.yaml"
    what_if.write_text("{name: giant, engine: sim, gpus: 16, tp: 16, gpu_classes: [h100-80g]}")
    plan = json.loads(ok(run(served, "plan", "--what-if", str(what_if), "--json")))
    assert plan["what_if"] == ["giant"] and "giant" in plan["unplaceable"]


def test_unpark_and_events(served: Served) -> None:
    assert ok(run(served, "unpark", "broken")).strip() == "model broken unparked"
    out = ok(run(served, "events", "--kind", "unpark"))
    assert "model broken unparked" in out
    data = json.loads(ok(run(served, "events", "--json", "--subject", "broken")))
    assert [e["kind"] for e in data] == ["unpark"]


def test_keys_create_list_revoke(served: Served) -> None:
    created = json.loads(ok(run(served, "keys", "create", "--name", "ci", "--model", "llama",
                                "--rpm", "60", "--json")))
    assert created["secret"].startswith("sk-llmgw-")
    listed = ok(run(served, "keys"))
    assert created["key"]["key_id"] in listed and created["secret"] not in listed
    assert "revoked" in ok(run(served, "keys", "revoke", created["key"]["key_id"]))
    batch = json.loads(ok(run(served, "keys", "create", "--name", "nightly", "--priority",
                              "batch", "--json")))
    assert batch["key"]["priority"] == "batch"
    line = next(row for row in ok(run(served, "keys")).splitlines()
                if row.startswith(batch["key"]["key_id"]))
    assert "batch" in line
    changed = json.loads(ok(run(served, "keys", "set", batch["key"]["key_id"], "--priority",
                                "interactive", "--json")))
    assert changed["priority"] == "interactive"
    cleared = json.loads(ok(run(served, "keys", "set", batch["key"]["key_id"], "--priority",
                                "none", "--json")))
    assert cleared["priority"] is None
    assert "--priority 'urgent'" in one_line_error(
        run(served, "keys", "set", batch["key"]["key_id"], "--priority", "urgent"))
    people = ok(run(served, "keys", "create", "--name", "people"))
    assert "shown only this once" in people and "sk-llmgw-" in people
    assert "does not exist" in one_line_error(run(served, "keys", "revoke", "nope"))


def test_teams_and_keys_in_them(served: Served) -> None:
    made = ok(run(served, "teams", "create", "research", "--model", "llama", "--rpm", "60",
                  "--tokens-per-day", "100000", "--budget", "25"))
    assert "team research" in made and "rpm 60" in made and "$25.00/month" in made
    listed = ok(run(served, "teams"))
    assert "research" in listed and "100,000 tok/day" in listed
    key = json.loads(ok(run(served, "keys", "create", "--name", "r1", "--team", "research",
                            "--budget", "5", "--budget-period", "week", "--json")))["key"]
    assert key["team_id"] and key["budget_usd"] == 5.0 and key["budget_period"] == "week"
    changed = ok(run(served, "teams", "set", "research", "--rpm", "0", "--tpm", "5000"))
    assert "rpm" not in changed and "tpm 5000" in changed
    queued = ok(run(served, "teams", "set", "research", "--priority", "batch", "--weight", "2"))
    assert "batch" in queued and "weight 2" in queued
    assert "live key" in one_line_error(run(served, "teams", "delete", "research"))
    moved = ok(run(served, "keys", "set", key["key_id"], "--team", "none"))
    assert "(team -)" in moved
    assert "deleted" in ok(run(served, "teams", "delete", "research"))


def test_usage(served: Served) -> None:
    minute = int(time.time()) // 60 * 60
    served.call(lambda: served.cp.gateways.record_usage([
        UsageRecord(minute=minute, key_id="k1", model="llama", requests=3, prompt_tokens=30),
    ]))
    out = ok(run(served, "usage"))
    assert "k1" in out and "llama" in out and "30" in out
    data = json.loads(ok(run(served, "usage", "--json", "--model", "nothing")))
    assert data["total"]["requests"] == 0


def test_gateways(served: Served) -> None:
    assert "No gateway is reporting" in ok(run(served, "gateways"))
    served.cp.gateways._gateway_count = GatewayCount(settle_s=0.0)
    for gateway, in_flight in (("gw-b", 2), ("gw-a", 0)):
        served.call(lambda g=gateway, n=in_flight: served.cp.gateways.record_load(
            GatewayLoadReport(gateway_id=g, waiting={"huge": 1},
                              replicas=[ReplicaLoad(replica_id="r-x", in_flight=n)])))
    lines = ok(run(served, "gateways")).splitlines()
    assert lines[0] == "2 gateways route (new prefixes placed by hash)"
    assert lines[1].split() == ["ID", "LAST", "REPORT", "IN", "FLIGHT", "WAITING"]
    assert [line.split()[0] for line in lines[2:]] == ["gw-a", "gw-b"]
    assert lines[3].split()[-4:] == ["2", "1", "(huge", "1)"]
    data = json.loads(ok(run(served, "gateways", "--json")))
    assert data["count"] == 2 and [g["in_flight"] for g in data["gateways"]] == [0, 2]


def test_gateways_headline() -> None:
    def line(count: int, placement: str, leader: bool = True) -> str:
        return headline({"count": count, "placement": placement, "leader": leader})

    assert line(1, "by load") == "1 gateway routes (new prefixes placed by load)"
    assert line(3, "by hash") == "3 gateways route (new prefixes placed by hash)"
    assert line(0, "settling") == "count settling (new prefixes placed by hash)"
    assert "standby" in line(0, "settling", leader=False)


def test_join_token(served: Served) -> None:
    token = ok(run(served, "join-token", "--rotate")).strip()
    assert token.startswith("llmgw-join-")
    assert "--rotate" in one_line_error(run(served, "join-token"))


def test_unreachable_control_plane_is_one_line() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    result = run(None, "--url", f"http://127.0.0.1:{port}", "--token", "x", "status")
    assert f"cannot reach the control plane at http://127.0.0.1:{port}" in one_line_error(result)


def test_wrong_token_is_one_line(served: Served) -> None:
    for token in ("llmgw-admin-wrong", served.api_key):
        line = one_line_error(run(served, "nodes", token=token))
        assert "refused the admin token" in line


def test_no_token_anywhere_is_one_line(tmp_path: Path) -> None:
    line = one_line_error(run(None, "status", data_dir=tmp_path))
    assert "no admin token" in line


def test_address_and_token_from_up_json_and_env(served: Served, tmp_path: Path) -> None:
    (tmp_path / "up.json").write_text(json.dumps({
        "api_url": served.url + "/v1", "admin_url": served.url,
        "console_url": served.url + "/console", "admin_token": served.admin_token,
    }))
    assert json.loads(ok(run(None, "status", "--json", data_dir=tmp_path)))["nodes"]["total"] == 2
    env = {"LLMGW_URL": served.url + "/admin/v1", "LLMGW_ADMIN_TOKEN": served.admin_token}
    assert "gpu-1" in ok(run(None, "nodes", env=env))
    # A flag wins over up.json: a wrong one is refused even though up.json is right.
    result = run(None, "--token", "llmgw-admin-wrong", "status", data_dir=tmp_path)
    assert "refused" in one_line_error(result)
    (tmp_path / "up.json").write_text("{not json")
    assert "up.json is not valid JSON" in one_line_error(run(None, "status", data_dir=tmp_path))


def test_status_watch_refreshes_until_interrupted(served: Served) -> None:
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw.cli.ctl", "--url", served.url, "--token",
         served.admin_token, "status", "--watch", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    )
    port = int(served.url.rsplit(":", 1)[1])
    try:
        # Interrupt only once it is watching: a fixed sleep raced ctl's own start
        # (3.7 s to import on a loaded machine) and the SIGINT hit the import.
        def watching() -> bool:
            assert proc.poll() is None
            connections = psutil.Process(proc.pid).net_connections("tcp")
            return any(c.raddr and c.raddr.port == port for c in connections)

        eventually_sync(watching, 60, what="ctl status --watch connected", every_s=0.1)
        time.sleep(0.6)  # a few refreshes at 0.2 s
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "Devices by class" in out and "Traceback" not in err


def test_status_counts_replicas_on_a_node_that_stopped_reporting() -> None:
    fleet = Fleet()
    fleet.node("up")
    fleet.node("silent", seen_ago=600)
    fleet.model("m", max_replicas=2)
    fleet.replica("m", "up", [0])
    fleet.replica("m", "silent", [0])
    summary = fleet_summary(fleet.state, fleet.now, StoreStatus(members=[]))
    assert summary.replicas.unreachable == 1 and summary.replicas.ready == 1
    console = Console(record=True, width=200)
    console.print(status_view({"summary": summary.model_dump(mode="json"), "models": []}))
    replicas = next(line for line in console.export_text().splitlines()
                    if line.startswith("Replicas"))
    assert replicas.split(None, 1)[1] == (
        "1 ready, 0 starting, 0 draining, 0 failed, 1 unreachable")


def rendered_plan(models: list[dict[str, Any]]) -> str:
    console = Console(record=True, width=200)
    console.print(plan_view({"models": models, "devices": []}))
    return console.export_text()


def test_plan_lists_the_nodes_a_model_avoids_after_failures() -> None:
    line = "n3: model m failed there 2 times, last 40 s ago; avoided for 80 s"
    model = {"name": "m", "status": "placing", "current": 0, "desired": 1, "reason": None}
    assert f"Nodes avoided after failures:\n  {line}\n" in rendered_plan(
        [dict(model, avoided=[line])]
    )
    assert "avoided" not in rendered_plan([dict(model, avoided=[])])


def test_models_lists_adapters_under_their_base_and_delete_keeps_a_base_with_adapters(
    served: Served, tmp_path: Path
) -> None:
    catalog = tmp_path / "loras.yaml"
    catalog.write_text(
        "models:\n"
        "  - {name: zbase, engine: sim, gpu_classes: [a100-80g], min_replicas: 0,"
        " sim: {max_loras: 2}}\n"
        "  - {name: a-sql, engine: sim, base: zbase, min_replicas: 0, adapter: {rank: 8}}\n"
    )
    ok(run(served, "apply", "-f", str(catalog)))
    lines = ok(run(served, "models")).splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:1] == ["zbase"])
    # By name a-sql would be listed first; it follows its base, marked as its adapter.
    assert lines[at + 1].split()[:4] == ["└", "a-sql", "lora", "r8"]
    assert "on 0" in lines[at + 1] and "idle" in lines[at + 1]
    refused = one_line_error(run(served, "models", "delete", "zbase"))
    assert "base of adapter(s) a-sql: delete them first" in refused
    ok(run(served, "models", "delete", "a-sql"))
    ok(run(served, "models", "delete", "zbase"))


def test_plan_says_per_base_which_adapters_are_loaded_where_and_which_are_not() -> None:
    adapters = [{"base": "llama", "adapters": 3, "slots_per_replica": 2,
                 "loaded": {"r0001": ["a-sql", "a-chat"], "r0002": []},
                 "not_loaded": {"a-law": "every adapter slot of 'llama' holds an adapter used"
                                         " more recently (1 replica(s), 2 slot(s) each)"}}]
    console = Console(width=200, record=True)
    console.print(plan_view({"models": [], "devices": [], "adapters": adapters}))
    out = console.export_text()
    assert "Adapters of llama: 2 loaded of 3 on 1 replica(s), 2 slot(s) each" in out
    assert "r0001: a-sql, a-chat" in out and "r0002" not in out
    assert "not loaded: a-law: every adapter slot of 'llama' holds" in out
