"""The console's sign-in through the provider: ``/console/auth/{login,callback,logout,session}``.

login     remembers a fresh state, nonce and PKCE verifier under a short-lived
          cookie (SameSite=Lax: it must come back on the provider's redirect,
          a cross-site navigation) and sends the browser to the provider.
callback  takes that cookie's login (once: it is removed as it is read),
          checks the state, redeems the code with the verifier, verifies the
          ID token and its nonce, maps the groups to roles and opens a
          session (SameSite=Strict, HttpOnly; Secure and ``__Host-`` under
          https). Any failure returns to the console with a message.
logout    ends the session on the server and clears the cookie.
session   tells the console whether SSO is on and who is signed in.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from llmgw.control.access.door import CSRF_HEADER, Door
from llmgw.control.access.rolemap import principal_from_claims
from llmgw.control.access.roles import Action
from llmgw.control.access.sessions import LOGIN_TTL_S
from llmgw.control.httperrors import error_response
from llmgw.errors import LlmgwError

log = logging.getLogger(__name__)

PREFIX = "/console/auth"
LOGIN_COOKIE = "llmgw_login"
CONSOLE = "/console/"
_NO_STORE = {"Cache-Control": "no-store"}


def _back(message: str) -> Response:
    """To the console's sign-in form, which shows ``message`` (as text, never markup)."""
    response = RedirectResponse(f"{CONSOLE}?{urlencode({'signin_error': message[:300]})}",
                                status_code=303, headers=_NO_STORE)
    response.delete_cookie(LOGIN_COOKIE, path=PREFIX)
    return response


def login_routes(door: Door) -> list[Route]:
    secure = bool(door.sso and door.sso.secure_cookies)

    async def session(request: Request) -> Response:
        body: dict[str, Any] = {"sso": door.sso is not None, "signed_in": False}
        principal = door.sessions.sessions.get(request.cookies.get(door.cookie))
        if door.sso is not None and principal is not None:
            body.update(signed_in=True, name=principal.name, roles=sorted(principal.roles),
                        teams=sorted(principal.teams),
                        actions=[a.value for a in Action if principal.may(a)])
        return JSONResponse(body, headers=_NO_STORE)

    routes = [Route(f"{PREFIX}/session", session, methods=["GET"])]
    if door.sso is None or door.client is None:
        return routes
    sso, client = door.sso, door.client

    async def login(_: Request) -> Response:
        try:
            pending = await client.login_request()
        except LlmgwError as exc:
            return _back(f"the identity provider cannot be reached: {exc}")
        secret, _expires = door.sessions.logins.add(pending)
        response = RedirectResponse(pending.url, status_code=302, headers=_NO_STORE)
        response.set_cookie(LOGIN_COOKIE, secret, max_age=int(LOGIN_TTL_S), path=PREFIX,
                            httponly=True, samesite="lax", secure=secure)
        return response

    async def callback(request: Request) -> Response:
        pending = door.sessions.logins.pop(request.cookies.get(LOGIN_COOKIE))
        if pending is None:
            return _back("this sign-in expired or began in another browser; sign in again")
        query = request.query_params
        if not hmac.compare_digest(query.get("state", "").encode(), pending.state.encode()):
            return _back("the provider's answer does not belong to this sign-in (state)")
        if "error" in query:
            return _back(f"the identity provider refused: "
                         f"{query.get('error_description') or query['error']}")
        try:
            claims = await client.redeem(query.get("code", ""), pending)
        except LlmgwError as exc:
            return _back(f"sign-in failed: {exc}")
        principal = principal_from_claims(claims, sso, via="session")
        if not principal.roles:
            log.info("console sign-in refused: %s has no llmgw role", principal.name)
            return _back(f"{principal.name} has no llmgw role; ask an admin to add you to "
                         f"a group of the role map")
        secret, _expires = door.sessions.sessions.add(principal)
        log.info("console sign-in: %s as %s", principal.name,
                 ", ".join(sorted(principal.roles)))
        response = RedirectResponse(CONSOLE, status_code=303, headers=_NO_STORE)
        response.set_cookie(door.cookie, secret, max_age=int(sso.session_ttl_s), path="/",
                            httponly=True, samesite="strict", secure=secure)
        response.delete_cookie(LOGIN_COOKIE, path=PREFIX)
        return response

    async def logout(request: Request) -> Response:
        if request.headers.get(CSRF_HEADER) != "1":
            return error_response(403, f"sign-out needs the {CSRF_HEADER} header",
                                  "permission_error", "forbidden")
        door.sessions.sessions.pop(request.cookies.get(door.cookie))
        response = Response(status_code=204, headers=_NO_STORE)
        response.delete_cookie(door.cookie, path="/", secure=secure, httponly=True,
                               samesite="strict")
        return response

    routes += [
        Route(f"{PREFIX}/login", login, methods=["GET"]),
        Route(f"{PREFIX}/callback", callback, methods=["GET"]),
        Route(f"{PREFIX}/logout", logout, methods=["POST"]),
    ]
    return routes
