"""LoRA adapters' weights fetched before any is asked for (AgentReportAnswer.prefetch).

The first request for an adapter waits for its load; a load whose weights
must first come over the network (the Hub, a peer) waits for the download
too. The control plane names the adapters of the bases this node runs, most
recently used first; they are fetched one at a time in the background,
verified as every copy is (agent.weights), each once per agent (the cache
keeps them as it keeps any model's, evictable when room is needed).
"""

from __future__ import annotations

import asyncio
import logging

from llmgw.agent.replicalaunch import fetch_weights
from llmgw.agent.runnerdeps import RunnerDeps
from llmgw.agent.weights import Progress
from llmgw.tasks import cancel_and_wait
from llmgw.wire import ModelSpec

log = logging.getLogger("llmgw.agent.prefetch")


class Prefetcher:
    def __init__(self) -> None:
        self.fetched: set[str] = set()  # "name weights-json", done or refused
        self._queue: list[ModelSpec] = []
        self._task: asyncio.Task[None] | None = None

    @staticmethod
    def _key(spec: ModelSpec) -> str:
        return f"{spec.name} {spec.weights.model_dump_json()}"

    def want(self, specs: list[ModelSpec], deps: RunnerDeps) -> None:
        """Fetch what of ``specs`` was not fetched yet, in their order (the answer's)."""
        self._queue = [s for s in specs if self._key(s) not in self.fetched]
        if self._queue and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._run(deps), name="adapter-prefetch")

    async def _run(self, deps: RunnerDeps) -> None:
        while self._queue:
            spec = self._queue.pop(0)
            key = self._key(spec)
            if key in self.fetched:
                continue
            try:
                await fetch_weights(deps, spec, Progress())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a load will try again and report it
                log.warning("prefetch of adapter %s: %s", spec.name, exc)
            self.fetched.add(key)

    async def close(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
