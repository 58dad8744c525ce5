"""The uvicorn settings every llmgw server uses (serve, up, a standalone gateway).

uvicorn on its own bounds neither how long a client may take to send a
request's head nor how large the head may be: its keep-alive timer is armed
only after an answer and cancelled by any byte, and httptools accepts headers
of any size. One client could hold a connection with a byte every minute, or
send a head of gigabytes. llmgw's own protocol
(:class:`llmgw.http.connection.LeanHttpProtocol`, the ``http`` setting here)
closes a connection whose request head is not complete within
``HEAD_TIMEOUT_S`` of its first byte (or of the connection opening), and
refuses a head over ``MAX_HEAD_BYTES``; ``limit_concurrency`` answers 503
past a number of connections instead of running out of file descriptors;
idle keep-alive connections close after ``KEEP_ALIVE_S``; one client
address holds at most ``LLMGW_MAX_CONNECTIONS_PER_ADDRESS`` connections
(llmgw.addresscap) and a request's body must be complete within
``BODY_TIMEOUT_S`` of its head.

The app served is an :class:`~llmgw.http.contract.App` (its endpoints run
without its dispatch); :class:`Plain` makes one of an ASGI app without any.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import uvicorn

from llmgw.addresscap import max_per_address_from_env
from llmgw.http.connection import MAX_HEAD_BYTES, LeanHttpProtocol
from llmgw.http.contract import App, Asgi, Endpoint, Receive, Reply, Scope
from llmgw.http.guards import BODY_TIMEOUT_S, HEAD_TIMEOUT_S

__all__ = [
    "BODY_TIMEOUT_S", "HEAD_TIMEOUT_S", "KEEP_ALIVE_S", "MAX_CONNECTIONS", "MAX_HEAD_BYTES",
    "Plain", "server_config",
]

# Longer than uvicorn's 5 s: OpenAI clients keep pooled connections for a
# while, and a close racing their next request is an error they must retry.
KEEP_ALIVE_S = 30
# Connections (and requests) at once, past which new ones get 503. Streaming
# answers hold a connection each; 4,096 is well above what one gateway
# process serves and below the usual 65,536 descriptors.
MAX_CONNECTIONS = 4096


class Plain:
    """An ASGI app with no endpoints of its own, as an :class:`~llmgw.http.contract.App`."""

    endpoints: Mapping[tuple[str, str], Endpoint] = {}

    def __init__(self, app: Asgi) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Reply) -> None:
        await self.app(scope, receive, send)


def server_config(app: App, **kwargs: Any) -> uvicorn.Config:
    """A uvicorn.Config with llmgw's protocol and limits; ``kwargs`` add to or override them."""
    max_per_address_from_env()  # a bad LLMGW_MAX_CONNECTIONS_PER_ADDRESS stops the start here
    settings: dict[str, Any] = {
        "http": LeanHttpProtocol,
        "ws": "none",
        "lifespan": "off",
        "access_log": False,
        # Client addresses are not used; the middleware costs per request.
        "proxy_headers": False,
        "timeout_keep_alive": KEEP_ALIVE_S,
        "limit_concurrency": MAX_CONNECTIONS,
        **kwargs,
    }
    return uvicorn.Config(app, **settings)
