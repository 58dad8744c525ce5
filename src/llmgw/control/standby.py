"""What a control-plane instance that is not the leader answers instead of acting.

Several ``llmgw serve`` share one PostgreSQL store; one leads (llmgw.control.
leader), the others are hot standbys that keep their views fresh for admin
reads. Writes are the leader's alone: a standby answering an agent would hand
out assignments from views seconds old, and take heartbeats the leader never
sees (so the leader would call the node unreachable). So a standby refuses
them with 503, ``Retry-After``, and the leader's advertised URL, which the
leader writes into the store in the same transaction that makes it leader
(Store.bump_epoch): the hint can name a leader that has since died, never one
older than the current epoch's.
"""

from __future__ import annotations

import contextlib
import time

from fastapi.responses import Response

from llmgw.control.store.repo import LEADER_URL_KEY, Store
from llmgw.errors import StandbyError
from llmgw.wire import LEADER_HEADER, STANDBY_CODE, ErrorBody, ErrorDetail

# Agents and gateways retry a standby's refusal at once elsewhere; this is for
# clients that only know this instance (and for load balancers).
RETRY_AFTER_S = 1
# A thousand agents told at once to move would otherwise each cost a store
# read; a second-old hint is as good as a fresh one.
HINT_TTL_S = 1.0


class LeaderHint:
    """Where the leader is, as the store says, cached for a second."""

    def __init__(self, store: Store, own_url: str | None = None) -> None:
        self.store = store
        # Never send a client back here: a leader that stepped down reads its
        # own URL until another instance takes over.
        self.own_url = own_url
        self._cached: str | None = None
        self._read_at = float("-inf")

    async def url(self) -> str | None:
        now = time.monotonic()
        if now - self._read_at >= HINT_TTL_S:
            url: str | None = None
            # A store that cannot be read leaves the client to try its other
            # URLs, which is all it could do with a hint anyway.
            with contextlib.suppress(Exception):
                url = await self.store.get_setting(LEADER_URL_KEY)
            self._cached, self._read_at = url, now
        if not self._cached or self._cached == self.own_url:
            return None
        return self._cached


async def standby_response(hint: LeaderHint, exc: StandbyError) -> Response:
    """503 in the APIs' error shape, naming the leader when it is known."""
    leader = await hint.url()
    message = str(exc) + (f"; the leader is {leader}" if leader else "; no leader is known")
    headers = {"Retry-After": str(RETRY_AFTER_S)}
    if leader:
        headers[LEADER_HEADER] = leader
    body = ErrorBody(error=ErrorDetail(message=message, type="standby_error", code=STANDBY_CODE,
                                       leader=leader))
    return Response(body.render(), status_code=503, media_type="application/json",
                    headers=headers)
