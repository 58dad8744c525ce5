"""Agent reports over real HTTP, answered by one endpoint before FastAPI's routing
(control/reportroute.py).

The answer is the report's answer model dumped, and each failure keeps the
application's one error shape, with its status, through the application's
own exception handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from tests.control.planekit import (
    Plane,
    bearer,
    inventory,
    opened_plane,
    register,
    send_report,
)

from llmgw.cli.combined import PathDispatcher
from llmgw.control import telemetry
from llmgw.control.app import create_app
from llmgw.control.reportroute import REPORT_PATH, ReportEndpoint, ReportRoute
from llmgw.control.reports import assignments_for
from llmgw.control.state import ReplicaRecord
from llmgw.http.server import server_config
from llmgw.serving import start_server
from llmgw.sim import fleetgen
from llmgw.sim.telemetry import TelemetryWalk
from llmgw.wire import (
    AgentReport,
    AgentReportAnswer,
    ModelSpec,
    NodeInventory,
    ShardAssignment,
)


def test_the_app_answers_reports_through_one_endpoint(plane: Plane) -> None:
    app = create_app(plane.cp)
    (middleware,) = [m for m in app.user_middleware if getattr(m, "cls", None) is ReportRoute]
    endpoint = middleware.kwargs["endpoint"]
    assert isinstance(endpoint, ReportEndpoint)
    # The route table and the lean servers' endpoints reach the very same one.
    (route,) = [r for r in app.routes if getattr(r, "path", None) == REPORT_PATH]
    assert getattr(route, "app", None) is endpoint
    stacked = app.endpoints[("POST", REPORT_PATH)]  # CountReports -> BodyLimit -> endpoint
    assert stacked.app.app is endpoint


async def test_a_report_is_answered_as_the_control_plane_answers_it(plane: Plane) -> None:
    cp, _, url = plane
    await cp.catalog.put([ModelSpec(name="m", engine="sim", gpu_classes=["cpu"])])
    async with httpx.AsyncClient() as client:
        token = await register(client, url, plane.join, "n1")
        first = await send_report(
            client, url, token, AgentReport(node="n1", inventory=inventory("n1"))
        )
        assert first.status_code == 200, first.text
        # A replica on the node, so the answer carries an assignment.
        cp.state.replicas["r1"] = ReplicaRecord(
            id="r1", model="m", created_at=0.0, shards=[ShardAssignment(node="n1")]
        )
        answer = await send_report(
            client, url, token, AgentReport(node="n1", inventory=inventory("n1"))
        )
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/json"
    assert int(answer.headers["content-length"]) == len(answer.content)
    body = AgentReportAnswer.model_validate_json(answer.content)
    assert body.node == "n1" and body.report_interval_s > 0
    # The answer's bytes (assignments spliced in as kept JSON) are the model's dump,
    # with the node's assignments.
    assert body.model_dump_json().encode() == answer.content
    assert body.assignments == assignments_for(cp.state, "n1", cp.engine_keys.key)
    assert body.assignments


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


async def test_serves_lean_server_answers_reports_without_the_framework(tmp_path: Path) -> None:
    # As `serve` listens: its PathDispatcher on llmgw's own protocol, which
    # runs the control plane's report endpoint (the route in CountReports and
    # BodyLimit) without FastAPI's stack.
    async with opened_plane(tmp_path) as (cp, creds), contextlib.AsyncExitStack() as stack:
        app = create_app(cp)
        dispatcher = PathDispatcher(app, _Nothing())
        endpoint = dispatcher.endpoints[("POST", REPORT_PATH)]
        assert endpoint is app.endpoints[("POST", REPORT_PATH)]
        url = await stack.enter_async_context(_served_as_serve_serves(dispatcher))
        plane = Plane(cp, creds, url)
        client = await stack.enter_async_context(httpx.AsyncClient())
        token = await register(client, url, plane.join, "n1")
        await register(client, url, plane.join, "n2")
        walk = TelemetryWalk(inventory("n1"), seed=1)
        reports = [AgentReport(node="n1", inventory=walk.inventory()) for _ in range(2)]
        for report in reports:
            answer = await send_report(client, url, token, report)
            assert answer.status_code == 200, answer.text
            assert AgentReportAnswer.model_validate_json(answer.content).node == "n1"
        route = endpoint.app.app  # CountReports -> BodyLimit -> ReportEndpoint
        assert isinstance(route, ReportEndpoint) and "n1" in route._last
        other = AgentReport(node="n2", inventory=inventory("n2"))
        assert (await send_report(client, url, token, other)).status_code == 403
        assert (await send_report(client, url, token, b"{nope")).status_code == 422
        stranger = await send_report(client, url, "llmgw-node-nonsense", reports[0])
        assert stranger.status_code == 401
        # Over the report's body limit: refused before the body is read.
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        writer.write(
            f"POST {REPORT_PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}"
            f"\r\nContent-Length: {9 * 1024 * 1024}\r\n\r\n{{".encode()
        )
        huge = await asyncio.wait_for(reader.read(65536), 5.0)
        writer.close()
        assert huge.startswith(b"HTTP/1.1 413 ") and b"request_too_large" in huge
        assert cp.metrics.reports == {
            "accepted": 2,
            "wrong_node": 1,
            "invalid": 2,
            "unauthorized": 1,
        }
        # A standby's answer, in the same shape as through the framework.
        cp.is_leader = False
        standby = await send_report(client, url, token, reports[0])
        assert standby.status_code == 503 and standby.json()["error"]["code"] == "standby"


@contextlib.asynccontextmanager
async def _served_as_serve_serves(app: Any) -> AsyncIterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(server_config(app, log_level="warning", loop="none"))
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    task = await start_server(server, [sock])
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = server.force_exit = True
        await task
        sock.close()


class _Nothing:
    """A gateway with no endpoints (the dispatcher sends it nothing here)."""

    endpoints: dict[tuple[str, str], Any] = {}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError(f"the gateway got {scope['path']}")
