"""Who is calling the admin API: the admin token, a provider's access token, or a console session.

One place answers it for every admin route, so the three credentials can
never be accepted by one route and not another. The admin token is checked
first and stays the automation's credential (it acts as admin); a bearer
token that is not it is tried as the provider's JWT access token only when
SSO is on. A session cookie counts only without a bearer token.

Cookies travel with every request the browser makes to this origin, even
ones another site triggers, so a write carried by a session must also carry
``X-Llmgw-Csrf: 1``: a header no cross-site form can set and no cross-site
script can send without a CORS preflight this API never answers.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from starlette.requests import Request

from llmgw import secrets
from llmgw.control.access.oidc import OidcClient
from llmgw.control.access.rolemap import principal_from_claims
from llmgw.control.access.roles import ADMIN_TOKEN, Principal
from llmgw.control.access.sessions import SessionStore
from llmgw.control.access.settings import OidcSettings
from llmgw.errors import AuthError, ForbiddenError, LlmgwError

CSRF_HEADER = "x-llmgw-csrf"
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class MissingCredential(AuthError):
    """No credential at all (as opposed to a wrong one): 401 with code ``missing_token``."""


def session_cookie_name(secure: bool) -> str:
    # __Host-: the browser refuses it unless Secure, Path=/ and host-only,
    # so a sibling subdomain cannot plant or shadow it.
    return "__Host-llmgw_session" if secure else "llmgw_session"


def _looks_like_jwt(token: str) -> bool:
    return token.count(".") == 2 and token.startswith("eyJ")


class Door:
    """Turns a request's credential into a :class:`Principal`, or refuses it (401)."""

    def __init__(self, is_admin: Callable[[str | None], bool],
                 sso: OidcSettings | None = None, client: OidcClient | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.is_admin = is_admin
        self.sso = sso
        self.client = client if client is not None or sso is None else OidcClient(sso)
        self.sessions = SessionStore(sso.session_ttl_s if sso else 0.0, clock)
        self.cookie = session_cookie_name(bool(sso and sso.secure_cookies))

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def principal(self, request: Request) -> Principal:
        token = secrets.bearer(request.headers.get("authorization"))
        if token is not None:
            return await self._bearer(token)
        cookie = request.cookies.get(self.cookie) if self.sso else None
        if cookie:
            principal = self.sessions.sessions.get(cookie)
            if principal is None:
                raise AuthError("the console session has ended (signed out or expired); "
                                "sign in again")
            if request.method not in _SAFE_METHODS and request.headers.get(CSRF_HEADER) != "1":
                raise ForbiddenError(f"a change made with a console session needs the "
                                     f"{CSRF_HEADER} header (the console sends it)")
            return principal
        if self.sso:
            raise MissingCredential("sign in (/console/auth/login) or send a token "
                                    "(Authorization: Bearer ...)")
        raise MissingCredential("an admin token is required "
                                "(Authorization: Bearer llmgw-admin-...)")

    async def _bearer(self, token: str) -> Principal:
        if self.is_admin(token):
            return ADMIN_TOKEN
        if self.client is None or self.sso is None or not _looks_like_jwt(token):
            raise AuthError("this token is not the admin token")
        try:
            claims = await self.client.verify_access_token(token)
        except AuthError:
            raise
        except LlmgwError as exc:
            # The provider's discovery went wrong (a ConfigError): still no one is let in.
            raise AuthError(f"the token cannot be checked: {exc}") from None
        return principal_from_claims(claims, self.sso, via="bearer")
