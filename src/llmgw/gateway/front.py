"""The front half every request to the gateway's /v1 routes shares, before a replica is chosen.

Cheap refusals first (no config, bad key, body too big), the body parsed
once, the model looked up in a dict built per config version. What a route
does with the request after that is its route's (:mod:`llmgw.gateway.routes`),
through :mod:`llmgw.gateway.forward`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from itertools import count
from typing import Any

import orjson

from llmgw.gateway.admission import Admission
from llmgw.gateway.checks.auth import KeyRecord, authenticate
from llmgw.gateway.engineclient import Upstream
from llmgw.gateway.metering.batcher import UsageBatcher
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.ondemand import WaitRoom
from llmgw.gateway.replies import REQUEST_ID, ApiError, send_error, send_json, unavailable
from llmgw.gateway.routing.router import ModelRouter
from llmgw.gateway.settings import GatewaySettings
from llmgw.gateway.snapshot import ConfigView, model_entry
from llmgw.gateway.tenancy.check import TenantCheck
from llmgw.gateway.types import Receive, Reply, Scope
from llmgw.http.contract import request_headers

_ID_PREFIX = os.urandom(8).hex()
_ids = count(1)


def new_request_id() -> str:
    # A per-process random prefix and a counter: unique across gateways with
    # overwhelming probability, and ~10x cheaper than uuid4 per request.
    # Exactly 32 hex digits, because engines may parse it as a UUID:
    # llama-cpp-python's server answers 400 to any X-Request-Id that is not.
    return f"{_ID_PREFIX}{next(_ids):016x}"


@dataclass
class Runtime:
    """What the request path shares with the gateway's lifecycle."""

    settings: GatewaySettings
    metrics: GatewayMetrics
    upstream: Upstream
    usage: UsageBatcher
    room: WaitRoom
    demand: Callable[[str], None]
    # Keys' and teams' limits, held fleet-wide (llmgw.gateway.tenancy).
    tenancy: TenantCheck
    # The hold queues of models with a known number of slots per replica.
    admission: Admission
    snapshot: ConfigView | None = None


class ClientGone(Exception):
    """The client hung up before its request was complete."""


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower-case), or None."""
    return request_headers(scope).get(name)


def configured_snapshot(rt: Runtime) -> ConfigView:
    """The routing snapshot, or a 503 before the first config has arrived."""
    snapshot = rt.snapshot
    if snapshot is None:
        raise unavailable("The gateway has not received its configuration yet.", "not_ready", 1)
    return snapshot


async def read_body(receive: Receive, max_bytes: int, declared: bytes | None) -> bytes:
    """The request's body; ``declared``: its Content-Length header, if any."""
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    message = await receive()
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        if len(body) > max_bytes:
            raise _too_large(max_bytes)
        return body
    parts = [body]
    size = len(body)
    while message.get("more_body", False):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        parts.append(chunk)
    return b"".join(parts)


def _too_large(max_bytes: int) -> ApiError:
    # 413, as OpenAI answers: a client that retries on 400 "fix your request"
    # logic can tell "too big" from "malformed" only by the status.
    return ApiError(413, f"Request body is larger than {max_bytes} bytes.", code="body_too_large")


def parse(body: bytes) -> dict[str, Any]:
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(
            400, f"The request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    if not isinstance(payload, dict):
        raise ApiError(400, "The request body must be a JSON object.", code="invalid_json")
    return payload


def usable_router(snapshot: ConfigView, record: KeyRecord, model: str) -> ModelRouter:
    """The model's router, or OpenAI's 404 when it is unknown or not the key's to use."""
    router = snapshot.routes.get(model)
    if router is None or not record.may_use(router.route):
        raise ApiError(
            404,
            f"The model `{model}` does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )
    return router


def resolve(snapshot: ConfigView, record: KeyRecord, payload: dict[str, Any]) -> ModelRouter:
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "The request must name a 'model'.", param="model", code="missing_model")
    return usable_router(snapshot, record, model)


async def list_models(rt: Runtime, scope: Scope, send: Reply) -> None:
    extra = [(REQUEST_ID, new_request_id().encode())]
    try:
        snapshot = configured_snapshot(rt)
        record = authenticate(
            snapshot.keys, rt.settings.allow_anonymous, header(scope, b"authorization")
        )
        path: str = scope["path"]
        if path in ("/v1/models", "/v1/models/"):
            await send_json(send, 200, snapshot.listing(record.allowed), extra)
            return
        name = path[len("/v1/models/") :]
        router = usable_router(snapshot, record, name)
        entry = {**model_entry(router.route), "id": name}
        await send_json(send, 200, entry, extra)
    except ApiError as error:
        await send_error(send, error, extra)
