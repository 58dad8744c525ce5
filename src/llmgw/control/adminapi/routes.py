"""The admin API (``/admin/v1``): fleet views, catalog, nodes, keys, usage, events.

Every route takes the admin token and nothing else. The check runs before
FastAPI looks at the request at all, so a caller without it learns nothing
(not even whether its body would have parsed), and node tokens or API keys
never work here: one leaked node token must not become a leaked fleet.

Errors leave as ``{"error": {"message", "type", "code"}}``, translated here
once from llmgw's error tree, so the router behaves the same whichever app
mounts it. On a standby control-plane instance, writes are refused with 503
and the leader's URL (llmgw.control.standby); reads are served.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Body, Query, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError
from starlette.convertors import Convertor, register_url_convertor

from llmgw import secrets
from llmgw.control import secretenv
from llmgw.control.adminapi import schemas
from llmgw.control.adminapi.patroni import PatroniReader, patroni_urls_from_env
from llmgw.control.adminapi.summary import Summary
from llmgw.control.adminapi.summary_keeper import SummaryKeeper
from llmgw.control.adminapi.usagereport import add_usage_report_route
from llmgw.control.adminapi.views.models import ModelView, ReplicaTally, model_view
from llmgw.control.adminapi.views.nodes import NodeView, node_view, used_by_node
from llmgw.control.adminapi.views.replicas import ReplicaView, replica_view
from llmgw.control.gcpause import paused_gc
from llmgw.control.service import ControlPlane
from llmgw.control.standby import standby_response
from llmgw.errors import (
    AuthError,
    LlmgwError,
    NotFoundError,
    NotLeaderError,
    StandbyError,
    StoreError,
    ValidationError,
)
from llmgw.wire import ModelSpec, NodeState


class _NamePath(Convertor[str]):
    """Names that may hold slashes (``meta-llama/Llama-3-8B``) or anything else.

    Starlette's ``path`` convertor is ``.*``, which stops at a newline, so a
    name with an encoded newline matched no route and got the framework's own
    404 body instead of this API's error shape (found by schemathesis).
    """

    regex = "(?s:.*)"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("name", _NamePath())

_bearer = HTTPBearer(auto_error=False, description="The admin token (llmgw-admin-...).")

NodeStateName = Literal["ready", "cordoned", "draining", "unreachable"]
ReplicaStateName = Literal["starting", "ready", "draining", "failed"]

# Usage without a ``since`` covers the last hour: an unbounded default would
# make the first innocent call on a busy gateway read months of rows.
DEFAULT_USAGE_WINDOW_S = 3600


def error_response(status: int, message: str, kind: str, code: str | None = None) -> Response:
    body = orjson.dumps({"error": {"message": message, "type": kind, "code": code}})
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def _default(value: object) -> object:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", by_alias=True)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def json_response(value: object, status: int = 200) -> Response:
    """orjson straight from views: dataclasses need no conversion step."""
    return Response(orjson.dumps(value, default=_default), status_code=status,
                    media_type="application/json")


def json_of(build: Callable[[], object], status: int = 200) -> Response:
    """Build views and serialise them with the collector paused (see paused_gc)."""
    with paused_gc():
        body = orjson.dumps(build(), default=_default)
    return Response(body, status_code=status, media_type="application/json")


def _problems(errors: Sequence[Any]) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ())) or 'body'}: {e.get('msg', 'invalid')}"
        for e in errors
    )


def _admin_route_class(cp: ControlPlane) -> type[APIRoute]:
    class AdminRoute(APIRoute):
        """Checks the admin token first, then turns llmgw errors into JSON."""

        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            inner = super().get_route_handler()

            async def handler(request: Request) -> Response:
                token = secrets.bearer(request.headers.get("authorization"))
                if token is None:
                    return error_response(401, "an admin token is required "
                                          "(Authorization: Bearer llmgw-admin-...)",
                                          "authentication_error", "missing_token")
                if not cp.credentials.is_admin(token):
                    return error_response(401, "this token is not the admin token",
                                          "authentication_error", "invalid_token")
                try:
                    return await inner(request)
                except RequestValidationError as exc:
                    return error_response(422, _problems(exc.errors()),
                                          "invalid_request_error", "invalid_request")
                except PydanticValidationError as exc:
                    return error_response(422, _problems(exc.errors()),
                                          "invalid_request_error", "invalid_request")
                except ValidationError as exc:
                    return error_response(422, str(exc), "invalid_request_error",
                                          exc.field or "invalid_request")
                except NotFoundError as exc:
                    return error_response(404, str(exc), "not_found_error", "not_found")
                except AuthError as exc:
                    return error_response(401, str(exc), "authentication_error",
                                          "invalid_token")
                except NotLeaderError as exc:
                    # Refused for a stale epoch: this instance stepped down.
                    return await standby_response(cp.leader_hint, StandbyError(
                        f"this instance no longer leads: {exc}"))
                except StoreError as exc:
                    return error_response(503, str(exc), "store_error", "store_unavailable")
                except StandbyError as exc:
                    return await standby_response(cp.leader_hint, exc)
                except LlmgwError as exc:
                    return error_response(400, str(exc), "invalid_request_error", None)

            return handler

    return AdminRoute


def build_admin_router(
    cp: ControlPlane, *, patroni_urls: Sequence[str] | None = None
) -> APIRouter:
    """The admin API, to be mounted at ``/admin/v1``.

    ``patroni_urls`` default to ``LLMGW_PATRONI_URL`` (comma-separated); the
    summary lists the store's members from them.
    """
    patroni = PatroniReader(patroni_urls if patroni_urls is not None
                            else patroni_urls_from_env())
    router = APIRouter(
        route_class=_admin_route_class(cp),
        dependencies=[Security(_bearer)],
        responses={
            401: {"model": schemas.ErrorBody, "description": "No admin token, or a wrong one"},
            422: {"model": schemas.ErrorBody, "description": "Invalid request"},
        },
    )
    state = cp.state
    not_found: dict[int | str, dict[str, Any]] = {
        404: {"model": schemas.ErrorBody, "description": "No such thing"}
    }

    # -- summary ---------------------------------------------------------------

    # fleet_summary's answer, kept between calls (summary_keeper.py).
    kept_summary = SummaryKeeper().summary_json

    @router.get("/summary", response_model=Summary, tags=["fleet"])
    async def get_summary() -> Response:
        """The whole fleet in one answer."""
        store = await patroni.status()
        with paused_gc():  # see paused_gc: the bytes are made before the views are freed
            body = kept_summary(state, time.time(), store)
        return Response(body, media_type="application/json")

    # -- nodes -------------------------------------------------------------------

    def _node(name: str) -> NodeView:
        record = state.nodes.get(name)
        if record is None:
            raise NotFoundError(f"node {name!r} does not exist")
        return node_view(record, time.time(), used_by_node(state).get(name, {}))

    @router.get("/nodes", response_model=list[NodeView], tags=["nodes"])
    async def list_nodes(
        node_state: Annotated[NodeStateName | None, Query(alias="state")] = None,
        fabric: str | None = None,
        gpu_class: str | None = None,
        name: Annotated[str | None, Query(max_length=200)] = None,
        offset: Annotated[int, Query(ge=0)] = 0,
        limit: Annotated[int | None, Query(ge=1, le=10_000)] = None,
    ) -> Response:
        """Nodes with their devices by class (MIG instances as ``card/migN``).

        ``name`` keeps nodes whose name contains it (any case); ``offset``/
        ``limit`` page the filtered list, whose length is in ``X-Total-Count``
        (the fleet's in ``X-Fleet-Count``). Filters
        run on the cheap per-node counts; device lists are built only for the
        page, which is what keeps a 2,000-node console page fast.
        """
        now = time.time()
        used = used_by_node(state)

        names: list[str] = []
        needle = name.lower() if name else None
        for node_name in sorted(state.nodes):
            record = state.nodes[node_name]
            if needle and needle not in node_name.lower():
                continue
            if node_state is not None and record.state(now) != node_state:
                continue
            if fabric is not None and fabric not in record.fabrics:
                continue
            if gpu_class is not None:
                counts = node_view(record, now, used.get(node_name, {}), with_devices=False)
                if not any(c.gpu_class == gpu_class for c in counts.classes):
                    continue
            names.append(node_name)
        page = names[offset:] if limit is None else names[offset : offset + limit]
        response = json_of(
            lambda: [node_view(state.nodes[n], now, used.get(n, {})) for n in page]
        )
        response.headers["X-Total-Count"] = str(len(names))
        response.headers["X-Fleet-Count"] = str(len(state.nodes))
        return response

    @router.get("/nodes/{name:name}", response_model=NodeView, responses=not_found,
                tags=["nodes"])
    async def get_node(name: str) -> Response:
        return json_response(_node(name))

    async def _set_node(name: str, target: NodeState) -> Response:
        await cp.nodes.set_state(name, target)
        return json_response(_node(name))

    @router.post("/nodes/{name:name}/cordon", response_model=NodeView, responses=not_found,
                 tags=["nodes"])
    async def cordon(name: str) -> Response:
        """Place nothing new here; replicas stay."""
        return await _set_node(name, NodeState.CORDONED)

    @router.post("/nodes/{name:name}/uncordon", response_model=NodeView, responses=not_found,
                 tags=["nodes"])
    async def uncordon(name: str) -> Response:
        return await _set_node(name, NodeState.READY)

    @router.post("/nodes/{name:name}/drain", response_model=NodeView, responses=not_found,
                 tags=["nodes"])
    async def drain_node(name: str) -> Response:
        """Place nothing new here and move its replicas away (make before break)."""
        return await _set_node(name, NodeState.DRAINING)

    @router.put("/nodes/{name:name}/fabrics", response_model=NodeView, responses=not_found,
                tags=["nodes"])
    async def pin_fabrics(name: str, body: schemas.NodeFabrics) -> Response:
        """Set a node's fabrics; its reports no longer change them."""
        await cp.nodes.set_fabrics(name, body.fabrics)
        return json_response(_node(name))

    @router.delete("/nodes/{name:name}/fabrics", response_model=NodeView, responses=not_found,
                   tags=["nodes"])
    async def unpin_fabrics(name: str) -> Response:
        """Let a node's reports decide its fabrics again."""
        await cp.nodes.set_fabrics(name, None)
        return json_response(_node(name))

    @router.post("/nodes/{name:name}/approve", response_model=NodeView, responses=not_found,
                 tags=["nodes"])
    async def approve_node(name: str) -> Response:
        """Accept a node held by ``serve --approve-nodes``: uncordon it and let it copy weights."""
        await cp.nodes.approve(name)
        return json_response(_node(name))

    @router.delete("/nodes/{name:name}", response_model=schemas.Done, responses=not_found,
                   tags=["nodes"])
    async def delete_node(name: str) -> Response:
        """Forget a node (its agent must register again with a join token)."""
        await cp.nodes.delete(name)
        return json_response(schemas.Done(message=f"node {name} removed"))

    # -- replicas --------------------------------------------------------------------

    @router.get("/replicas", response_model=list[ReplicaView], tags=["replicas"])
    async def list_replicas(
        model: str | None = None,
        node: str | None = None,
        replica_state: Annotated[ReplicaStateName | None, Query(alias="state")] = None,
    ) -> Response:
        now = time.time()
        return json_of(lambda: [
            replica_view(state.replicas[rid], state.nodes, now)
            for rid in sorted(state.replicas)
            if (model is None or state.replicas[rid].model == model)
            and (node is None or node in state.replicas[rid].nodes)
            and (replica_state is None or state.replicas[rid].state == replica_state)
        ])

    @router.get("/replicas/{replica_id:name}", response_model=ReplicaView, responses=not_found,
                tags=["replicas"])
    async def get_replica(replica_id: str) -> Response:
        replica = state.replicas.get(replica_id)
        if replica is None:
            raise NotFoundError(f"replica {replica_id!r} does not exist")
        return json_response(replica_view(replica, state.nodes, time.time()))

    @router.post("/replicas/{replica_id:name}/drain", response_model=ReplicaView,
                 responses=not_found, tags=["replicas"])
    async def drain_replica(replica_id: str) -> Response:
        """Stop routing to it; in-flight requests finish, then it stops."""
        replica = await cp.replicas.drain(replica_id)
        return json_response(replica_view(replica, state.nodes, time.time()))

    # -- models ----------------------------------------------------------------------

    def _model(name: str) -> ModelView:
        record = state.models.get(name)
        if record is None:
            raise NotFoundError(f"model {name!r} does not exist")
        now = time.time()
        replicas = [replica_view(r, state.nodes, now) for r in state.replicas_of(name)]
        return model_view(record, ReplicaTally(replicas), now)

    @router.get("/models", response_model=list[ModelView], tags=["models"])
    async def list_models() -> Response:
        def build() -> list[ModelView]:
            now = time.time()
            tally = ReplicaTally(replica_view(r, state.nodes, now)
                                 for r in state.replicas.values())
            return [model_view(state.models[n], tally, now) for n in sorted(state.models)]

        return json_of(build)

    @router.get("/models/{name:name}", response_model=ModelView, responses=not_found,
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

    @router.delete("/models/{name:name}", response_model=schemas.Done, responses=not_found,
                   tags=["models"])
    async def delete_model(name: str) -> Response:
        """Remove a model and stop its replicas."""
        await cp.catalog.delete(name)
        return json_response(schemas.Done(message=f"model {name} deleted"))

    @router.post("/models/{name:name}/unpark", response_model=ModelView, responses=not_found,
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
        validate_catalog(restored, {n: m.spec for n, m in state.models.items()})
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

    # -- plan ------------------------------------------------------------------------

    @router.get("/plan", response_model=dict[str, Any], tags=["plan"])
    async def get_plan() -> Response:
        """The reconciler's next pass as a dry run: where each model would go and why not."""
        return json_response(_plan(None))

    @router.post("/plan", response_model=dict[str, Any], tags=["plan"])
    async def what_if(body: schemas.CatalogInput) -> Response:
        """The plan if these entries were added to the catalog (nothing is changed)."""
        return json_response(_plan(_specs(body)))

    # -- events ------------------------------------------------------------------------

    @router.get("/events", response_model=list[schemas.EventView], tags=["events"])
    async def list_events(
        kind: str | None = None,
        subject: str | None = None,
        since: Annotated[int, Query(ge=0, le=2**62, description="after this event id")] = 0,
        limit: Annotated[int, Query(ge=1, le=1000)] = 200,
    ) -> Response:
        """The latest events after ``since``, oldest first."""
        rows = await cp.store.list_events(since_id=since, kind=kind, subject=subject,
                                          limit=limit)
        return json_response([schemas.event_view(r) for r in reversed(rows)])

    # -- API keys ---------------------------------------------------------------------

    @router.post("/keys", response_model=schemas.KeyCreated, status_code=201, tags=["keys"])
    async def create_key(body: schemas.KeyCreate) -> Response:
        """A new API key; its secret is in this answer and nowhere else, ever."""
        info, secret = await cp.keys.create(
            name=body.name, models=body.models, expires_at=body.expires_at,
            rpm=body.rpm, tpm=body.tpm,
        )
        return json_response(schemas.KeyCreated(key=schemas.key_view(info), secret=secret),
                             status=201)

    @router.get("/keys", response_model=list[schemas.KeyView], tags=["keys"])
    async def list_keys() -> Response:
        return json_response([schemas.key_view(k) for k in cp.keys.all()])

    @router.delete("/keys/{key_id}", response_model=schemas.KeyView, responses=not_found,
                   tags=["keys"])
    async def revoke_key(key_id: str) -> Response:
        await cp.keys.revoke(key_id)
        info = next((k for k in cp.keys.all() if k.key_id == key_id), None)
        if info is None:
            raise NotFoundError(f"API key {key_id!r} does not exist")
        return json_response(schemas.key_view(info))

    # -- usage ---------------------------------------------------------------------------

    @router.get("/usage", response_model=schemas.UsageAnswer, tags=["usage"])
    async def usage(
        since: Annotated[int | None, Query(ge=0, le=2**40,
                                           description="unix time; default: an hour ago")] = None,
        key_id: str | None = None,
        model: str | None = None,
    ) -> Response:
        """Requests and tokens per minute, key and model, with totals."""
        start = since if since is not None else int(time.time()) - DEFAULT_USAGE_WINDOW_S
        rows = await cp.store.query_usage(since=start // 60 * 60, key_id=key_id, model=model)
        return json_response(schemas.usage_answer(start, rows))

    add_usage_report_route(router, cp)

    # -- credentials -----------------------------------------------------------------

    @router.post("/join-token/rotate", response_model=schemas.JoinToken, tags=["credentials"])
    async def rotate_join_token() -> Response:
        """A new join token; the old one stops working (registered nodes keep theirs)."""
        return json_response(schemas.JoinToken(join_token=await cp.credentials.rotate_join_token()))

    @router.post("/admin-token/rotate", response_model=schemas.RotatedToken,
                 tags=["credentials"])
    async def rotate_admin_token() -> Response:
        """A new admin token; this one stops working (a standby follows within seconds)."""
        return json_response(schemas.RotatedToken(token=await cp.credentials.rotate_token("admin")))

    @router.post("/gateway-token/rotate", response_model=schemas.RotatedToken,
                 tags=["credentials"])
    async def rotate_gateway_token() -> Response:
        """A new gateway token; standalone gateways need it before their next sync."""
        token = await cp.credentials.rotate_token("gateway")
        return json_response(schemas.RotatedToken(token=token))

    @router.get("/join-tokens", response_model=list[schemas.JoinTokenView],
                tags=["credentials"])
    async def list_join_tokens() -> Response:
        """Join tokens (never their secrets), newest first."""
        now = time.time()
        tokens = sorted(cp.credentials.join_tokens.tokens.values(), key=lambda t: -t.created_at)
        return json_response([t.view(now) for t in tokens])

    @router.post("/join-tokens", response_model=schemas.JoinTokenCreated, status_code=201,
                 tags=["credentials"])
    async def create_join_token(body: schemas.JoinTokenCreate) -> Response:
        """A new join token (the others keep working); its secret is in this answer only."""
        ttl = cp.credentials.join_token_ttl_s if body.ttl_s is None else (body.ttl_s or None)
        token, secret = await cp.credentials.create_join_token(ttl_s=ttl, max_uses=body.uses,
                                                   description=body.description)
        return json_response({"token": token.view(time.time()), "join_token": secret},
                             status=201)

    @router.delete("/join-tokens/{token_id}", response_model=schemas.JoinTokenView,
                   responses=not_found, tags=["credentials"])
    async def revoke_join_token(token_id: str) -> Response:
        """Stop a join token from working (nodes registered with it keep their own tokens)."""
        token = await cp.credentials.revoke_join_token(token_id)
        return json_response(token.view(time.time()))

    return router

