"""``/nodes``: list, look at, cordon, drain, pin fabrics, approve and forget nodes."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Literal

from fastapi import APIRouter, Query
from fastapi.responses import Response
from fastapi.routing import APIRoute

from llmgw.control.adminapi import schemas
from llmgw.control.adminapi.adminroute import NOT_FOUND, json_of, json_response
from llmgw.control.adminapi.views.nodes import NodeView, node_view, used_by_node
from llmgw.control.plane import ControlPlane
from llmgw.control.services.core import found
from llmgw.wire import NodeState

NodeStateName = Literal["ready", "cordoned", "draining", "unreachable"]


def nodes_router(cp: ControlPlane, route_class: type[APIRoute]) -> APIRouter:
    router = APIRouter(route_class=route_class)
    state = cp.state

    def _node(name: str) -> NodeView:
        record = found(state.nodes, name, "node")
        return node_view(record, time.time(), used_by_node(state).get(name, {}))

    def _state_setter(target: NodeState) -> Callable[[str], Awaitable[Response]]:
        async def set_state(name: str) -> Response:
            await cp.nodes.set_state(name, target)
            return json_response(_node(name))

        return set_state

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

    @router.get("/nodes/{name:name}", response_model=NodeView, responses=NOT_FOUND,
                tags=["nodes"])
    async def get_node(name: str) -> Response:
        return json_response(_node(name))

    # The three states an operator sets, each its own verb in the URL.
    for verb, route_name, target, doc in (
        ("cordon", "cordon", NodeState.CORDONED, "Place nothing new here; replicas stay."),
        ("uncordon", "uncordon", NodeState.READY, None),
        ("drain", "drain_node", NodeState.DRAINING,
         "Place nothing new here and move its replicas away (make before break)."),
    ):
        router.post(f"/nodes/{{name:name}}/{verb}", response_model=NodeView,
                    responses=NOT_FOUND, tags=["nodes"], name=route_name,
                    description=doc)(_state_setter(target))

    @router.put("/nodes/{name:name}/fabrics", response_model=NodeView, responses=NOT_FOUND,
                tags=["nodes"])
    async def pin_fabrics(name: str, body: schemas.NodeFabrics) -> Response:
        """Set a node's fabrics; its reports no longer change them."""
        await cp.nodes.set_fabrics(name, body.fabrics)
        return json_response(_node(name))

    @router.delete("/nodes/{name:name}/fabrics", response_model=NodeView, responses=NOT_FOUND,
                   tags=["nodes"])
    async def unpin_fabrics(name: str) -> Response:
        """Let a node's reports decide its fabrics again."""
        await cp.nodes.set_fabrics(name, None)
        return json_response(_node(name))

    @router.post("/nodes/{name:name}/approve", response_model=NodeView, responses=NOT_FOUND,
                 tags=["nodes"])
    async def approve_node(name: str) -> Response:
        """Accept a node held by ``serve --approve-nodes``: uncordon it and let it copy weights."""
        await cp.nodes.approve(name)
        return json_response(_node(name))

    @router.get("/addresses", response_model=list[schemas.AddressClaim], tags=["nodes"])
    async def list_addresses() -> Response:
        """Which node each address is bound to, for the server certificate that names it."""
        rows = await cp.store.list_address_claims()
        return json_response([schemas.AddressClaim(**row) for row in rows])

    @router.delete("/addresses/{address}", response_model=schemas.Done, responses=NOT_FOUND,
                   tags=["nodes"])
    async def free_address(address: str) -> Response:
        """Unbind an address from its node: the next node to report it may be given it."""
        owner = await cp.nodes.free_address(address)
        return json_response(schemas.Done(message=f"address {address} freed (was node {owner}'s)"))

    # After /nodes/{name}/fabrics: the name convertor takes slashes, so this
    # route would match "x/fabrics" if it came first.
    @router.delete("/nodes/{name:name}", response_model=schemas.Done, responses=NOT_FOUND,
                   tags=["nodes"])
    async def delete_node(name: str) -> Response:
        """Forget a node (its agent must register again with a join token)."""
        await cp.nodes.delete(name)
        return json_response(schemas.Done(message=f"node {name} removed"))

    return router
