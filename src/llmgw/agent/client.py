"""The agent's side of the fixed protocol with the control plane (brief, "Fixed protocol").

Two calls: register once with the join token for a node token, then report
with that token (each in the ``Authorization`` header, which the control
plane checks before it reads a body) and receive the full set of assignments. Transport errors
and HTTP statuses are translated once, by the shared llmgw.cpclient, into
the error tree, so the agent's loop handles three cases: unreachable (retry),
refused credentials (re-register or stop), malformed report (a bug: log it
loudly, retry).

The client may be given several control-plane instances (comma-separated);
each call goes to the leader among them (llmgw.failover). A node token is
kept in the shared store, so it is good at whichever instance leads.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TypeVar

import aiohttp

from llmgw.cpclient import ControlPlaneCaller, NewerAnswers
from llmgw.tls import ClientTrust
from llmgw.wire import (
    AgentRegistration,
    AgentRegistrationAnswer,
    AgentReport,
    AgentReportAnswer,
)

log = logging.getLogger("llmgw.agent.client")

_Answer = TypeVar("_Answer", AgentRegistrationAnswer, AgentReportAnswer)

REGISTER_PATH = "/agent/v1/register"
REPORT_PATH = "/agent/v1/report"

# One for the process: a simulated fleet runs hundreds of agents, and a newer
# control plane is worth one warning, not one per node.
_newer = NewerAnswers(log, "agent")


class ControlPlaneClient:
    def __init__(
        self,
        urls: str | Sequence[str],
        session: aiohttp.ClientSession,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        trust: ClientTrust | None = None,
    ):
        self.caller = ControlPlaneCaller(urls, trust=trust or ClientTrust())
        self.session = session
        # A short connect limit: an instance whose machine is gone (no reset,
        # just silence) would otherwise hold every report for the whole
        # timeout before the next instance is tried.
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)

    @property
    def base_url(self) -> str:
        """The instance calls go to now."""
        return self.caller.leader.current

    async def register(
        self, registration: AgentRegistration, join_token: str
    ) -> AgentRegistrationAnswer:
        """Register with ``join_token``, sent in the head (checked before the body
        is read) and never in the body."""
        payload = registration.model_dump_json(exclude={"join_token"})
        body = await self._post(REGISTER_PATH, payload, token=join_token, credential="join token")
        return _parse(AgentRegistrationAnswer, body, REGISTER_PATH)

    async def report(self, token: str, report: AgentReport) -> AgentReportAnswer:
        body = await self._post(REPORT_PATH, report.model_dump_json(), token=token,
                                credential="node token")
        return _parse(AgentReportAnswer, body, REPORT_PATH)

    async def _post(self, path: str, payload: str, token: str, credential: str) -> bytes:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
        answer = await self.caller.call(
            self.session, "POST", path, data=payload, headers=headers, limits=self.timeout,
            credential=credential,
        )
        return answer.body


def _parse(kind: type[_Answer], body: bytes, path: str) -> _Answer:
    return _newer.read(kind, body, path)
