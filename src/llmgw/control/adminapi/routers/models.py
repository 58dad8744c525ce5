"""``/models``, ``/apply`` and ``/plan``: the catalog, changed entry by entry or from a
document, and the reconciler's next pass as a dry run (with or without the change)."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Body
from fastapi.responses import Response
from fastapi.routing import APIRoute

from llmgw.control import secretenv
from llmgw.control.adminapi import schemas
from llmgw.control.adminapi.adminroute import NOT_FOUND, json_of, json_response
from llmgw.control.adminapi.views.models import ModelView, ReplicaTally, model_view
from llmgw.control.adminapi.views.replicas import replica_view
from llmgw.control.plane import ControlPlane
from llmgw.control.services.core import found
from llmgw.errors import ValidationError
from llmgw.wire import ModelSpec


def models_router(cp: ControlPlane, route_class: type[APIRoute]) -> APIRouter:
    router = APIRouter(route_class=route_class)
    state = cp.state

    def _model(name: str) -> ModelView:
        record = found(state.models, name, "model")
        now = time.time()
        # An adapter's replicas are its base's (those with it loaded count).
        replicas = [replica_view(r, state.nodes, now)
                    for r in state.replicas_of(record.spec.base or name)]
        return model_view(record, ReplicaTally(replicas), now)

    @router.get("/models", response_model=list[ModelView], tags=["models"])
    async def list_models() -> Response:
        def build() -> list[ModelView]:
            now = time.time()
            tally = ReplicaTally(replica_view(r, state.nodes, now)
                                 for r in state.replicas.values())
            return [model_view(state.models[n], tally, now) for n in sorted(state.models)]

        return json_of(build)

    @router.get("/models/{name:name}", response_model=ModelView, responses=NOT_FOUND,
                tags=["models"])
    async def get_model(name: str) -> Response:
        return json_response(_model(name))

    @router.put("/models/{name:name}", response_model=ModelView, tags=["models"])
    async def put_model(name: str, spec: Annotated[ModelSpec, Body()]) -> Response:
        """Add or replace one catalog entry."""
        if spec.name != name:
            raise ValidationError(
                f"the entry is named {spec.name!r} but the URL names {name!r}", field="name"
            )
        await cp.catalog.put(_validate([spec]))
        return json_response(_model(name))

    @router.delete("/models/{name:name}", response_model=schemas.Done, responses=NOT_FOUND,
                   tags=["models"])
    async def delete_model(name: str) -> Response:
        """Remove a model and stop its replicas."""
        await cp.catalog.delete(name)
        return json_response(schemas.Done(message=f"model {name} deleted"))

    @router.post("/models/{name:name}/unpark", response_model=ModelView, responses=NOT_FOUND,
                 tags=["models"])
    async def unpark(name: str) -> Response:
        """Retry a parked model from zero failures."""
        await cp.catalog.unpark(name)
        return json_response(_model(name))

    def _validate(specs: list[ModelSpec]) -> list[ModelSpec]:
        """The entries checked, with secrets read back as redacted put back."""
        from llmgw.control.catalog import validate_catalog

        restored = []
        for spec in specs:
            secretenv.check(spec)
            current = state.models.get(spec.name)
            restored.append(secretenv.restore(spec, current.spec if current else None))
        node_env_allow = {
            name
            for node in state.nodes.values()
            if node.inventory is not None
            for name in node.inventory.engine_env_allow
        }
        validate_catalog(restored, {n: m.spec for n, m in state.models.items()}, node_env_allow)
        return restored

    def _specs(body: schemas.CatalogInput) -> list[ModelSpec]:
        if (body.models is None) == (body.document is None):
            raise ValidationError("give either 'models' (entries) or 'document' "
                                  "(YAML or JSON text), not both or neither")
        if body.models is not None:
            specs = list(body.models)
        else:
            from llmgw.control.catalog import parse_models

            specs = parse_models(body.document or "", source=body.source)
        if not specs:
            raise ValidationError("the document holds no model entries", field="models")
        return _validate(specs)

    def _plan(what_if: list[ModelSpec] | None) -> dict[str, Any]:
        from llmgw.control.scheduler.planner import plan

        return plan(state, time.time(), what_if=what_if, policy=cp.policy).model_dump(mode="json")

    @router.post("/apply", response_model=schemas.ApplyResult, tags=["models"])
    async def apply(body: schemas.CatalogInput) -> Response:
        """Add or change catalog entries from a document; ``dry_run`` shows the
        diff and what the planner would do without changing anything."""
        from llmgw.control.catalog import diff_catalog

        specs = _specs(body)
        diff = diff_catalog({n: m.spec for n, m in state.models.items()}, specs)
        result = schemas.ApplyResult(
            dry_run=body.dry_run,
            added=list(diff.added),
            changed=list(diff.changed),
            unchanged=list(diff.unchanged),
            changed_fields=dict(diff.changed_fields),
        )
        if body.dry_run:
            result.plan = _plan(specs)
        else:
            await cp.catalog.put(specs)
        return json_response(result)

    @router.get("/plan", response_model=dict[str, Any], tags=["plan"])
    async def get_plan() -> Response:
        """The reconciler's next pass as a dry run: where each model would go and why not."""
        return json_response(_plan(None))

    @router.post("/plan", response_model=dict[str, Any], tags=["plan"])
    async def what_if(body: schemas.CatalogInput) -> Response:
        """The plan if these entries were added to the catalog (nothing is changed)."""
        return json_response(_plan(_specs(body)))

    return router
