"""The replicas this node runs, converged on what the control plane last answered.

Convergence starts what is missing, stops what is no longer asked for and
replaces a replica whose generation changed. A replica that replaces another
(same id, or the same devices) starts only once the old one's engine has
stopped, so two engines never hold one GPU's memory at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping

from llmgw.agent.assignments import check_assignments
from llmgw.agent.engines.base import EngineAdapter
from llmgw.agent.prefetch import Prefetcher
from llmgw.agent.replicas import ReplicaRunner
from llmgw.agent.runnerdeps import RunnerDeps
from llmgw.agent.state import EngineRecord
from llmgw.wire import Device, EngineKind, NodeInventory, ReplicaAssignment

log = logging.getLogger("llmgw.agent")


class ReplicaSet:
    def __init__(self, adapters: Mapping[EngineKind, EngineAdapter]) -> None:
        self.adapters = adapters
        self.runners: dict[str, ReplicaRunner] = {}
        # Replica id -> why this node will not run it, as the last answer asked.
        self.refused: dict[str, str] = {}
        self._stopping: set[asyncio.Task[None]] = set()
        self._stop_tasks: dict[str, asyncio.Task[None]] = {}
        self._stopping_devices: dict[str, set[int]] = {}
        # Adapters' weights ahead of need (the answer's prefetch list).
        self.prefetch = Prefetcher()

    def converge(
        self,
        assignments: Iterable[ReplicaAssignment],
        *,
        node: str,
        inventory: NodeInventory,
        deps: RunnerDeps,
    ) -> bool:
        """Start what is missing, stop what is not asked for, replace new generations.

        True when a replica started or stopped (the next report should go soon).
        """
        wanted: dict[str, ReplicaAssignment] = {}
        for assignment in assignments:
            wanted.setdefault(assignment.replica_id, assignment)
        kept: dict[str, ReplicaRunner] = {}
        for rid, runner in self.runners.items():
            target = wanted.get(rid)
            if target is not None and target.generation == runner.generation:
                runner.assignment = target  # e.g. the draining flag
                runner.control.poke.set()  # its adapters and sleep (agent.loras)
                kept[rid] = runner
        held = {d.number: rid for rid, r in kept.items() for d in r.devices}
        fresh = [a for rid, a in wanted.items() if rid not in kept]
        checked = check_assignments(
            fresh,
            node=node,
            inventory=inventory,
            adapters=self.adapters,
            held=held,
        )
        for rid, reason in checked.refused.items():
            if self.refused.get(rid) != reason:  # once, not on every report
                log.warning("refused replica %s: %s", rid, reason)
        self.refused = checked.refused
        for rid, runner in list(self.runners.items()):
            if rid not in kept:
                self._begin_stop(runner)
                del self.runners[rid]
        for rid, accepted in checked.accepted.items():
            numbers = {d.number for d in accepted.devices}
            after = [
                task
                for other, task in self._stop_tasks.items()
                if not task.done() and (other == rid or other in self._device_owners(numbers))
            ]
            runner = ReplicaRunner(
                accepted.assignment, accepted.adapter, accepted.devices, deps, after=after
            )
            self.runners[rid] = runner
            runner.start()
            log.info("starting replica %s (%s)", rid, accepted.assignment.model.name)
        return bool(checked.accepted) or len(kept) != len(self.runners)

    def adopt(self, records: Mapping[str, EngineRecord], deps: RunnerDeps) -> None:
        """Take over the engines a previous agent on this data dir left running."""
        for rid, record in records.items():
            assignment = record.assignment
            adapter = self.adapters.get(assignment.model.engine)
            if adapter is None:
                continue
            runner = ReplicaRunner(assignment, adapter, [], deps)
            runner.devices = _devices_of(assignment)
            runner.adopt(record)
            self.runners[rid] = runner
            log.info("adopted replica %s: %s", rid, runner.state.value)

    async def close(self, stop_engines: bool) -> None:
        """Stop every engine, or leave them running for the next agent to adopt."""
        await self.prefetch.close()
        runners, self.runners = list(self.runners.values()), {}
        if stop_engines:
            await asyncio.gather(*(r.stop() for r in runners), return_exceptions=True)
        else:
            await asyncio.gather(*(r.detach() for r in runners), return_exceptions=True)
        if self._stopping:
            await asyncio.gather(*self._stopping, return_exceptions=True)

    def _device_owners(self, numbers: set[int]) -> set[str]:
        return {rid for rid, devices in self._stopping_devices.items() if numbers & devices}

    def _begin_stop(self, runner: ReplicaRunner) -> None:
        log.info("stopping replica %s (%s)", runner.replica_id, runner.assignment.model.name)
        task = asyncio.create_task(runner.stop(), name=f"stop-{runner.replica_id}")
        self._stopping.add(task)
        self._stop_tasks[runner.replica_id] = task
        self._stopping_devices[runner.replica_id] = {d.number for d in runner.devices}

        def done(finished: asyncio.Task[None]) -> None:
            self._stopping.discard(finished)
            if self._stop_tasks.get(runner.replica_id) is finished:
                del self._stop_tasks[runner.replica_id]
                self._stopping_devices.pop(runner.replica_id, None)

        task.add_done_callback(done)


def _devices_of(assignment: ReplicaAssignment) -> list[Device]:
    """Device stand-ins for an adopted replica, enough to keep its devices claimed."""
    uuids = assignment.shard.device_uuids or [""] * len(assignment.shard.device_numbers)
    return [
        Device(number=n, label=str(n), uuid=u, name="", gpu_class="")
        for n, u in zip(assignment.shard.device_numbers, uuids, strict=False)
    ]
