"""Mixed versions during an upgrade: an agent or gateway older than its control plane.

The control plane is upgraded first (docs/operations.md), so for a while its
answers carry fields the nodes do not know. They must keep working on what
they do know, say once that they are older, and still refuse an answer that
is wrong for any other reason.
"""

from __future__ import annotations

import logging

import orjson
import pytest
from aiohttp import web
from pydantic import ValidationError as PydanticValidationError

from llmgw.agent.client import REPORT_PATH, _parse
from llmgw.errors import ValidationError
from llmgw.gateway.link import CONFIG_PATH, HttpControlPlaneLink
from llmgw.wire import AgentReportAnswer, GatewayConfig, ModelSpec, read_from_newer


def _answer_from_a_newer_control_plane() -> bytes:
    answer = AgentReportAnswer(node="n1").model_dump(mode="json")
    answer["assignments"] = [
        {
            "replica_id": "r1",
            "model": ModelSpec(name="m", engine="sim").model_dump(mode="json") | {"new_knob": 3},
            "shard": {"node": "n1", "device_numbers": [0], "numa_hint": 1},
        }
    ]
    answer["node_quota"] = {"gpus": 8}
    return orjson.dumps(answer)


def test_fields_a_newer_sender_added_are_ignored_and_named() -> None:
    answer, unknown = read_from_newer(AgentReportAnswer, _answer_from_a_newer_control_plane())
    assert answer.assignments[0].model.name == "m"
    assert answer.assignments[0].shard.device_numbers == [0]
    assert sorted(unknown) == [
        "assignments.0.model.new_knob", "assignments.0.shard.numa_hint", "node_quota",
    ]
    # What this version knows is still checked as strictly as ever.
    with pytest.raises(PydanticValidationError):
        read_from_newer(AgentReportAnswer, orjson.dumps({"node": "n1", "node_quota": 1,
                                                         "report_interval_s": "soon"}))
    with pytest.raises(PydanticValidationError):
        read_from_newer(AgentReportAnswer, orjson.dumps({"node_quota": 1}))  # no node


def test_the_agent_takes_a_newer_answer_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    body = _answer_from_a_newer_control_plane()
    with caplog.at_level(logging.WARNING, logger="llmgw.agent.client"):
        first = _parse(AgentReportAnswer, body, REPORT_PATH)
        _parse(AgentReportAnswer, body, REPORT_PATH)
    assert [a.replica_id for a in first.assignments] == ["r1"]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "node_quota" in said[0] and "upgrade the agent" in said[0]
    with pytest.raises(ValidationError, match="malformed"):
        _parse(AgentReportAnswer, b'{"assignments": []}', REPORT_PATH)


async def test_a_gateway_takes_a_newer_config_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = GatewayConfig.model_validate({"routing": {"version": 7}}).model_dump(mode="json")
    config["routing"]["affinity_v2"] = True

    async def answer(request: web.Request) -> web.Response:
        return web.json_response(config)

    app = web.Application()
    app.router.add_get(CONFIG_PATH, answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    link = HttpControlPlaneLink(f"http://127.0.0.1:{port}", "gw-token")
    try:
        with caplog.at_level(logging.WARNING, logger="llmgw.gateway.link"):
            got = await link.watch_config(-1)
            await link.watch_config(7)
        assert got.routing.version == 7
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and "routing.affinity_v2" in said[0], said
    finally:
        await link.close()
        await runner.cleanup()
