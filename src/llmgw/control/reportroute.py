"""Agent reports: the control plane's hottest route, answered by one endpoint.

10,000 nodes reporting every 5 s is 2,000 reports a second. Through the
framework each report also paid for matching the path against every admin
route, a Request and its dependency machinery, the exception and exit-stack
middlewares and a Response object: more than half of the control plane's
CPU per report (measured with py-spy), more than applying the report. So
one :class:`ReportEndpoint` answers ``POST /agent/v1/report``, and it is
reached three ways, all of them the same object (app.py wires them):

* the :class:`ReportRoute` middleware, inside the body limit and the report
  counter (limits.BodyLimit, :class:`CountReports`), so both still see every
  report, in front of FastAPI's routing;
* the endpoints table of servers that run an endpoint by (method, path)
  (llmgw.http.connection, through serve's PathDispatcher), in the same two
  layers;
* the route table, where it is declared for the framework's 405 to other
  methods.

The leader and the node token are checked before a byte of the body is
read. Failures are answered by the application's own exception handlers
(the dict FastAPI fills from ``app.exception_handler``), so every error
keeps its one shape.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError as PydanticValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmgw import secrets
from llmgw.control import telemetry
from llmgw.control.counters import ControlMetrics
from llmgw.control.httperrors import error_response
from llmgw.control.plane import ControlPlane
from llmgw.control.state import NodeRecord
from llmgw.control.telemetry import Reading
from llmgw.errors import ValidationError
from llmgw.wire import AgentReport

REPORT_PATH = "/agent/v1/report"

Handler = Callable[[Request, Exception], Response | Awaitable[Response]]


@dataclass(slots=True)
class _Kept:
    """A node's last valid report, and what its last body was."""

    node: NodeRecord
    report: AgentReport
    # The validated report's shape (control.telemetry), or None where the
    # readings path cannot vouch for this node's bodies.
    shape: bytes | None
    # The last body's SHA-256 and its readings (None: the report's own).
    digest: bytes
    readings: tuple[Reading, ...] | None


class CountReports:
    """ASGI middleware: every answer to an agent report counted by outcome.

    Outside every other layer, so refusals that never reach the endpoint (a
    body over the limit, a standby's 503) are counted as well.
    """

    def __init__(self, app: ASGIApp, metrics: ControlMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != REPORT_PATH:
            await self.app(scope, receive, send)
            return
        status = 500  # an exception before any answer is an error

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            self.metrics.agent_report(status)


class ReportRoute:
    """ASGI middleware: ``POST /agent/v1/report`` to the endpoint, anything else on."""

    def __init__(self, app: ASGIApp, endpoint: ReportEndpoint) -> None:
        self.app = app
        self.endpoint = endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == REPORT_PATH and scope["method"] == "POST":
            await self.endpoint(scope, receive, send)
        else:
            await self.app(scope, receive, send)


class ReportEndpoint:
    """The ASGI app that answers an agent's report: checks, the report taken in, the answer."""

    def __init__(self, cp: ControlPlane, handlers: Mapping[Any, Handler]) -> None:
        self.cp = cp
        # The application's exception handlers by exception class, filled
        # after this middleware is added; read at the time of a failure.
        self.handlers = handlers
        # Per node: its last valid report and how to recognise its like. An
        # agent's report differs from its last in its devices' telemetry
        # alone for hours on end, and validating it whole, every device of
        # the inventory, was the largest part of a report's CPU; a body of
        # the last one's shape is that report with other readings
        # (control.telemetry), and the same bytes are the same report.
        self._last: dict[str, _Kept] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            # The leader and the node token before a byte of the body is
            # read: a caller without a token holds no route waiting for a
            # body it may never finish, nor the memory of one.
            self.cp.require_leader()
            node = self.cp.nodes.for_token(secrets.bearer(_header(scope, b"authorization")))
            body = await _read_body(receive)
            payload = await self._answer(node, body)
        except ClientDisconnect:
            raise
        except Exception as exc:
            handler = self._handler_for(exc)
            if handler is None:
                raise
            response = handler(Request(scope), exc)
            if not isinstance(response, Response):
                response = await response
            await response(scope, receive, send)
            return
        if isinstance(payload, Response):
            await payload(scope, receive, send)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-length", str(len(payload)).encode()),
                    (b"content-type", b"application/json"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})

    async def _answer(self, node: NodeRecord, body: bytes) -> bytes | Response:
        cp = self.cp
        digest = hashlib.sha256(body).digest()
        kept = self._last.get(node.name)
        if kept is not None and kept.node is node:
            if kept.digest == digest:
                # The same bytes as this node's last report: the same report.
                answer = await cp.agents.report(node, kept.report, kept.readings)
                cp.metrics.report_read("same_bytes")
                return answer
            readings = telemetry.read(body, kept.shape) if kept.shape is not None else None
            if readings is not None:
                # The last valid report with this body's readings.
                answer = await cp.agents.report(node, kept.report, readings)
                kept.digest, kept.readings = digest, readings
                cp.metrics.report_read("telemetry")
                return answer
        report = _validated(body)
        if report.node != node.name:
            return error_response(
                403,
                f"this token speaks for node {node.name!r} only",
                "permission_error",
                "wrong_node",
            )
        answer = await cp.agents.report(node, report)
        self._remember(node, digest, report, body)
        cp.metrics.report_read("validated")
        return answer

    def _remember(self, node: NodeRecord, digest: bytes, report: AgentReport, body: bytes) -> None:
        last = self._last
        nodes = self.cp.state.nodes
        if len(last) > 2 * len(nodes) + 64:
            # Deleted nodes' and replaced records' entries (cp.load reads
            # every node afresh) are never hit again.
            for name in [n for n, entry in last.items() if nodes.get(n) is not entry.node]:
                del last[name]
        shape = telemetry.shape_of(body, report.inventory)
        inventory = node.inventory
        if (
            inventory is not None
            and inventory is not report.inventory
            and inventory == report.inventory
        ):
            # An inventory equal to the node's is not taken in (apply_report);
            # kept with the report, it would be a second copy of every device
            # per node: +350 MB at 10,000 nodes.
            report = report.model_copy(update={"inventory": inventory})
        last[node.name] = _Kept(node, report, shape, digest, None)

    def _handler_for(self, exc: Exception) -> Handler | None:
        for kind in type(exc).__mro__:
            handler = self.handlers.get(kind)
            if handler is not None:
                return handler
        return None


def _validated(body: bytes) -> AgentReport:
    try:
        # Parsed and validated in one step, in pydantic's core: a fifth
        # faster than orjson into dicts and validating those.
        return AgentReport.model_validate_json(body)
    except PydanticValidationError as exc:
        bad_json = [e for e in exc.errors() if e["type"] == "json_invalid"]
        if bad_json:
            raise ValidationError(f"request body is not valid JSON: {bad_json[0]['msg']}") from None
        raise


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return str(value.decode("latin-1"))
    return None
