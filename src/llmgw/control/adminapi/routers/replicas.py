"""``/replicas``: list, look at and drain replicas."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from fastapi import APIRouter, Query
from fastapi.responses import Response
from fastapi.routing import APIRoute

from llmgw.control.adminapi.adminroute import NOT_FOUND, json_of, json_response
from llmgw.control.adminapi.views.replicas import ReplicaView, replica_view
from llmgw.control.plane import ControlPlane
from llmgw.control.services.core import found

ReplicaStateName = Literal["starting", "ready", "draining", "failed"]


def replicas_router(cp: ControlPlane, route_class: type[APIRoute]) -> APIRouter:
    router = APIRouter(route_class=route_class)
    state = cp.state

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

    @router.get("/replicas/{replica_id:name}", response_model=ReplicaView, responses=NOT_FOUND,
                tags=["replicas"])
    async def get_replica(replica_id: str) -> Response:
        replica = found(state.replicas, replica_id, "replica")
        return json_response(replica_view(replica, state.nodes, time.time()))

    @router.post("/replicas/{replica_id:name}/drain", response_model=ReplicaView,
                 responses=NOT_FOUND, tags=["replicas"])
    async def drain_replica(replica_id: str) -> Response:
        """Stop routing to it; in-flight requests finish, then it stops."""
        replica = await cp.replicas.drain(replica_id)
        return json_response(replica_view(replica, state.nodes, time.time()))

    return router
