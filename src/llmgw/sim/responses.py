"""The simulated engine's answers that are not tokens: errors, JSON, a dropped connection.

Shared by the engine's own routes (llmgw.sim.engine) and the extra ones
(llmgw.sim.extra_routes), so an error reads the same whichever route made it.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from llmgw.errors import ValidationError
from llmgw.sim import openai_api


def client_left() -> web.Response:
    """What a handler returns when its client hung up mid-stream.

    A gateway cuts a stream whose own client left (or that is stopping), so
    this is routine, not an error to log with a traceback; aiohttp finds the
    connection gone when it sends this and drops it quietly.
    """
    return web.Response(status=499)


def drop(request: web.Request) -> None:
    """Cut the connection with no further byte: what a crashed engine looks like."""
    transport = request.transport
    if transport is not None:
        transport.abort()


async def read_json(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ValidationError(f"request body is not JSON: {exc}") from None


def json_response(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")


def error(
    status: int,
    message: str,
    type_: str,
    code: str | int | None,
    *,
    param: str | None = None,
    retry_after: bool = False,
) -> web.Response:
    headers = {"Retry-After": "1"} if retry_after else None
    return web.Response(
        body=openai_api.error_body(message, type_, code, param),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def model_not_found(model: str) -> web.Response:
    return error(
        404, f"The model `{model}` does not exist.", "invalid_request_error", "model_not_found",
        param="model",
    )  # fmt: skip
