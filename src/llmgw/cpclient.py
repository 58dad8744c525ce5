"""One call to the control plane, made the same way by every client that makes it.

The agent (llmgw.agent.client), the standalone gateway (llmgw.gateway.link)
and the simulated fleet's catalog apply (llmgw.sim.fleet) take the same three
steps through one :class:`ControlPlaneCaller`, so that no client reads a
status differently from another:

1. trust the fleet's CA before the first call carries a token out (llmgw.tls);
2. send the call to the leader among the configured instances, following a
   standby's hint only to a configured instance (llmgw.failover);
3. read the status once, into the error tree: 401/403 a refused credential
   (AuthError), 422 a refused message (ValidationError), any other failure
   ControlPlaneUnavailable, each with the error body's sentence
   (wire.ErrorBody), which is what a person acts on.

``llmgw ctl`` is synchronous (httpx); it walks the instances with
failover.CallWalk itself and reads error bodies with the same ErrorBody.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TypedDict, TypeVar, Unpack

import aiohttp
from pydantic import ValidationError as PydanticValidationError

from llmgw.errors import AuthError, ControlPlaneUnavailable, ValidationError
from llmgw.failover import Answer, LeaderFinder
from llmgw.tls import ClientTrust, fetch_ca
from llmgw.wire import ErrorBody, Wire, read_from_newer

_W = TypeVar("_W", bound=Wire)

# An error body is logged and shown; one from a proxy in between may be a
# whole HTML page.
MESSAGE_LIMIT = 500


class RequestOptions(TypedDict, total=False):
    """What a call may add to its method and path: see :meth:`LeaderFinder.request`."""

    data: bytes | str | None
    headers: Mapping[str, str] | None
    params: Callable[[str], Mapping[str, int | str]] | None
    limits: aiohttp.ClientTimeout | None
    once_each: bool


class ControlPlaneCaller:
    """The configured control-plane instances, and calls to the leader among them.

    ``trust``: how https:// instances are verified (llmgw.tls.ClientTrust);
    None: with the system's CAs only (a one-off call that fetches no CA).
    """

    def __init__(self, urls: str | Sequence[str], *, trust: ClientTrust | None = None) -> None:
        self.leader = LeaderFinder(urls)
        self.trust = trust

    async def call(
        self,
        session: aiohttp.ClientSession,
        method: str,
        path: str,
        *,
        credential: str,
        refused: str = "the message",
        **options: Unpack[RequestOptions],
    ) -> Answer:
        """The leader's answer to one call, when it took it (a 2xx status).

        ``credential`` names what a 401/403 refused ("node token"), and
        ``refused`` what a 422 refused, for the error's sentence; ``options``
        go to :meth:`LeaderFinder.request`.
        """
        await self._trust_from_now_on(session)
        answer = await self.leader.request(session, method, path, **options)
        where = f"{method} {answer.url}{path}"
        status = answer.status
        if status in (401, 403):
            raise AuthError(f"{where}: the control plane refused the {credential} ({status}): "
                            f"{error_message(answer.body)}")
        if status == 422:
            raise ValidationError(
                f"{where}: the control plane refused {refused}: {error_message(answer.body)}"
            )
        if status >= 300:
            raise ControlPlaneUnavailable(f"{where}: HTTP {status}: {error_message(answer.body)}")
        return answer

    async def _trust_from_now_on(self, session: aiohttp.ClientSession) -> None:
        """Trust the fleet's CA before the first call (it carries a token out).

        Cheap after the first time. A CA that cannot be fetched yet (control
        plane down) is retried like any unreachable call; one with the wrong
        fingerprint is a TrustError, which no retry heals.
        """
        if self.trust is None:
            return
        try:
            self.leader.ssl = await self.trust.context(
                self.leader.urls, lambda urls, expected: fetch_ca(session, urls, expected)
            )
        except ConnectionError as exc:
            raise ControlPlaneUnavailable(str(exc)) from None


def error_message(body: bytes) -> str:
    """The error's sentence when the body is an error body, else the body itself.

    A refusal such as "already registered; run llmgw ctl nodes delete ..." is
    logged for a person to act on: the sentence, not its JSON.
    """
    message = ErrorBody.message_in(body)
    if message:
        return message[:MESSAGE_LIMIT]
    return body.decode("utf-8", errors="replace").strip()[:MESSAGE_LIMIT] or "(no body)"


class NewerAnswers:
    """Reads answers that may come from a newer control plane; says so once per set of fields.

    The control plane is upgraded first (docs/operations.md), so for a while
    its answers carry fields this client does not know: they are ignored
    (wire.read_from_newer) and named in one warning, not one per answer.
    """

    def __init__(self, log: logging.Logger, client: str) -> None:
        self.log = log
        self.client = client  # "agent", "gateway": who should be upgraded
        self._said: set[tuple[str, ...]] = set()

    def read(self, kind: type[_W], body: bytes, where: str) -> _W:
        """``body`` as ``kind``; ValidationError when it is malformed beyond newer fields."""
        try:
            answer, unknown = read_from_newer(kind, body)
        except PydanticValidationError as exc:
            raise ValidationError(
                f"{where}: the control plane's answer is malformed: {exc}"
            ) from None
        said = (where, *unknown)
        if unknown and said not in self._said:
            self._said.add(said)
            self.log.warning(
                "%s: the control plane sent fields this %s does not know (%s) and they are "
                "ignored: it is newer than this %s; upgrade the %s",
                where, self.client, ", ".join(unknown), self.client, self.client,
            )
        return answer
