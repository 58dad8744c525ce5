"""Test doubles for the agent: a stub engine adapter and a fake control plane.

The fake control plane implements the two endpoints of the fixed protocol
(register, report) on a real loopback socket, checks the node token like the
real one (401 unknown, 403 another node's), records every report and answers
with whatever assignments the test sets.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from aiohttp import web
from tests.agent.helpers import assign, cpu_slot

from llmgw.agent.engines.base import EngineLaunch, LaunchContext, check_common
from llmgw.secrets import NODE_PREFIX, bearer, new_secret
from llmgw.wire import (
    STANDBY_CODE,
    AgentRegistration,
    AgentRegistrationAnswer,
    AgentReport,
    AgentReportAnswer,
    EngineKind,
    ModelSpec,
    ReplicaAssignment,
    ReplicaState,
    ReplicaStatus,
    WeightsDigests,
)

STUB = str(Path(__file__).with_name("stub_engine.py"))


class StubAdapter:
    """Runs ``stub_engine.py``; catalog engine_args pass through (e.g. ``--exit-after 1``)."""

    kind = EngineKind.SIM
    guards_every_route = False
    adapters_at_start = False

    def validate(self, assignment: ReplicaAssignment) -> None:
        check_common(assignment, ("--host", "--port"))

    def build(self, ctx: LaunchContext) -> EngineLaunch:
        self.validate(ctx.assignment)
        argv = [
            sys.executable,
            STUB,
            "--host",
            ctx.host,
            "--port",
            str(ctx.port),
            "--model",
            ctx.assignment.model.name,
            *ctx.assignment.model.engine_args,
        ]
        return EngineLaunch(argv=argv, env={"STUB_REPLICA": ctx.assignment.replica_id})


class FakeControlPlane:
    def __init__(self, join_token: str = "llmgw-join-test") -> None:
        self.join_token = join_token
        self.tokens: dict[str, str] = {}  # token -> node
        self.assignments: dict[str, list[ReplicaAssignment]] = {}
        self.weight_peers: dict[str, list[str]] = {}
        self.weight_digests: dict[str, WeightsDigests] = {}
        self.peer_token: str | None = "peer-secret"
        self.interval = 0.3
        self.reports: list[AgentReport] = []
        # True: answer reports as a standby does while no instance leads.
        self.standby = False
        self.standby_answers = 0
        self.registrations = 0
        self.agent_keys: list[str | None] = []  # as each registration carried it
        self.url = ""
        self._new_report = asyncio.Condition()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/agent/v1/register", self._register)
        app.router.add_post("/agent/v1/report", self._report)
        return app

    async def _register(self, request: web.Request) -> web.Response:
        # As the control plane: the join token in the head, checked before the body.
        if bearer(request.headers.get("Authorization")) != self.join_token:
            return web.json_response({"detail": "bad join token"}, status=401)
        reg = AgentRegistration.model_validate_json(await request.read())
        token = new_secret(NODE_PREFIX)
        self.tokens[token] = reg.node
        self.registrations += 1
        self.agent_keys.append(reg.agent_key)
        return web.Response(
            body=AgentRegistrationAnswer(node=reg.node, node_token=token).model_dump_json(),
            content_type="application/json",
        )

    async def _report(self, request: web.Request) -> web.Response:
        if self.standby:
            self.standby_answers += 1
            error = {"message": "standby", "type": "standby_error", "code": STANDBY_CODE}
            return web.json_response({"error": error}, status=503)
        token = bearer(request.headers.get("Authorization"))
        node = self.tokens.get(token or "")
        if node is None:
            return web.json_response({"detail": "unknown node token"}, status=401)
        try:
            report = AgentReport.model_validate_json(await request.read())
        except ValueError as exc:
            return web.json_response({"detail": str(exc)}, status=422)
        if report.node != node:
            return web.json_response({"detail": "token of another node"}, status=403)
        async with self._new_report:
            self.reports.append(report)
            self._new_report.notify_all()
        answer = AgentReportAnswer(
            node=node,
            assignments=self.assignments.get(node, []),
            report_interval_s=self.interval,
            weight_peers=self.weight_peers,
            peer_token=self.peer_token,
            weight_digests=self.weight_digests,
        )
        return web.Response(body=answer.model_dump_json(), content_type="application/json")

    def assign_one(self, spec: ModelSpec, node: str = "n1", **fields: Any) -> ReplicaAssignment:
        """One replica of ``spec`` on the node's first CPU slot: its only assignment from now on."""
        assignment = assign(spec, [cpu_slot(0)], node=node, **fields)
        self.assignments[node] = [assignment]
        return assignment

    async def wait_for(
        self, predicate: Callable[[AgentReport], bool], within: float = 15.0
    ) -> AgentReport:
        """The first report from now on for which ``predicate`` holds."""
        start = len(self.reports)

        async def find() -> AgentReport:
            seen = start
            async with self._new_report:
                while True:
                    for report in self.reports[seen:]:
                        if predicate(report):
                            return report
                    seen = len(self.reports)
                    await self._new_report.wait()

        return await asyncio.wait_for(find(), within)

    async def wait_state(
        self, replica_id: str, state: ReplicaState, within: float = 15.0
    ) -> ReplicaStatus:
        report = await self.wait_for(
            lambda r: any(s.replica_id == replica_id and s.state == state for s in r.replicas),
            within,
        )
        return next(s for s in report.replicas if s.replica_id == replica_id)


@asynccontextmanager
async def serve_app(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
