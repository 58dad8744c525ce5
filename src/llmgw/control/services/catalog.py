"""The catalog: models added, changed, deleted and unparked, and the demand for them.

Which changes restart engines is control.catalog's rule (engine_changed);
this applies it to the fleet and writes the outcome.
"""

from __future__ import annotations

import time

from llmgw.control.adaptercheck import dependents
from llmgw.control.catalog import engine_changed
from llmgw.control.reconciler import unpark
from llmgw.control.rows import model_row, replica_row
from llmgw.control.services.core import Core, found
from llmgw.control.state import ModelRecord, ReplicaRecord
from llmgw.control.store.repo import Row
from llmgw.errors import NotFoundError, ValidationError
from llmgw.wire import ModelSpec, ReplicaState


class Catalog:
    def __init__(self, core: Core) -> None:
        self.core = core

    async def put(self, specs: list[ModelSpec]) -> tuple[list[str], list[str]]:
        """Add or replace catalog entries (already validated). Returns (added, changed)."""
        core, state = self.core, self.core.state
        core.require_leader()
        now = time.time()
        added: list[str] = []
        changed: list[str] = []
        rows: list[Row] = []
        bumps: list[ReplicaRecord] = []
        for spec in specs:
            current = state.models.get(spec.name)
            if current is None:
                record = ModelRecord(spec=spec, created_at=now, updated_at=now)
                added.append(spec.name)
            elif current.spec != spec:
                record = current
                # A changed entry restarts its replicas with the new settings,
                # unless only what the gateway reads changed (the routing
                # table carries that): a new output cap restarts no engine.
                if engine_changed(record.spec, spec):
                    # Draining and failed ones are on their way out already.
                    for replica in state.replicas_of(spec.name):
                        if replica.can_move_to(ReplicaState.STARTING):
                            replica.restart()
                            bumps.append(replica)
                record.spec = spec
                record.updated_at = now
                changed.append(spec.name)
            else:
                continue
            state.models[spec.name] = record
            rows.append(model_row(record))
        await core.writes.upsert_models(rows)
        if bumps:
            await core.writes.write_replicas([replica_row(r) for r in bumps])
        for name in added:
            await core.event("catalog", name, f"model {name} added")
        for name in changed:
            await core.event("catalog", name, f"model {name} changed")
        if rows:
            await state.bump_routing()
            core.wake_reconciler()
        return added, changed

    async def delete(self, name: str) -> None:
        core, state = self.core, self.core.state
        core.require_leader()
        found(state.models, name, "model")
        adapters = dependents(name, {n: m.spec for n, m in state.models.items()})
        if adapters:
            raise ValidationError(
                f"model {name!r} is the base of adapter(s) {', '.join(adapters)}:"
                " delete them first"
            )
        doomed = [r.id for r in state.replicas_of(name)]
        await core.writes.write_replicas([], doomed)
        await core.writes.delete_models([name])
        for replica_id in doomed:
            del state.replicas[replica_id]
        del state.models[name]
        await core.event("catalog", name, f"model {name} deleted with {len(doomed)} replica(s)")
        await state.bump_routing()

    async def unpark(self, name: str) -> None:
        core = self.core
        core.require_leader()
        model = unpark(core.state, name)
        await core.writes.upsert_models([model_row(model)])
        await core.event("unpark", name, f"model {name} unparked")
        await core.state.bump_routing()
        core.wake_reconciler()

    async def demand(self, model_name: str) -> None:
        core, state = self.core, self.core.state
        core.require_leader()
        model = state.resolve_model(model_name)
        if model is None:
            raise NotFoundError(f"model {model_name!r} does not exist")
        first = model.demand_at is None or not any(
            r.state != ReplicaState.FAILED for r in state.replicas_of(model.name)
        )
        model.demand_at = time.time()
        base = state.models.get(model.spec.base) if model.spec.base else None
        if base is not None:
            # An adapter is served by its base: an on-demand base starts (or
            # wakes) for it, and an always-on one stays in use.
            base.demand_at = model.demand_at
        # The pass reads demand from memory: woken first, it places the
        # replica while the demand is written, instead of after (two store
        # writes, 20-100 ms of a cold start here, measured by bench/coldstart.py).
        core.wake_reconciler()
        if first:
            await core.writes.upsert_models([model_row(model)])
            await core.event("demand", model.name, f"a request asked for {model.name}")
