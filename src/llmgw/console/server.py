"""Serves the web console at ``/console`` from files inside the package.

The console is plain JavaScript modules and CSS with no build step, so what
is in ``static/`` is exactly what the browser runs: an air-gapped cluster
needs nothing but the installed wheel, and there is no bundler output to
drift from its sources. It talks only to the admin API, with the admin
token the operator types in; the server side holds no session of its own.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import FileResponse, RedirectResponse, Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

if TYPE_CHECKING:
    from llmgw.control.plane import ControlPlane

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
PREFIX = "/console"

# Everything the console loads comes from this origin: a CSP that forbids
# anything else turns an accidental CDN link or an injected <script> into a
# refused load instead of a silent dependency on the outside world (or an
# XSS that can read the admin token from sessionStorage).
CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)

_SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Revalidate on every load (StaticFiles answers 304 with its ETag), so an
    # upgraded control plane never runs a mix of old and new modules.
    "Cache-Control": "no-cache",
}


class _ConsoleFiles(StaticFiles):
    """StaticFiles with the console's headers on every answer."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(_SECURITY_HEADERS)
        return response


def mount_console(app: FastAPI, cp: ControlPlane) -> None:
    """Add the console's routes to the control plane's app.

    ``cp`` is accepted for symmetry with the other mounts; the console reads
    everything through the admin API, so that what the page shows is exactly
    what ``llmgw ctl`` and scripts see.
    """
    del cp
    if not (STATIC_DIR / "index.html").is_file():
        # A wheel built without its package data: the control plane must
        # still start (the console is a convenience, the APIs are not), so
        # say why /console is missing instead of failing the whole app.
        log.warning("console assets missing (%s); /console is not served", STATIC_DIR)
        return

    async def redirect(_: Request) -> Response:
        return RedirectResponse(PREFIX + "/", status_code=307)

    async def index(_: Request) -> Response:
        return FileResponse(STATIC_DIR / "index.html", headers=_SECURITY_HEADERS)

    app.add_route(PREFIX, redirect, include_in_schema=False)
    app.add_route(PREFIX + "/", index, include_in_schema=False)
    app.mount(PREFIX + "/static", _ConsoleFiles(directory=STATIC_DIR), name="console-static")
