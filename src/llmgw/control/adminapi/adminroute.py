"""What every admin router shares: the admin route class, JSON answers, the name convertor.

Every route takes the admin token and nothing else. The check runs before
FastAPI looks at the request at all, so a caller without it learns nothing
(not even whether its body would have parsed), and node tokens or API keys
never work here: one leaked node token must not become a leaked fleet.
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

from llmgw import secrets
from llmgw.control.gcpause import paused_gc
from llmgw.control.httperrors import error_answer, error_response
from llmgw.control.plane import ControlPlane
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


def admin_route_class(cp: ControlPlane) -> type[APIRoute]:
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
                except Exception as exc:
                    answer = await error_answer(exc, cp.leader_hint)
                    if answer is None:
                        raise
                    return answer

            return handler

    return AdminRoute

