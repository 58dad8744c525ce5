"""``GET /admin/v1/gateways``: the gateways whose load reports reach the control plane
(control/gateway_count.py), fed through the gateway API as gateways feed it."""

from __future__ import annotations

from typing import Any

from tests.control.planekit import Api, bearer

from llmgw.control.gateway_count import GatewayCount
from llmgw.wire import GatewayLoadReport, ReplicaLoad


async def _load(api: Api, gateway: str, in_flight: list[int],
                waiting: dict[str, int] | None = None) -> None:
    client, _, creds = api
    assert creds.gateway_token
    report = GatewayLoadReport(
        gateway_id=gateway, waiting=waiting or {},
        replicas=[ReplicaLoad(replica_id=f"r{i}", in_flight=n) for i, n in enumerate(in_flight)],
    )
    answer = await client.post("/gateway/v1/load", content=report.model_dump_json(),
                               headers=bearer(creds.gateway_token))
    assert answer.status_code == 204, answer.text


async def _gateways(api: Api) -> dict[str, Any]:
    client, _, creds = api
    assert creds.admin_token
    answer = await client.get("/admin/v1/gateways", headers=bearer(creds.admin_token))
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


async def test_two_gateways_are_listed_by_id_with_their_last_reports(api: Api) -> None:
    _, cp, _ = api
    cp.gateways._gateway_count = GatewayCount(settle_s=0.0)
    await _load(api, "gw-b", [1, 0, 2], waiting={"chat": 2})
    await _load(api, "gw-a", [4])
    body = await _gateways(api)
    assert body["count"] == cp.gateways.config().routing.gateways == 2
    assert body["placement"] == "by hash" and body["leader"] is True
    assert [g["id"] for g in body["gateways"]] == ["gw-a", "gw-b"]
    a, b = body["gateways"]
    assert (a["in_flight"], a["waiting"]) == (4, {})
    assert (b["in_flight"], b["waiting"]) == (3, {"chat": 2})
    assert 0.0 <= a["last_report_s"] <= b["last_report_s"] < 5.0
    assert round(b["last_report_s"], 1) == b["last_report_s"]


async def test_one_gateway_places_by_load(api: Api) -> None:
    _, cp, _ = api
    cp.gateways._gateway_count = GatewayCount(settle_s=0.0)
    await _load(api, "gw-a", [0])
    body = await _gateways(api)
    assert (body["count"], body["placement"]) == (1, "by load")


async def test_a_control_plane_just_started_says_settling_and_lists_who_reported(
    api: Api,
) -> None:
    await _load(api, "gw-a", [0])
    body = await _gateways(api)
    assert (body["count"], body["placement"]) == (0, "settling")
    assert [g["id"] for g in body["gateways"]] == ["gw-a"]


async def test_a_gateway_gone_stale_is_not_listed(api: Api) -> None:
    _, cp, _ = api
    cp.gateways._gateway_count = GatewayCount(settle_s=0.0, stale_after_s=0.0)
    await _load(api, "gw-a", [0])
    body = await _gateways(api)
    # Read after the report, so older than no time at all: forgotten on reading.
    assert body["gateways"] == [] and body["count"] == 1


async def test_a_standby_answers_with_what_it_has(api: Api) -> None:
    # Reads are served on a standby; it hears no reports (the gateway API is
    # the leader's), and says so rather than looking like a fleet without gateways.
    _, cp, _ = api
    cp.is_leader = False
    body = await _gateways(api)
    assert body == {"count": 0, "placement": "settling", "leader": False, "gateways": []}
