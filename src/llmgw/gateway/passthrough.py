"""The OpenAI routes not every engine serves, passed through: responses, rerank, score, audio.

They share the chat route's front half in :func:`llmgw.gateway.handler.handle`
(key, body cap, envelope check, model and key's models, RPM/TPM limits, a
client that leaves) and its choice of a replica (waiting for an on-demand
model, retries elsewhere before the first byte, cool-down); what differs
lives here, decided once per route (:data:`ROUTES`, mounted by the gateway's
route table):

* the body: JSON, or a multipart form (``/v1/audio/transcriptions``) read in
  place by :mod:`llmgw.gateway.multipart`; upstream it changes only where
  the engine knows the model by another name, or where the catalog's output
  cap lowers ``max_output_tokens`` (responses);
* which replicas may take it: those whose engine serves the route
  (:mod:`llmgw.gateway.apiroutes`), else OpenAI's 404;
* usage, read from the answer in whichever shape the route uses: chat's
  ``prompt_tokens``/``completion_tokens``, the Responses API's
  ``input_tokens``/``output_tokens``, a reranker's ``total_tokens`` alone
  (all prompt). An answer without token counts (a rerank without ``usage``, a
  transcription that reports audio seconds) is metered as a request with 0
  tokens;
* streams: a Responses stream (``event: response.*``) is relayed event by
  event and is complete only with ``response.completed`` (or
  ``response.incomplete``), whose ``response.usage`` is metered; a streamed
  transcription is complete with ``[DONE]``. A stream cut short gets an error
  event in the route's own shape, as a chat stream does.

Routing: ``/v1/responses`` is routed by prompt prefix as chat is, its
``instructions`` and ``input`` rendered as chat messages are, so a
conversation keeps to the replica holding its KV cache whichever of the two
APIs it uses; the other routes hold no prompt worth caching and route by load.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from llmgw.gateway.auth import KeyRecord
from llmgw.gateway.external import renaming_send
from llmgw.gateway.handler import Runtime, _account, _Prefill, _replica_for, parse
from llmgw.gateway.http1 import BodyBroken, ConnectFailed, Response, UpstreamTimeout
from llmgw.gateway.multipart import Form, boundary_of, content_type, read_form, with_model
from llmgw.gateway.prefix import render_chat
from llmgw.gateway.proxy import Usage, sse_error, usage_object
from llmgw.gateway.responses import JSON, ApiError, overhead_header, send_bytes
from llmgw.gateway.routing import ModelRouter, Replica
from llmgw.gateway.types import Scope, Send
from llmgw.gateway.validation import (
    RERANK_PATH,
    RESPONSES_PATH,
    SCORE_PATH,
    TRANSCRIPTIONS_PATH,
    form_true,
)

log = logging.getLogger(__name__)

_SSE = b"text/event-stream"
_SSE_HEADERS = [(b"content-type", _SSE), (b"cache-control", b"no-cache")]
_USAGE_MARKS = (b'"usage":{', b'"usage": {')


def _marks(event_type: str) -> tuple[bytes, ...]:
    # Inside a JSON string every quote is escaped, so these can only be the
    # event's own "type" (compact or spaced, as engines encode it).
    return (f'"type":"{event_type}"'.encode(), f'"type": "{event_type}"'.encode())


_DONE = (b"data: [DONE]", b"data:[DONE]")


def responses_prompt(payload: dict[str, Any]) -> str | None:
    """A Responses request's prompt as the chat route renders its messages (prefix routing)."""
    messages: list[Any] = []
    instructions = payload.get("instructions")
    if isinstance(instructions, str):
        messages.append({"role": "system", "content": instructions})
    given = payload.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        messages += given
    return render_chat(messages)


@dataclass(frozen=True, slots=True)
class PassThrough:
    """One route: how its body is read and sent on, and how its stream ends."""

    path: str
    form: bool = False  # multipart/form-data, else JSON
    streams: bool = False
    # A stream is complete once one of these is seen; failed where one of ``fails`` is.
    ends: tuple[bytes, ...] = ()
    fails: tuple[bytes, ...] = ()
    # Errors in a stream as the Responses API sends them (``event: error``),
    # else as chat streams do (``data: {"error": ...}``).
    response_events: bool = False
    # The request's output limit, lowered to the catalog's max_output_tokens.
    output_field: str | None = None
    # The text to route by prefix; None: the route is routed by load.
    prompt: Callable[[dict[str, Any]], str | None] | None = None

    def parse(self, scope: Scope, body: bytes) -> dict[str, Any]:
        if not self.form:
            return parse(body)
        return read_form(body, boundary_of(_header(scope, b"content-type")))

    async def proxy(
        self, rt: Runtime, payload: dict[str, Any], body: bytes, router: ModelRouter,
        record: KeyRecord, started: float, request_id: str, id_header: tuple[bytes, bytes],
        send: Send,
    ) -> int:  # fmt: skip
        return await _proxy(rt, self, payload, body, router, record, started, request_id,
                            id_header, send)  # fmt: skip

    def wants_stream(self, payload: dict[str, Any]) -> bool:
        if not self.streams:
            return False
        return form_true(payload, "stream") if self.form else payload.get("stream") is True

    def error_event(self, message: str, code: str) -> bytes:
        if not self.response_events:
            return sse_error(message, code)
        event = {"type": "error", "code": code, "message": message, "param": None}
        return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"


ROUTES: dict[str, PassThrough] = {
    RESPONSES_PATH: PassThrough(
        RESPONSES_PATH,
        streams=True,
        ends=_marks("response.completed") + _marks("response.incomplete"),
        fails=_marks("response.failed") + _marks("error"),
        response_events=True,
        output_field="max_output_tokens",
        prompt=responses_prompt,
    ),
    RERANK_PATH: PassThrough(RERANK_PATH),
    SCORE_PATH: PassThrough(SCORE_PATH),
    TRANSCRIPTIONS_PATH: PassThrough(TRANSCRIPTIONS_PATH, form=True, streams=True, ends=_DONE),
}


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value  # type: ignore[no-any-return]
    return None


def usage_in(data: bytes) -> Usage | None:
    """The usage of an answer (or stream event) of any of these routes, or None."""
    usage = usage_object(data)
    if usage is None:
        return None
    prompt = _count(usage, "prompt_tokens", "input_tokens")
    completion = _count(usage, "completion_tokens", "output_tokens") or 0
    if prompt is None:
        # A reranker reports total_tokens only: all of it is input.
        total = usage.get("total_tokens")
        prompt = max(0, total - completion) if type(total) is int else 0
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    cached = _count(details, "cached_tokens") if isinstance(details, dict) else None
    return Usage(prompt=prompt, completion=completion, cached=cached or 0)


def _count(usage: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = usage.get(name)
        if type(value) is int and value >= 0:
            return value
    return None


def _not_served(model: str, path: str) -> ApiError:
    return ApiError(
        404,
        f"The model `{model}` does not serve {path}: its engine does not offer this route.",
        param="model",
        code="model_not_found",
    )


def _upstream_body(
    route: PassThrough, payload: dict[str, Any], body: bytes, served: str, cap: int | None
) -> tuple[bytes, bytes]:
    """(the body to send, its Content-Type header line when not JSON)."""
    if isinstance(payload, Form):
        sent = body if payload.get("model") == served else with_model(body, payload, served)
        return sent, content_type(payload.boundary)
    changed = payload.get("model") != served
    if changed:
        payload["model"] = served
    field = route.output_field
    if field is not None and cap is not None:
        asked = payload.get(field)
        if asked is None or asked > cap:  # validated: an integer or null
            payload[field] = cap
            changed = True
    return (orjson.dumps(payload) if changed else body), b""


async def _proxy(
    rt: Runtime, route: PassThrough, payload: dict[str, Any], body: bytes,
    router: ModelRouter, record: KeyRecord, started: float, request_id: str,
    id_header: tuple[bytes, bytes], send: Send,
) -> int:  # fmt: skip
    settings = rt.settings
    metrics = rt.metrics
    snapshot = rt.snapshot
    model = router.route.name
    if snapshot is not None:
        narrowed = snapshot.support.router(router, route.path)
        if narrowed is None:
            raise _not_served(model, route.path)
        router = narrowed
    upstream_body, headers = _upstream_body(
        route, payload, body, router.route.served_name, router.route.max_output_tokens
    )
    stream = route.wants_stream(payload)
    prompt = route.prompt(payload) if route.prompt and router.policy == "prefix" else None
    # An external model's answers carry the upstream's name: put the catalog's back.
    rename = snapshot.renames.get(model) if snapshot is not None else None
    tried: list[Replica] = []
    waited = 0.0
    wait_deadline = time.monotonic() + settings.queue_wait_s
    attempts = 0
    while attempts <= settings.retries:
        router, pick, wait = await _replica_for(rt, router, prompt, tried, wait_deadline)
        waited += wait
        if pick is None:
            break
        attempts = 1 if wait else attempts + 1
        replica = pick.replica
        current = rt.snapshot
        if wait and current is not None and not current.support.serves(replica, route.path):
            # The replica that came while the request waited runs an engine
            # without this route: another of the model's may have it.
            narrowed = current.support.router(router, route.path)
            if narrowed is None:
                raise _not_served(model, route.path)
            router = narrowed
            continue
        if not tried:
            metrics.routed(model, pick.outcome)
        replica.in_flight += 1
        replica.requests += 1
        replica.last_request_at = time.time()
        metrics.in_flight(model, 1)
        prefill = _Prefill(router, pick)
        before = time.perf_counter() - started - waited
        response: Response | None = None
        try:
            target = rt.upstream.target(replica.url, route.path, replica.engine_key,
                                        json=not route.form)  # fmt: skip
            response = await rt.upstream.post(target, upstream_body, request_id, headers)
            if response.status in (401, 403):
                # The engine refused the gateway's engine key: no fault of the
                # client's, and another replica may take the request.
                raise ConnectFailed(f"engine refused the engine key ({response.status})")
            replica.connect_succeeded()
            kind = response.content_type or b""
            if stream and response.status == 200 and kind.startswith(_SSE):
                # Nothing goes to the client before the first chunk, so a
                # replica that dies before answering is still retried elsewhere.
                first = await response.next_chunk()
                prefill.started(streamed=True)
                metrics.ttft(model, time.perf_counter() - started - waited)
                relayed, response = response, None
                out = send if rename is None else renaming_send(send, rename)
                return await _relay(rt, route, relayed, first or b"", model, record, before,
                                    id_header, out)  # fmt: skip
            if response.status == 200:
                prefill.started(streamed=False)
            else:
                prefill.done()
            data = await response.read()
            if rename is not None:
                data = rename(data)
            return await _answer(rt, response, data, model, record, before, id_header, send)
        except (ConnectFailed, BodyBroken) as exc:
            log.info("%s: replica %s unavailable: %s", request_id, replica.replica_id, exc)
            replica.connect_failed(settings.cooldown_after, settings.cooldown_s)
            tried.append(replica)
            metrics.retried(model)
        except UpstreamTimeout:
            raise ApiError(
                504, f"The model `{model}` did not answer within {settings.upstream_timeout_s} s.",
                kind="server_error", code="upstream_timeout",
            ) from None  # fmt: skip
        finally:
            if response is not None:
                response.release()
            replica.in_flight -= 1
            prefill.done()
            metrics.in_flight(model, -1)
    raise ApiError(
        503,
        f"No replica of the model `{model}` could be reached.",
        kind="service_unavailable_error",
        code="upstream_unavailable",
        retry_after=settings.retry_after_s,
    )


async def _answer(
    rt: Runtime, response: Response, data: bytes, model: str, record: KeyRecord,
    before: float, id_header: tuple[bytes, bytes], send: Send,
) -> int:  # fmt: skip
    read_at = time.perf_counter()
    status = response.status
    ok = status < 400
    _account(rt, model, record, usage_in(data) if ok else None, not ok)
    overhead = before + (time.perf_counter() - read_at)
    rt.metrics.overhead(overhead)
    await send_bytes(
        send, status, data, response.content_type or JSON, [id_header, overhead_header(overhead)]
    )
    return status


class EventRelay:
    """Passes an SSE stream on whole events at a time, noting its end, failure and usage."""

    __slots__ = ("_ends", "_fails", "_pending", "ended", "failed", "usage")

    def __init__(self, ends: tuple[bytes, ...], fails: tuple[bytes, ...]) -> None:
        self._ends = ends
        self._fails = fails
        self._pending = b""
        self.ended = False
        self.failed = False
        self.usage: Usage | None = None

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk if self._pending else chunk
        lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
        cut = max(lf + 2 if lf >= 0 else -1, crlf + 4 if crlf >= 0 else -1)
        if cut < 0:
            self._pending = data
            return b""
        self._pending = data[cut:]
        complete = data[:cut]
        if not self.ended and any(mark in complete for mark in self._ends):
            self.ended = True
        if not self.failed and any(mark in complete for mark in self._fails):
            self.failed = True
        if any(mark in complete for mark in _USAGE_MARKS):
            self.usage = usage_in(complete) or self.usage
        return complete

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest


async def _relay(
    rt: Runtime, route: PassThrough, response: Response, first: bytes, model: str,
    record: KeyRecord, before: float, id_header: tuple[bytes, bytes], send: Send,
) -> int:  # fmt: skip
    relay = EventRelay(route.ends, route.fails)
    rt.metrics.overhead(before)
    failed = False
    try:
        await send({
            "type": "http.response.start", "status": 200,
            "headers": [*_SSE_HEADERS, id_header, overhead_header(before)],
        })  # fmt: skip
        try:
            chunk: bytes | None = first
            while chunk is not None:
                out = relay.feed(chunk)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                chunk = await response.next_chunk()
        except (BodyBroken, ConnectFailed, UpstreamTimeout) as exc:
            failed = True
            log.info("stream of %s on %s broke after it started: %s", model, route.path, exc)
            tail = relay.flush() + route.error_event(
                f"The model `{model}` stopped answering: {exc}", "upstream_error"
            )
            await send({"type": "http.response.body", "body": tail, "more_body": False})
            return 200
        tail = relay.flush()
        if not relay.ended:
            failed = True
            tail += route.error_event(
                f"The model `{model}` ended its answer before finishing it; the answer is"
                " incomplete.",
                "upstream_incomplete",
            )
        await send({"type": "http.response.body", "body": tail, "more_body": False})
        return 200
    finally:
        response.release()
        # Also a stream that broke or a client that left: what was generated is metered.
        _account(rt, model, record, relay.usage, failed or relay.failed)
