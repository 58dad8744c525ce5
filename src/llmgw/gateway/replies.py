"""What the gateway itself sends a client: OpenAI-shaped errors, small JSON bodies, their headers.

The request path answers through the server's Reply (llmgw.http.contract:
no framework objects, no ASGI messages per request); this module keeps the
header lists and error bodies in one place so every answer carries
``x-request-id`` and the overhead header the same way.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from llmgw.gateway.types import Reply

JSON = b"application/json"
REQUEST_ID = b"x-request-id"
OVERHEAD = b"x-llmgw-overhead-ms"

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An answer the gateway gives instead of the engine's, in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code
        self.param = param
        self.retry_after = retry_after

    def body(self) -> bytes:
        return orjson.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": self.kind,
                    "param": self.param,
                    "code": self.code,
                }
            }
        )

    def headers(self) -> list[tuple[bytes, bytes]]:
        if self.retry_after is None:
            return []
        # Whole seconds, rounded up: Retry-After has no fractions, and 0 invites a hot loop.
        seconds = max(1, int(self.retry_after + 0.999))
        return [(b"retry-after", str(seconds).encode())]


def unavailable(message: str, code: str, retry_after: float) -> ApiError:
    """A 503: the gateway cannot answer now, and the client may retry after ``retry_after``."""
    return ApiError(
        503, message, kind="service_unavailable_error", code=code, retry_after=retry_after
    )


def engine_failed(model: str, request_id: str, status: int, answer: bytes) -> ApiError:
    """What a client gets for an engine's 5xx answer, whose own body is logged instead.

    An engine's error for its own failure is written for its operator: it
    carries exception text, file paths and stack lines (llama_cpp.server
    wraps any exception in a 500 with its message, a pydantic validation
    error with its traceback's paths). Its status is kept (a 503 still says
    "try later"); its words go to the gateway's log at warning, under the
    request id the client is given to quote.
    """
    log.warning(
        "request %s: the engine of `%s` failed (HTTP %d): %s",
        request_id, model, status, answer[:2000].decode("utf-8", "replace"),
    )  # fmt: skip
    return ApiError(
        status,
        f"The model `{model}`'s engine failed on this request (request id {request_id});"
        " the gateway's log has its error.",
        kind="server_error",
        code="engine_error",
    )


def overhead_header(seconds: float) -> tuple[bytes, bytes]:
    return (OVERHEAD, b"%.3f" % (seconds * 1000.0))


async def send_bytes(
    send: Reply,
    status: int,
    body: bytes,
    content_type: bytes,
    extra: list[tuple[bytes, bytes]],
) -> None:
    # Head and body in one write, no ASGI messages. The headers are the
    # gateway's own (the content type of an engine's answer passed
    # httptools' checks of header values).
    await send.answer(status, [(b"content-type", content_type), *extra], body)


async def send_json(
    send: Reply, status: int, payload: Any, extra: list[tuple[bytes, bytes]]
) -> None:
    await send_bytes(send, status, orjson.dumps(payload), JSON, extra)


async def send_error(send: Reply, error: ApiError, extra: list[tuple[bytes, bytes]]) -> None:
    await send_bytes(send, error.status, error.body(), JSON, [*extra, *error.headers()])
