"""Which replicas serve the OpenAI routes beyond chat and completions.

Every engine serves chat and completions; ``/v1/responses``, ``/v1/rerank``,
``/v1/score`` and ``/v1/audio/transcriptions`` only some do, as each
engine's adapter declares (``wire.EngineDialect.extra_routes``, which
reaches the gateway with every endpoint), and ``/v1/embeddings`` all but
those that say otherwise (``wire.EngineDialect.embeddings``: llama.cpp
computes embeddings only when started for them). Without this a request for
a route the engine lacks gets the engine's own error in its own words
(llama-server's ``File Not Found``, llama_cpp.server's 500 "Llama model must
be created with embedding=True"), or worse a 200 from a catch-all; with it
the gateway answers OpenAI's 404 saying that the model does not serve the
route, before anything is sent.

Decided once per config version (:class:`RouteSupport`, built with the
snapshot): a model whose replicas all serve a route routes as usual; one
whose replicas partly do gets a router over those that do (sharing the
model's prefix index and replicas, so load and cool-downs are the same
objects); one whose replicas serve it nowhere gets a 404. A model with no
replica yet (on demand, not started) is let through: its request waits for
a replica like any other, and is refused then if that replica does not
serve the route.
"""

from __future__ import annotations

import copy

from llmgw import wire
from llmgw.gateway.replies import ApiError
from llmgw.gateway.routing.replica import Replica
from llmgw.gateway.routing.router import ModelRouter
from llmgw.wire import EXTRA_ROUTES

EMBEDDINGS = "/v1/embeddings"
# The routes some engines lack: the extra routes, and embeddings.
OPTIONAL_ROUTES = (*EXTRA_ROUTES, EMBEDDINGS)


def serves(dialect: wire.EngineDialect | None, path: str) -> bool:
    """Whether an endpoint of this dialect serves ``path`` (one of OPTIONAL_ROUTES).

    An endpoint that declares nothing (an older agent, an external server
    without a dialect) gets every route, and answers for itself.
    """
    if dialect is None:
        return True
    if path == EMBEDDINGS:
        return dialect.embeddings
    if dialect.extra_routes is None:
        return True
    return path in dialect.extra_routes


def not_served(model: str, path: str) -> ApiError:
    """OpenAI's 404 for a model none of whose engines offers ``path``."""
    return ApiError(
        404,
        f"The model `{model}` does not serve {path}: its engine does not offer this route.",
        param="model",
        code="model_not_found",
    )


def _narrowed(router: ModelRouter, replicas: list[Replica]) -> ModelRouter:
    # A shallow copy: the prefix index, the policy and the replicas
    # themselves stay the model's, only the candidates differ.
    narrowed = copy.copy(router)
    narrowed.replicas = replicas
    return narrowed


class RouteSupport:
    """The extra routes' routers of one config version, and the replicas refusing each."""

    __slots__ = ("_refused", "_routers")

    def __init__(self) -> None:
        # (model, path) -> its router for the route, or None: no replica serves it.
        # Only models whose replicas do not all serve the route are here.
        self._routers: dict[tuple[str, str], ModelRouter | None] = {}
        self._refused: set[tuple[str, str]] = set()  # (replica id, path)

    def add(self, route: wire.ModelRoute, router: ModelRouter) -> None:
        """Note what ``route``'s endpoints serve (``router.replicas`` in endpoint order)."""
        pairs = list(zip(router.replicas, route.endpoints, strict=True))
        for path in OPTIONAL_ROUTES:
            fit = [replica for replica, endpoint in pairs if serves(endpoint.dialect, path)]
            if len(fit) == len(pairs):
                continue
            self._refused.update(
                (endpoint.replica_id, path)
                for _, endpoint in pairs
                if not serves(endpoint.dialect, path)
            )
            self._routers[(route.name, path)] = _narrowed(router, fit) if fit else None

    def router(self, router: ModelRouter, path: str) -> ModelRouter:
        """The router of ``router``'s model for ``path``; a 404 where no replica serves it."""
        narrowed = self._routers.get((router.route.name, path), router)
        if narrowed is None:
            raise not_served(router.route.name, path)
        return narrowed

    def rerouted(self, router: ModelRouter, replica: Replica, path: str) -> ModelRouter | None:
        """For a replica that came while a request for ``path`` waited: None if it serves
        ``path``, else the router over those of the model's that do (404 where none does)."""
        if (replica.replica_id, path) not in self._refused:
            return None
        return self.router(router, path)
