"""Telling agents their assignments changed, so they report now.

Agents learn what to run from the answer to their periodic report. Without a
nudge a new placement waits up to a whole report interval (5 s) before the
agent hears of it, which an on-demand request spends waiting. The nudge is
only a hint: it carries nothing, a lost one costs that interval and nothing
more, and agents the control plane cannot reach simply keep their interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable, Iterable

import aiohttp

from llmgw.control.state import FleetState, NodeRecord, ReplicaRecord
from llmgw.wire import NUDGE_PATH, ReplicaState, host_in_url

log = logging.getLogger(__name__)

NUDGE_TIMEOUT_S = 1.0

class AssignmentWatch:
    """Which nodes' assignments (replica ids, generations, draining) changed
    since the last look, for the reconcile loop to nudge.

    Kept per replica, not per node: a per-node signature of the whole fleet,
    built again every pass, was 8 % of a 10,000-node control plane's CPU
    while it took 1,900 reports a second (bench/reports.py, py-spy). The
    nodes named are exactly those whose set of (id, generation, draining)
    items changed.
    """

    def __init__(self, state: FleetState) -> None:
        self._seen = _look(state)

    def changed(self, state: FleetState) -> set[str]:
        now = _look(state)
        before, self._seen = self._seen, now
        out: set[str] = set()
        for rid, seen in before.items():
            replica = seen[0]
            after = now.get(rid)
            if after is None:
                out.update(s.node for s in replica.shards)
            elif after[0] is not replica or after[1:] != seen[1:]:
                nodes_before = {s.node for s in replica.shards}
                nodes_after = {s.node for s in after[0].shards}
                # The same item: only a node it left or joined sees a change.
                out |= (nodes_before | nodes_after if after[1:] != seen[1:]
                        else nodes_before ^ nodes_after)
        for rid, seen in now.items():
            if rid not in before:
                out.update(s.node for s in seen[0].shards)
        return out


_Seen = tuple[ReplicaRecord, int, bool, tuple[str, ...] | None, bool | None]


def _look(state: FleetState) -> dict[str, _Seen]:
    # The adapters and sleep an assignment carries change no generation,
    # and their agent must hear of them as soon (a request waits on each).
    return {
        rid: (r, r.generation, r.state is ReplicaState.DRAINING, r.adapters, r.asleep)
        for rid, r in state.replicas.items()
    }


class Nudger:
    def __init__(
        self, token: str, url: Callable[[NodeRecord], str | None] | None = None,
        ssl_context: Callable[[], ssl.SSLContext | None] | None = None,
    ) -> None:
        self._token = token
        # Where each node's server is (https:// where nodes hold certificates
        # from the fleet CA, control.nodecerts), and how it is verified: the
        # nudge carries the peer token.
        self._url = url or _plain_url
        self._ssl = ssl_context or (lambda: None)
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def nudge(self, nodes: Iterable[NodeRecord]) -> None:
        """Fire and forget: the reconcile loop never waits on an agent."""
        for node in nodes:
            url = self._url(node)
            if url is None:
                continue
            task = asyncio.create_task(self._one(url))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _one(self, base: str) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=NUDGE_TIMEOUT_S)
            )
        try:
            context = self._ssl()
            async with self._session.post(
                base + NUDGE_PATH, headers={"Authorization": f"Bearer {self._token}"},
                ssl=context if context is not None else True,
            ) as response:
                await response.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.debug("nudge to %s failed: %s", base, exc)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()
            self._session = None


def _plain_url(node: NodeRecord) -> str | None:
    if node.agent_port is None:
        return None
    return f"http://{host_in_url(node.address)}:{node.agent_port}"
