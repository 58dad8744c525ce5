"""The agent's side of the fixed protocol with the control plane (brief, "Fixed protocol").

Two calls: register once with the join token for a node token, then report
with that token and receive the full set of assignments. Transport errors
and HTTP statuses are translated here, once, into the error tree, so the
agent's loop handles three cases: unreachable (retry), refused credentials
(re-register or stop), malformed report (a bug: log it loudly, retry).

The client may be given several control-plane instances (comma-separated);
each call goes to the leader among them (llmgw.failover). A node token is
kept in the shared store, so it is good at whichever instance leads.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TypeVar

import aiohttp
import orjson
from pydantic import ValidationError as PydanticValidationError

from llmgw.errors import AuthError, LlmgwError, ValidationError
from llmgw.failover import ControlPlaneUnreachable, LeaderFinder
from llmgw.tls import ClientTrust, fetch_ca
from llmgw.wire import (
    AgentRegistration,
    AgentRegistrationAnswer,
    AgentReport,
    AgentReportAnswer,
    read_from_newer,
)

log = logging.getLogger("llmgw.agent.client")

_Answer = TypeVar("_Answer", AgentRegistrationAnswer, AgentReportAnswer)

REGISTER_PATH = "/agent/v1/register"
REPORT_PATH = "/agent/v1/report"


class ControlPlaneUnavailable(LlmgwError):
    """The control plane did not answer (down, restarting, network); the loop retries."""

    def __init__(self, message: str, *, standby_answered: bool = False) -> None:
        super().__init__(message)
        # Only standbys answered: a leader is being elected (see the loop's backoff).
        self.standby_answered = standby_answered


class ControlPlaneClient:
    def __init__(
        self,
        urls: str | Sequence[str],
        session: aiohttp.ClientSession,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        trust: ClientTrust | None = None,
    ):
        self.leader = LeaderFinder(urls)
        self.session = session
        self.trust = trust or ClientTrust()
        # A short connect limit: an instance whose machine is gone (no reset,
        # just silence) would otherwise hold every report for the whole
        # timeout before the next instance is tried.
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)

    @property
    def base_url(self) -> str:
        """The instance calls go to now."""
        return self.leader.current

    async def register(self, registration: AgentRegistration) -> AgentRegistrationAnswer:
        body = await self._post(REGISTER_PATH, registration.model_dump_json(), token=None)
        return _parse(AgentRegistrationAnswer, body, REGISTER_PATH)

    async def report(self, token: str, report: AgentReport) -> AgentReportAnswer:
        body = await self._post(REPORT_PATH, report.model_dump_json(), token=token)
        return _parse(AgentReportAnswer, body, REPORT_PATH)

    async def _verify_from_now_on(self) -> None:
        """Trust the fleet's CA before the first call (the join token goes out in it).

        Cheap after the first time. A CA that cannot be fetched yet (control
        plane down) is retried like any unreachable call; one with the wrong
        fingerprint is a TrustError, which no retry heals.
        """
        try:
            self.leader.ssl = await self.trust.context(
                self.leader.urls, lambda urls, expected: fetch_ca(self.session, urls, expected)
            )
        except ConnectionError as exc:
            raise ControlPlaneUnavailable(str(exc)) from None

    async def _post(self, path: str, payload: str, token: str | None) -> bytes:
        await self._verify_from_now_on()
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        try:
            answer = await self.leader.request(
                self.session, "POST", path, data=payload, headers=headers, limits=self.timeout
            )
        except ControlPlaneUnreachable as exc:
            raise ControlPlaneUnavailable(
                str(exc), standby_answered=exc.standby_answered
            ) from None
        status, body = answer.status, answer.body
        if status in (401, 403):
            raise AuthError(f"{path}: HTTP {status}: {_message(body)}")
        if status == 422:
            raise ValidationError(
                f"{path}: the control plane refused the message: {_message(body)}"
            )
        if status >= 300:
            raise ControlPlaneUnavailable(
                f"{answer.url}{path}: HTTP {status}: {_message(body)}"
            )
        return body


def _message(body: bytes) -> str:
    """The error's message when the body has the usual shape, else the body itself.

    A refusal such as "already registered; run llmgw ctl nodes delete ..." is
    logged by the agent for a person to act on: the sentence, not its JSON.
    """
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        message = parsed["error"].get("message")
        if isinstance(message, str) and message:
            return message[:500]
    return body.decode("utf-8", errors="replace").strip()[:500] or "(no body)"


def _parse(kind: type[_Answer], body: bytes, path: str) -> _Answer:
    try:
        answer, unknown = read_from_newer(kind, body)
    except PydanticValidationError as exc:
        raise ValidationError(f"{path}: the control plane's answer is malformed: {exc}") from None
    if unknown:
        _warn_newer(path, unknown)
    return answer


_warned_newer: set[tuple[str, ...]] = set()


def _warn_newer(path: str, fields: list[str]) -> None:
    """Says once per set of fields that the control plane is newer than this agent."""
    key = (path, *fields)
    if key not in _warned_newer:
        _warned_newer.add(key)
        log.warning(
            "%s: the control plane sent fields this agent does not know (%s) and they are "
            "ignored: it is newer than this agent; upgrade the agent",
            path, ", ".join(fields),
        )
