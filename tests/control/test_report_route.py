"""Agent reports over real HTTP, answered before FastAPI's routing (control/reportroute.py).

The fast path must answer exactly as the framework's route did: the same
body for a report, and each failure in the application's one error shape,
with its status, through the application's own exception handlers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from tests.control.test_agent_api import inventory, register
from tests.servers import serve_asgi

from llmgw.control.app import create_app
from llmgw.control.reportroute import ReportRoute
from llmgw.control.service import ControlPlane, NewCredentials
from llmgw.control.store.repo import Store
from llmgw.wire import AgentReport, AgentReportAnswer, ModelSpec

Plane = tuple[ControlPlane, NewCredentials, str]


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[Plane]:
    store = await Store.open(f"sqlite:///{tmp_path / 'cp.db'}")
    cp = ControlPlane(store)
    await cp.load()
    creds = await cp.ensure_credentials()
    app = create_app(cp)
    assert any(getattr(m, "cls", None) is ReportRoute for m in app.user_middleware)
    async with serve_asgi(app) as url:
        yield cp, creds, url
    await store.close()


async def test_a_report_is_answered_as_the_control_plane_answers_it(plane: Plane) -> None:
    cp, creds, url = plane
    assert creds.join_token
    await cp.put_models([ModelSpec(name="m", engine="sim", gpu_classes=["cpu"])])
    async with httpx.AsyncClient() as client:
        token = await register(client, url, creds.join_token, "n1")
        report = AgentReport(node="n1", inventory=inventory("n1"))
        answer = await client.post(f"{url}/agent/v1/report", content=report.model_dump_json(),
                                   headers={"Authorization": f"Bearer {token}"})
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/json"
    assert int(answer.headers["content-length"]) == len(answer.content)
    body = AgentReportAnswer.model_validate_json(answer.content)
    assert body.node == "n1" and body.report_interval_s > 0


async def test_each_refusal_keeps_its_status_and_shape(plane: Plane) -> None:
    _, creds, url = plane
    assert creds.join_token
    async with httpx.AsyncClient() as client:
        token = await register(client, url, creds.join_token, "n1")
        await register(client, url, creds.join_token, "n2")
        good = AgentReport(node="n1", inventory=inventory("n1")).model_dump_json()
        other = AgentReport(node="n2", inventory=inventory("n2")).model_dump_json()
        bearer = {"Authorization": f"Bearer {token}"}
        cases = [
            ({}, good, 401, "authentication_error"),
            ({"Authorization": "Bearer llmgw-node-nonsense"}, good, 401, "authentication_error"),
            (bearer, other, 403, "permission_error"),
            (bearer, "{not json", 422, "invalid_request_error"),
            (bearer, '{"node": "n1"}', 422, "invalid_request_error"),
        ]
        for headers, content, status, kind in cases:
            answer = await client.post(f"{url}/agent/v1/report", content=content,
                                       headers=headers)
            assert answer.status_code == status, (status, answer.text)
            error = answer.json()["error"]
            assert error["type"] == kind and error["message"], answer.text
        bad_json = await client.post(f"{url}/agent/v1/report", content="{not json",
                                     headers=bearer)
        assert "not valid JSON" in bad_json.json()["error"]["message"]
        # Other methods still meet the framework: 405 in the same shape.
        wrong = await client.get(f"{url}/agent/v1/report")
        assert wrong.status_code == 405
        assert wrong.json()["error"]["type"] == "invalid_request_error"


async def test_a_standby_sends_reports_to_the_leader(plane: Plane) -> None:
    cp, creds, url = plane
    assert creds.join_token
    async with httpx.AsyncClient() as client:
        token = await register(client, url, creds.join_token, "n1")
        cp.is_leader = False
        answer = await client.post(
            f"{url}/agent/v1/report",
            content=AgentReport(node="n1", inventory=inventory("n1")).model_dump_json(),
            headers={"Authorization": f"Bearer {token}"})
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "standby"
    assert "retry-after" in answer.headers
