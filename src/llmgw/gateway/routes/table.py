"""The /v1 POST routes: the one interface each implements, and the table the gateway mounts.

Every route owns its whole answer: how its body is read, which replicas may
take it, what is sent to one, how the answer is read, relayed and metered.
What every route shares before that (key, body cap, envelope, model,
limits, a client that leaves) is :func:`llmgw.gateway.handler.handle`; the
choice of a replica and the retries, :func:`llmgw.gateway.forward.forward`.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol

from llmgw.gateway.call import Call
from llmgw.gateway.checks.validation import CHAT_PATH, COMPLETIONS_PATH, EMBEDDINGS_PATH
from llmgw.gateway.routes import passthrough
from llmgw.gateway.routes.completion import CompletionRoute
from llmgw.gateway.routing.router import ModelRouter
from llmgw.gateway.types import Scope


class Route(Protocol):
    """One /v1 POST route."""

    @property
    def path(self) -> str: ...

    @property
    def form(self) -> bool:
        """Whether the body is a multipart form (else JSON)."""
        ...

    @property
    def streams(self) -> bool:
        """Whether it may answer with a stream (server-sent events)."""
        ...

    def parse(self, scope: Scope, body: bytes) -> dict[str, Any]:
        """The request's body as a payload (JSON, or a multipart form), or a 400."""
        ...

    def serve(
        self, call: Call, payload: dict[str, Any], body: bytes, router: ModelRouter
    ) -> Awaitable[int]:
        """Answer the request (the status sent), through the model's replicas.

        ``payload`` has passed the route's envelope; ``router`` is the model's.
        Best not a coroutine of its own (return forward's): each level of
        coroutines a request waits in is resumed at every wake-up.
        """
        ...


ROUTES: dict[str, Route] = {
    CHAT_PATH: CompletionRoute(CHAT_PATH),
    COMPLETIONS_PATH: CompletionRoute(COMPLETIONS_PATH),
    EMBEDDINGS_PATH: CompletionRoute(EMBEDDINGS_PATH),
    **passthrough.ROUTES,
}
