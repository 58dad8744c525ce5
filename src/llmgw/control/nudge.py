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

from llmgw.control.state import FleetState, NodeRecord
from llmgw.wire import NUDGE_PATH, host_in_url

log = logging.getLogger(__name__)

NUDGE_TIMEOUT_S = 1.0

Signature = dict[str, frozenset[tuple[str, int, bool]]]


def assignment_signature(state: FleetState) -> Signature:
    """Per node, what it is asked to run: replica ids, generations, draining."""
    per_node: dict[str, set[tuple[str, int, bool]]] = {}
    for replica in state.replicas.values():
        item = (replica.id, replica.generation, replica.draining)
        for shard in replica.shards:
            per_node.setdefault(shard.node, set()).add(item)
    return {node: frozenset(items) for node, items in per_node.items()}


def changed_nodes(before: Signature, after: Signature) -> set[str]:
    return {n for n in before.keys() | after.keys() if before.get(n) != after.get(n)}


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
