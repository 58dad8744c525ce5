"""The OpenAI routes not every engine serves, passed through: responses, rerank, score, audio.

They share the chat route's front half in :func:`llmgw.gateway.handler.handle`
(key, body cap, envelope check, model and key's models, RPM/TPM limits, a
client that leaves) and its choice of a replica in :mod:`llmgw.gateway.forward`
(waiting for an on-demand model, retries elsewhere before the first byte,
cool-down); what differs lives here, decided once per route (:data:`ROUTES`,
in the gateway's route table, :mod:`llmgw.gateway.routes`):

* the body: JSON, or a multipart form (``/v1/audio/transcriptions``) read in
  place by :mod:`llmgw.gateway.multipart`; upstream it changes only where
  the engine knows the model by another name, or where the catalog's output
  cap lowers ``max_output_tokens`` (responses);
* which replicas may take it: those whose engine serves the route
  (:mod:`llmgw.gateway.routing.support`), else OpenAI's 404;
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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from llmgw.gateway.call import Call
from llmgw.gateway.checks.fields import form_true
from llmgw.gateway.checks.validation import (
    RERANK_PATH,
    RESPONSES_PATH,
    SCORE_PATH,
    TRANSCRIPTIONS_PATH,
)
from llmgw.gateway.dialect import mend_lora
from llmgw.gateway.forward import forward
from llmgw.gateway.front import header, parse
from llmgw.gateway.metering.account import account
from llmgw.gateway.metering.usage import Usage, usage_in
from llmgw.gateway.multipart import Form, boundary_of, content_type, read_form, with_model
from llmgw.gateway.routes.answer import answer_whole, first_chunk, stream_out
from llmgw.gateway.routes.sse import EventBuffer, sse_error
from llmgw.gateway.routing.prefill import Prefill
from llmgw.gateway.routing.prefixindex import render_chat
from llmgw.gateway.routing.replica import Replica
from llmgw.gateway.routing.router import ModelRouter
from llmgw.gateway.types import Scope
from llmgw.http.upstream import BodyBroken, ConnectFailed, Response, UpstreamTimeout

log = logging.getLogger(__name__)

_SSE = b"text/event-stream"
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
        return read_form(body, boundary_of(header(scope, b"content-type")))

    def serve(
        self, call: Call, payload: dict[str, Any], body: bytes, router: ModelRouter
    ) -> Awaitable[int]:
        snapshot = call.rt.snapshot
        if snapshot is not None:
            router = snapshot.support.router(router, self.path)
        upstream_body, headers = _upstream_body(
            self, payload, body, router.route.served_name, router.route.max_output_tokens
        )
        prompt = self.prompt(payload) if self.prompt and router.wants_prompt else None
        passing = _Passing(call, self, upstream_body, headers, self.wants_stream(payload))
        if not self.form:
            passing.lora = (payload, router.route.served_name)
        return forward(call, router, prompt, passing)

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


class _Passing:
    """One request of a passed-through route, on its way to replicas that serve the route."""

    __slots__ = ("body", "call", "headers", "lora", "route", "stream")

    def __init__(self, call: Call, route: PassThrough, body: bytes, headers: bytes, stream: bool):
        self.call = call
        self.route = route
        self.body = body
        self.headers = headers
        self.stream = stream
        # A JSON body and its served name, for an engine that applies
        # adapters by number (dialect.mend_lora): mended per replica.
        self.lora: tuple[dict[str, Any], str] | None = None

    def reroute(self, router: ModelRouter, replica: Replica) -> ModelRouter | None:
        # The replica that came while the request waited may run an engine
        # without this route: another of the model's may have it.
        current = self.call.rt.snapshot
        if current is None:
            return None
        return current.support.rerouted(router, replica, self.route.path)

    def post(self, router: ModelRouter, replica: Replica) -> Awaitable[Response]:
        upstream = self.call.rt.upstream
        target = upstream.target(replica.url, self.route.path, replica.engine_key,
                                 json=not self.route.form)  # fmt: skip
        body = self.body
        if replica.mending.lora_ids is not None and self.lora is not None:
            payload, served = self.lora
            if mend_lora(payload, served, replica.mending):
                body = self.body = orjson.dumps(payload)
        return upstream.post(target, body, self.call.request_id, self.headers)

    async def answer(
        self, response: Response, replica: Replica, prefill: Prefill, before: float
    ) -> int:
        kind = response.content_type or b""
        if self.stream and response.status == 200 and kind.startswith(_SSE):
            first = await first_chunk(self.call, response, prefill)
            return await _relay(self.call, self.route, response, first, before)
        return await answer_whole(self.call, response, prefill, before, usage_in)


class EventRelay(EventBuffer):
    """Passes an SSE stream on whole events at a time, noting its end, failure and usage."""

    __slots__ = ("_ends", "_fails", "ended", "failed", "usage")

    def __init__(self, ends: tuple[bytes, ...], fails: tuple[bytes, ...]) -> None:
        super().__init__()
        self._ends = ends
        self._fails = fails
        self.ended = False
        self.failed = False
        self.usage: Usage | None = None

    def feed(self, chunk: bytes) -> bytes:
        complete = self.whole_events(chunk)
        if not complete:
            return b""
        if not self.ended and any(mark in complete for mark in self._ends):
            self.ended = True
        if not self.failed and any(mark in complete for mark in self._fails):
            self.failed = True
        if any(mark in complete for mark in _USAGE_MARKS):
            self.usage = usage_in(complete) or self.usage
        return complete


async def _relay(
    call: Call, route: PassThrough, response: Response, first: bytes, before: float
) -> int:
    model = call.model
    relay = EventRelay(route.ends, route.fails)
    out = stream_out(call)
    failed = False
    try:
        out.start(200, call.stream_headers(before))
        try:
            chunk: bytes | None = first
            while chunk is not None:
                await out.stream(relay.feed(chunk))
                chunk = await response.next_chunk()
        except (BodyBroken, ConnectFailed, UpstreamTimeout) as exc:
            failed = True
            log.info("stream of %s on %s broke after it started: %s", model, route.path, exc)
            tail = relay.flush() + route.error_event(
                f"The model `{model}` stopped answering: {exc}", "upstream_error"
            )
            await out.stream(tail, False)
            return 200
        tail = relay.flush()
        if not relay.ended:
            failed = True
            tail += route.error_event(
                f"The model `{model}` ended its answer before finishing it; the answer is"
                " incomplete.",
                "upstream_incomplete",
            )
        await out.stream(tail, False)
        return 200
    finally:
        response.release()
        # Also a stream that broke or a client that left: what was generated is metered.
        account(call, relay.usage, failed or relay.failed)
