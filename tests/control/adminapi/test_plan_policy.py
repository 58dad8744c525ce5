"""The admin plan decides with the control plane's Policy, the one its reconciler runs with."""

from __future__ import annotations

from pathlib import Path

import httpx
from tests.control.adminapi.fleetkit import Fleet, served_control_plane

from llmgw.control.scheduler.decisions import Policy
from llmgw.wire import ReplicaState


def test_the_plan_parks_by_the_running_policy(tmp_path: Path) -> None:
    # One node, one failed start: parked only where one failure is the limit
    # (a one-node fleet parks once it fails there that often).
    fleet = Fleet()
    fleet.node("n1")
    fleet.model("m")
    fleet.replica("m", "n1", [0], state=ReplicaState.FAILED)
    with served_control_plane(tmp_path, fleet.state) as served:
        headers = {"Authorization": f"Bearer {served.admin_token}"}
        with httpx.Client(base_url=served.url + "/admin/v1", headers=headers, timeout=30) as c:
            by_default = c.get("/plan").json()["models"]
            served.cp.policy = Policy(failure_limit=1)
            by_policy = c.get("/plan").json()["models"]
    assert [m["status"] for m in by_default] == ["backing off"]
    assert [m["status"] for m in by_policy] == ["parked"]
