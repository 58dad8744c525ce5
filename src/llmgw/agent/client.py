"""The agent's side of the fixed protocol with the control plane (brief, "Fixed protocol").

Two calls: register once with the join token for a node token, then report
with that token and receive the full set of assignments. Transport errors
and HTTP statuses are translated here, once, into the error tree, so the
agent's loop handles three cases: unreachable (retry), refused credentials
(re-register or stop), malformed report (a bug: log it loudly, retry).
"""

from __future__ import annotations

import logging
from typing import TypeVar

import aiohttp
from pydantic import ValidationError as PydanticValidationError

from llmgw.errors import AuthError, LlmgwError, ValidationError
from llmgw.wire import AgentRegistration, AgentRegistrationAnswer, AgentReport, AgentReportAnswer

log = logging.getLogger("llmgw.agent.client")

_Answer = TypeVar("_Answer", AgentRegistrationAnswer, AgentReportAnswer)

REGISTER_PATH = "/agent/v1/register"
REPORT_PATH = "/agent/v1/report"


class ControlPlaneUnavailable(LlmgwError):
    """The control plane did not answer (down, restarting, network); the loop retries."""


class ControlPlaneClient:
    def __init__(self, base_url: str, session: aiohttp.ClientSession, timeout_s: float = 30.0):
        self.base_url = base_url.rstrip("/")
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def register(self, registration: AgentRegistration) -> AgentRegistrationAnswer:
        body = await self._post(REGISTER_PATH, registration.model_dump_json(), token=None)
        return _parse(AgentRegistrationAnswer, body, REGISTER_PATH)

    async def report(self, token: str, report: AgentReport) -> AgentReportAnswer:
        body = await self._post(REPORT_PATH, report.model_dump_json(), token=token)
        return _parse(AgentReportAnswer, body, REPORT_PATH)

    async def _post(self, path: str, payload: str, token: str | None) -> bytes:
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        url = self.base_url + path
        try:
            async with self.session.post(
                url, data=payload, headers=headers, timeout=self.timeout
            ) as resp:
                body = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise ControlPlaneUnavailable(
                f"control plane {self.base_url} unreachable: {exc}"
            ) from None
        if status in (401, 403):
            raise AuthError(f"{path}: HTTP {status}: {_message(body)}")
        if status == 422:
            raise ValidationError(
                f"{path}: the control plane refused the message: {_message(body)}"
            )
        if status >= 300:
            raise ControlPlaneUnavailable(f"{path}: HTTP {status}: {_message(body)}")
        return body


def _message(body: bytes) -> str:
    return body.decode("utf-8", errors="replace").strip()[:500] or "(no body)"


def _parse(kind: type[_Answer], body: bytes, path: str) -> _Answer:
    try:
        return kind.model_validate_json(body)
    except PydanticValidationError as exc:
        raise ValidationError(f"{path}: the control plane's answer is malformed: {exc}") from None
