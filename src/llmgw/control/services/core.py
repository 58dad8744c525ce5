"""What every control-plane service shares, and the one way they write.

The services (catalog, nodes, replicas, keys, credentials, the agents' and
the gateways' feeds) each own one resource, but they act on one fleet: one
:class:`FleetState` in memory, one store, one leadership. Writes go through
one :class:`FencedWrites` under the leader's epoch, and events and
reconciler wake-ups through here, so a deposed leader is refused the same
way whichever service it writes through, and no service can write around
the fence.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from typing import TypeVar

from llmgw import secrets
from llmgw.control.counters import ControlMetrics
from llmgw.control.enginekeys import EngineKeys
from llmgw.control.leader import Leadership
from llmgw.control.nodecerts import NodeCertificates
from llmgw.control.standby import LeaderHint
from llmgw.control.state import FleetState
from llmgw.control.store.repo import Store
from llmgw.control.weightdigests import SETTING as WEIGHT_DIGESTS
from llmgw.control.weightdigests import DigestBook
from llmgw.control.writes import FencedWrites
from llmgw.errors import NotFoundError, StandbyError

T = TypeVar("T")


def found(things: Mapping[str, T], name: str, kind: str) -> T:
    """``things[name]``, or NotFoundError naming the ``kind`` of thing asked for (an API's 404)."""
    thing = things.get(name)
    if thing is None:
        raise NotFoundError(f"{kind} {name!r} does not exist")
    return thing


class Core:
    """The fleet's one state, store, leadership and writer, which every service is given."""

    def __init__(
        self, store: Store, state: FleetState | None = None, leadership: Leadership | None = None
    ) -> None:
        self.store = store  # reads; every write goes through self.writes
        # Leads (and its writes carry no epoch) until an election owns this:
        # a control plane with no election (tests, benchmarks, embedding) is
        # the only instance. ControlPlaneRuntime hands it to its election,
        # which makes it a standby until it wins.
        self.leadership = leadership or Leadership()
        self.writes = FencedWrites(store, self.leadership)
        self.state = state or FleetState()
        self._reconcile_wakeup = asyncio.Event()
        # serve --trust-reported-fabrics: a report's fabrics are used unless
        # pinned; without it they are only a proposal (reports.apply_report).
        self.trust_reported_fabrics = False
        # What each model's weights must be (llmgw.control.weightdigests).
        self.digests = DigestBook(
            lambda document: self.writes.set_setting(WEIGHT_DIGESTS, document),
            self.event,
        )
        # The secret agents present to each other when copying weights. Kept
        # in memory only and handed out with every report: a restart rotates
        # it, and agents pick the new one up on their next report.
        self.peer_token = secrets.new_secret("llmgw-peer-")
        # Each replica's engine key (control.enginekeys); the stored seed
        # replaces this one in load().
        self.engine_keys = EngineKeys()
        # Certificates for agents' servers (control.nodecerts); serve gives
        # it the fleet CA's key where the fleet runs TLS.
        self.node_certs = NodeCertificates()
        self.leader_hint = LeaderHint(store)
        # Counted here (llmgw.control.counters), rendered on scrape (llmgw.control.metrics).
        self.metrics = ControlMetrics()

    @property
    def is_leader(self) -> bool:
        return self.leadership.is_leader

    @is_leader.setter
    def is_leader(self, leading: bool) -> None:
        self.leadership.is_leader = leading

    @property
    def epoch(self) -> int:
        return self.leadership.epoch or 0

    def require_leader(self) -> None:
        """Refuse a write on a standby (llmgw.control.standby says why)."""
        if not self.is_leader:
            raise StandbyError("this control-plane instance is a standby")

    async def event(self, kind: str, subject: str, message: str, **data: object) -> None:
        await self.writes.add_events(
            [{"at": time.time(), "kind": kind, "subject": subject, "message": message,
              "data": {k: v for k, v in data.items()}}]
        )

    def wake_reconciler(self) -> None:
        self._reconcile_wakeup.set()

    async def wait_for_wakeup(self, at_most_s: float) -> None:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns
        # normally when the wake-up lands in the same loop turn as a cancel,
        # and the cancel is lost; the reconcile loop then outlived the
        # runtime's stop(), which waited on it for ever.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(at_most_s):
                await self._reconcile_wakeup.wait()
        self._reconcile_wakeup.clear()
