"""Agent reports over real HTTP, answered before FastAPI's routing (control/reportroute.py).

The fast path must answer exactly as the framework's route did: the same
body for a report, and each failure in the application's one error shape,
with its status, through the application's own exception handlers.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from tests.control.planekit import Plane, bearer, inventory, register, send_report

from llmgw.control import telemetry
from llmgw.control.app import create_app
from llmgw.control.reportroute import ReportRoute
from llmgw.sim import fleetgen
from llmgw.sim.telemetry import TelemetryWalk
from llmgw.wire import AgentReport, AgentReportAnswer, ModelSpec, NodeInventory


def test_the_app_answers_reports_through_the_fast_path(plane: Plane) -> None:
    app = create_app(plane.cp)
    assert any(getattr(m, "cls", None) is ReportRoute for m in app.user_middleware)


async def test_a_report_is_answered_as_the_control_plane_answers_it(plane: Plane) -> None:
    cp, _, url = plane
    await cp.catalog.put([ModelSpec(name="m", engine="sim", gpu_classes=["cpu"])])
    async with httpx.AsyncClient() as client:
        token = await register(client, url, plane.join, "n1")
        answer = await send_report(
            client, url, token, AgentReport(node="n1", inventory=inventory("n1"))
        )
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/json"
    assert int(answer.headers["content-length"]) == len(answer.content)
    body = AgentReportAnswer.model_validate_json(answer.content)
    assert body.node == "n1" and body.report_interval_s > 0


async def test_each_refusal_keeps_its_status_and_shape(plane: Plane) -> None:
    url = plane.url
    async with httpx.AsyncClient() as client:
        token = await register(client, url, plane.join, "n1")
        await register(client, url, plane.join, "n2")
        good = AgentReport(node="n1", inventory=inventory("n1")).model_dump_json()
        other = AgentReport(node="n2", inventory=inventory("n2")).model_dump_json()
        own = bearer(token)
        cases = [
            ({}, good, 401, "authentication_error"),
            ({"Authorization": "Bearer llmgw-node-nonsense"}, good, 401, "authentication_error"),
            (own, other, 403, "permission_error"),
            (own, "{not json", 422, "invalid_request_error"),
            (own, '{"node": "n1"}', 422, "invalid_request_error"),
        ]
        for headers, content, status, kind in cases:
            answer = await client.post(f"{url}/agent/v1/report", content=content, headers=headers)
            assert answer.status_code == status, (status, answer.text)
            error = answer.json()["error"]
            assert error["type"] == kind and error["message"], answer.text
        bad_json = await client.post(f"{url}/agent/v1/report", content="{not json", headers=own)
        assert "not valid JSON" in bad_json.json()["error"]["message"]
        # Other methods still meet the framework: 405 in the same shape.
        wrong = await client.get(f"{url}/agent/v1/report")
        assert wrong.status_code == 405
        assert wrong.json()["error"]["type"] == "invalid_request_error"


async def test_a_standby_sends_reports_to_the_leader(plane: Plane) -> None:
    cp, _, url = plane
    async with httpx.AsyncClient() as client:
        token = await register(client, url, plane.join, "n1")
        cp.is_leader = False
        answer = await send_report(
            client, url, token, AgentReport(node="n1", inventory=inventory("n1"))
        )
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "standby"
    assert "retry-after" in answer.headers


async def test_a_repeated_report_is_applied_again_and_a_changed_one_read_afresh(
    plane: Plane,
) -> None:
    cp, _, url = plane
    async with httpx.AsyncClient() as client:
        token = await register(client, url, plane.join, "n1")
        token2 = await register(client, url, plane.join, "n2")
        same = AgentReport(node="n1", inventory=inventory("n1")).model_dump_json()
        first = await client.post(f"{url}/agent/v1/report", content=same, headers=bearer(token))
        seen = cp.state.nodes["n1"].last_seen
        assert seen is not None
        # The same bytes (validated once, kept): applied again, answered the same.
        again = await client.post(f"{url}/agent/v1/report", content=same, headers=bearer(token))
        assert again.status_code == first.status_code == 200
        assert again.content == first.content
        assert cp.state.nodes["n1"].last_seen > seen
        # n1's kept bytes speak for n1 only.
        stolen = await client.post(f"{url}/agent/v1/report", content=same, headers=bearer(token2))
        assert stolen.status_code == 403
        # Other bytes are validated: a malformed one changes nothing ...
        bad = await client.post(
            f"{url}/agent/v1/report",
            content=same.replace('"hostname"', '"hostnames"'),
            headers=bearer(token),
        )
        assert bad.status_code == 422
        assert cp.state.nodes["n1"].address == "127.0.0.1"
        # ... and a changed one is applied.
        moved = AgentReport(node="n1", address="10.0.0.9", inventory=inventory("n1"))
        answer = await send_report(client, url, token, moved)
        assert answer.status_code == 200
        assert cp.state.nodes["n1"].address == "10.0.0.9"


async def test_a_report_that_changes_only_telemetry_takes_the_readings_alone(
    plane: Plane,
) -> None:
    cp, _, url = plane
    node = fleetgen.gpu_node("n1", gpus=2)
    assert node.inventory is not None
    walk = TelemetryWalk(node.inventory, seed=3)

    def body(inventory: NodeInventory, **fields: Any) -> bytes:
        return AgentReport(node="n1", inventory=inventory, **fields).model_dump_json().encode()

    async with httpx.AsyncClient() as client:
        token = await register(client, url, plane.join, "n1")
        token2 = await register(client, url, plane.join, "n2")
        first = await send_report(client, url, token, body(walk.inventory()))
        assert first.status_code == 200, first.text
        kept = cp.state.nodes["n1"].inventory
        later = walk.inventory()
        answer = await send_report(client, url, token, body(later))
        assert answer.status_code == 200 and answer.content == first.content
        record = cp.state.nodes["n1"]
        # The inventory stays the same object (the scheduler's and the views'
        # digests of it hold); the readings are the new report's.
        assert record.inventory is kept
        readings = telemetry.current(record.inventory, record.readings)
        assert readings is not None
        assert readings.values == telemetry.readings_of(later)
        assert cp.metrics.report_reads == {"validated": 1, "telemetry": 1}
        # The node's view shows them.
        view = await client.get(f"{url}/admin/v1/nodes/n1", headers=plane.admin)
        shown = [
            (d["memory_used_mib"], d["utilization_pct"], d["temperature_c"], d["power_w"])
            for d in view.json()["devices"]
        ]
        assert shown == [readings.of(i) for i in range(len(later.devices))]
        # The same bytes again keep those readings.
        again = await send_report(client, url, token, body(later))
        assert again.status_code == 200
        assert telemetry.current(record.inventory, record.readings) == readings
        # Bad readings are refused whole (full validation's message) and change nothing.
        seen = record.last_seen
        document = json.loads(body(walk.inventory()))
        document["inventory"]["devices"][0]["temperature_c"] = "hot"
        bad = await send_report(client, url, token, json.dumps(document).encode())
        assert bad.status_code == 422
        assert "temperature_c" in bad.json()["error"]["message"]
        document["inventory"]["devices"][0]["temperature_c"] = None
        document["inventory"]["devices"][0]["memory_used_mib"] = None
        bad = await send_report(client, url, token, json.dumps(document).encode())
        assert bad.status_code == 422
        assert record.last_seen == seen and record.inventory is kept
        assert telemetry.current(record.inventory, record.readings) == readings
        # n1's shape speaks for n1 only.
        stolen = await send_report(client, url, token2, body(walk.inventory()))
        assert stolen.status_code == 403
        # A device that changed is read whole and taken in (and its GPU rows written).
        sick = walk.inventory()
        sick.devices[1].healthy = False
        sick.devices[1].unhealthy_reasons = ["ECC"]
        answer = await send_report(client, url, token, body(sick))
        assert answer.status_code == 200
        assert record.inventory is not kept and record.inventory == sick
        assert record.readings is None
        rows = await cp.store.list_gpus("n1")
        assert [r["healthy"] for r in rows] == [True, False]
        assert cp.metrics.report_reads == {"validated": 2, "telemetry": 1, "same_bytes": 1}
