"""How the control plane's HTTP APIs say no: llmgw's error tree translated once.

The agent API, the gateway link and the admin API answer every failure as a
:class:`llmgw.wire.ErrorBody`, translated here alone: the application's
handlers and the admin routes' own both call :func:`error_answer`, and a new
error class is mapped here or nowhere. Two translations drift apart (one
sends ``Retry-After`` with a store error, the other a ``WWW-Authenticate``
with a 401, or a code with a refused body).

    AuthError                       401 authentication_error / invalid_token
    ForbiddenError                  403 permission_error / forbidden
    ValidationError (and pydantic's, FastAPI's)
                                    422 invalid_request_error / the field at fault
    NotFoundError                   404 not_found_error / not_found
    StandbyError, NotLeaderError    503 standby_error / standby, the leader's URL
    StoreError                      503 store_error / store_unavailable, Retry-After
    any other LlmgwError            400 invalid_request_error
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError as PydanticValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmgw.control.standby import LeaderHint, standby_response
from llmgw.errors import (
    AuthError,
    ForbiddenError,
    LlmgwError,
    NotFoundError,
    NotLeaderError,
    StandbyError,
    StoreError,
    ValidationError,
)
from llmgw.wire import ErrorBody

log = logging.getLogger(__name__)

# A store that failed is usually back within seconds (a Patroni failover);
# clients that honour the header come back then rather than at once.
STORE_RETRY_AFTER_S = 2


def error_response(
    status: int, message: str, kind: str, code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """The APIs' error body; a 401 also names the scheme it wants (RFC 6750)."""
    all_headers = dict(headers or {})
    if status == 401:
        all_headers.setdefault("WWW-Authenticate", "Bearer")
    return Response(ErrorBody.of(message, kind, code).render(), status_code=status,
                    media_type="application/json", headers=all_headers)


def problems(errors: Sequence[Any]) -> str:
    """pydantic's list of errors as one line: ``field.sub: message; ...``."""
    return "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ())) or 'body'}: {e.get('msg', 'invalid')}"
        for e in errors
    )


async def error_answer(exc: Exception, hint: LeaderHint) -> Response | None:
    """The answer to ``exc``; None for an exception outside the tree (a bug: a 500)."""
    if isinstance(exc, RequestValidationError | PydanticValidationError):
        return error_response(422, problems(exc.errors()), "invalid_request_error",
                              "invalid_request")
    if isinstance(exc, ValidationError):
        return error_response(422, str(exc), "invalid_request_error",
                              exc.field or "invalid_request")
    if isinstance(exc, NotFoundError):
        return error_response(404, str(exc), "not_found_error", "not_found")
    if isinstance(exc, AuthError):
        return error_response(401, str(exc), "authentication_error", "invalid_token")
    if isinstance(exc, ForbiddenError):
        return error_response(403, str(exc), "permission_error", "forbidden")
    if isinstance(exc, NotLeaderError):
        # The write was refused for a stale epoch and this instance stepped
        # down (llmgw.control.writes): the caller is sent on like a standby's.
        return await standby_response(hint, StandbyError(f"this instance no longer leads: {exc}"))
    if isinstance(exc, StoreError):
        log.error("store error: %s", exc)
        return error_response(503, str(exc), "store_error", "store_unavailable",
                              {"Retry-After": str(STORE_RETRY_AFTER_S)})
    if isinstance(exc, StandbyError):
        return await standby_response(hint, exc)
    if isinstance(exc, LlmgwError):
        return error_response(400, str(exc), "invalid_request_error")
    return None


def install_error_handlers(app: FastAPI, hint: LeaderHint) -> None:
    """Answer the error tree, and the framework's own 404s and 405s, in one shape."""

    async def translated(_: Request, exc: Exception) -> Response:
        answer = await error_answer(exc, hint)
        if answer is None:
            raise exc
        return answer

    for kind in (LlmgwError, RequestValidationError, PydanticValidationError):
        app.exception_handler(kind)(translated)

    @app.exception_handler(StarletteHTTPException)
    async def framework(_: Request, exc: StarletteHTTPException) -> Response:
        # Unknown paths and wrong methods, not FastAPI's {"detail": ...}.
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind,
                              headers=getattr(exc, "headers", None))
