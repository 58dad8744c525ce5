"""What every admin router shares: the admin route class, JSON answers, the name convertor.

Every route knows its caller before FastAPI looks at the request at all:
the admin token, or with single sign-on a console session or a provider's
access token (llmgw.control.access.door), and then checks that the caller's
role allows the route's action (llmgw.control.access.roles; 403 if not). A
caller without a credential learns nothing (not even whether its body would
have parsed), and node tokens or API keys never work here: one leaked node
token must not become a leaked fleet.
Errors are answered by the control plane's one translation
(llmgw.control.httperrors), here in the route so the router behaves the
same whichever app mounts it.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.convertors import Convertor, register_url_convertor

from llmgw.control.access.door import Door, MissingCredential
from llmgw.control.access.roles import Principal, route_action
from llmgw.control.gcpause import paused_gc
from llmgw.control.httperrors import error_answer, error_response
from llmgw.control.plane import ControlPlane
from llmgw.errors import AuthError, ForbiddenError
from llmgw.wire import ErrorBody


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

NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorBody, "description": "No such thing"}
}


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


def admin_route_class(cp: ControlPlane, door: Door | None = None) -> type[APIRoute]:
    """Routes that know their caller (``door``) and check its role before they run.

    Without a door only the admin token opens them (the admin API as it was
    before single sign-on).
    """
    gate = door or Door(cp.credentials.is_admin)

    class AdminRoute(APIRoute):
        """Checks the caller and its role first, then turns llmgw errors into JSON."""

        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            inner = super().get_route_handler()
            action = route_action(self.name)
            what = f"{sorted(self.methods)[0] if self.methods else ''} {self.path}".strip()

            async def handler(request: Request) -> Response:
                try:
                    principal = await gate.principal(request)
                    principal.require(action, what)
                except MissingCredential as exc:
                    return error_response(401, str(exc), "authentication_error",
                                          "missing_token")
                except (AuthError, ForbiddenError) as exc:
                    return await error_answer(exc, cp.leader_hint) or error_response(
                        401, str(exc), "authentication_error", "invalid_token")
                request.state.principal = principal
                try:
                    return await inner(request)
                except Exception as exc:
                    answer = await error_answer(exc, cp.leader_hint)
                    if answer is None:
                        raise
                    return answer

            return handler

    return AdminRoute


def principal_of(request: Request) -> Principal:
    """The caller the admin route class let in (set before any route runs)."""
    principal: Principal = request.state.principal
    return principal
