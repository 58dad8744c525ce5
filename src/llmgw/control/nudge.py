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
from collections.abc import Iterable

import aiohttp

from llmgw.control.state import FleetState, NodeRecord
from llmgw.wire import NUDGE_PATH

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
    def __init__(self, token: str) -> None:
        self._token = token
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def nudge(self, nodes: Iterable[NodeRecord]) -> None:
        """Fire and forget: the reconcile loop never waits on an agent."""
        for node in nodes:
            if node.agent_port is None:
                continue
            task = asyncio.create_task(self._one(f"http://{node.address}:{node.agent_port}"))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _one(self, base: str) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=NUDGE_TIMEOUT_S)
            )
        try:
            async with self._session.post(
                base + NUDGE_PATH, headers={"Authorization": f"Bearer {self._token}"}
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
