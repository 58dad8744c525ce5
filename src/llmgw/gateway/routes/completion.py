"""Chat, completions and embeddings: the routes every engine serves, mended for its dialect.

Each request is sent to engines of any dialect (:mod:`llmgw.gateway.dialect`):
its body is mended for the replica's engine (its served name, a limit it
ignores, a role it lacks, a usage request), re-encoded only where something
changed and again only when a retry lands on an engine of another dialect.
Its answer is passed on whole, relayed as a stream
(:mod:`llmgw.gateway.routes.chatstream`), or, for an engine that finishes an
unstreamed answer for a client who has left, assembled from a stream
(:mod:`llmgw.gateway.routes.assemble`). A stream that ends before its first
event is asked about once more, unstreamed
(:mod:`llmgw.gateway.routes.emptystream`).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import orjson

from llmgw.gateway.call import Call
from llmgw.gateway.checks.limits import cap_output_tokens
from llmgw.gateway.checks.validation import CHAT_PATH, COMPLETIONS_PATH, EMBEDDINGS_PATH
from llmgw.gateway.dialect import Mending, mend_lora, mend_request, refusal
from llmgw.gateway.forward import forward
from llmgw.gateway.front import parse
from llmgw.gateway.kvtokens import prompt_tokens
from llmgw.gateway.metering.counter import StreamCounter
from llmgw.gateway.metering.usage import find_usage
from llmgw.gateway.routes.answer import answer_whole, first_chunk
from llmgw.gateway.routes.assemble import answer_assembled
from llmgw.gateway.routes.chatstream import REPORTED, UNDECLARED, Counted, Ending, relay_stream
from llmgw.gateway.routes.emptystream import why_empty
from llmgw.gateway.routes.sse import StreamRelay
from llmgw.gateway.routing.prefill import Prefill
from llmgw.gateway.routing.prefixindex import render_chat, render_completion
from llmgw.gateway.routing.replica import Replica
from llmgw.gateway.routing.router import ModelRouter
from llmgw.gateway.types import Scope
from llmgw.http.upstream import Response


class CompletionRoute:
    """``/v1/chat/completions``, ``/v1/completions`` (``generates``) or ``/v1/embeddings``."""

    __slots__ = ("generates", "path")

    form = False  # their bodies are JSON

    def __init__(self, path: str) -> None:
        self.path = path
        # Chat and completions generate (their output is capped, they
        # stream, they are routed by prompt); embeddings do neither, and
        # not every engine computes them.
        self.generates = path != EMBEDDINGS_PATH

    @property
    def streams(self) -> bool:
        return self.generates

    def parse(self, scope: Scope, body: bytes) -> dict[str, Any]:
        return parse(body)

    def serve(
        self, call: Call, payload: dict[str, Any], body: bytes, router: ModelRouter
    ) -> Awaitable[int]:
        """The request forwarded to the model's replicas (its status, to await).

        Not a coroutine itself: the caller waits in forward's, one level less
        to resume at every wake-up of the request.
        """
        path = self.path
        if self.generates:
            cap = router.route.max_output_tokens
            if cap is not None and cap_output_tokens(payload, cap):
                body = orjson.dumps(payload)
            prompt = _prompt_text(path, payload) if router.wants_prompt else None
            if router.publishing and prompt is not None:
                asked = router.exact_live()
                if asked is not None:
                    return _exact_forward(call, router, prompt, payload, body, self, asked)
        else:
            prompt = None
            snapshot = call.rt.snapshot
            if snapshot is not None:
                router = snapshot.support.router(router, path)
        return forward(call, router, prompt, _Completion(call, self, payload, body))


async def _exact_forward(
    call: Call, router: ModelRouter, prompt: str, payload: dict[str, Any], body: bytes,
    route: CompletionRoute, asked: Replica,
) -> int:  # fmt: skip
    """forward, with the prompt tokenised first by ``asked`` (a replica whose cache is followed)."""
    tokens = await prompt_tokens(call.rt.upstream, asked, route.path, payload,
                                 router.route.served_name)  # fmt: skip
    return await forward(call, router, prompt, _Completion(call, route, payload, body), tokens)


def _prompt_text(path: str, payload: dict[str, Any]) -> str | None:
    if path == CHAT_PATH:
        return render_chat(payload.get("messages"))
    if path == COMPLETIONS_PATH:
        return render_completion(payload.get("prompt"))
    return None


class _Completion:
    """One request on its way to engines of any dialect (forward's attempt)."""

    __slots__ = ("asked", "assemble", "body", "call", "injected", "mending", "path", "payload",
                 "stream", "unstreamed")  # fmt: skip

    def __init__(
        self, call: Call, route: CompletionRoute, payload: dict[str, Any], body: bytes
    ) -> None:
        self.call = call
        self.path = route.path
        self.payload = payload
        generates = route.generates
        self.stream = payload.get("stream") is True and generates
        self.asked = self.stream and _asked_usage(payload)
        self.unstreamed = not self.stream and generates
        self.body = body  # as sent upstream: mended for ``mending``
        self.injected = False  # the gateway added include_usage to it
        self.mending: Mending | None = None
        self.assemble = False

    def reroute(self, router: ModelRouter, replica: Replica) -> ModelRouter | None:
        snapshot = self.call.rt.snapshot
        if self.path != EMBEDDINGS_PATH or snapshot is None:
            return None  # every engine serves chat and completions
        return snapshot.support.rerouted(router, replica, self.path)

    def post(self, router: ModelRouter, replica: Replica) -> Awaitable[Response]:
        call = self.call
        mending = replica.mending
        if mending is not self.mending:
            refused = refusal(self.path, self.payload, mending, call.model)
            if refused is not None:
                raise refused
            self.mending = mending
            self.body, added = _upstream_body(
                self.path, self.payload, self.body, router.route.served_name,
                call.rt.settings.inject_stream_usage, mending, self.stream,
            )  # fmt: skip
            self.injected = self.injected or added
        # An engine that finishes an unstreamed answer for a client who has
        # gone is asked for a stream instead (llmgw.gateway.routes.assemble).
        self.assemble = self.unstreamed and mending.assemble_unstreamed
        sent = _streamed_body(self.payload, mending) if self.assemble else self.body
        upstream = call.rt.upstream
        target = upstream.target(replica.url, self.path, replica.engine_key)
        return upstream.post(target, sent, call.request_id)

    def answer(
        self, response: Response, replica: Replica, prefill: Prefill, before: float
    ) -> Awaitable[int]:
        if response.status == 200:
            if self.stream:
                return self._streamed(response, replica, prefill, before)
            if self.assemble:
                return self._assembled(response, replica, prefill, before)
        return answer_whole(self.call, response, prefill, before, find_usage)

    async def _streamed(
        self, response: Response, replica: Replica, prefill: Prefill, before: float
    ) -> int:
        call = self.call
        first = await first_chunk(call, response, prefill)
        if not first:
            refused = await self._refused(response, replica, prefill, before)
            if refused is not None:
                return refused
        mending = replica.mending
        ending: Ending = UNDECLARED if mending.legacy else REPORTED
        if mending.count_streams:
            counter = StreamCounter(
                call.rt.upstream, replica, self.path, self.payload, call.request_id
            )
            counter.begin(waited_for=self.asked)
            ending = Counted(counter, self.asked)
        relay = StreamRelay(self.injected, hold_done=ending.hold_done, observe=ending.observe)
        return await relay_stream(call, response, first, before, relay, ending)

    async def _assembled(
        self, response: Response, replica: Replica, prefill: Prefill, before: float
    ) -> int:
        call = self.call
        first = await first_chunk(call, response, prefill, ttft=False)
        if not first:
            refused = await self._refused(response, replica, prefill, before)
            if refused is not None:
                return refused
        return await answer_assembled(call, response, first, self.path, self.payload, replica,
                                      before)  # fmt: skip

    async def _refused(
        self, response: Response, replica: Replica, prefill: Prefill, before: float
    ) -> int | None:
        """Answer with the engine's refusal of a request whose stream ended empty (the status).

        llama_cpp.server refuses a prompt longer than its context inside the
        stream, which then ends without an event; unstreamed, it answers 400
        (llmgw.gateway.routes.emptystream). None: no refusal, the empty
        stream is answered as one that ended early.
        """
        response.release()  # whole: its connection may serve the question
        call = self.call
        why = await why_empty(call.rt.upstream, replica, self.path, self.payload, call.request_id)
        if why is None:
            return None
        try:
            return await answer_whole(call, why, prefill, before, find_usage)
        finally:
            why.release()


def _upstream_body(
    path: str, payload: dict[str, Any], body: bytes, served: str, inject_usage: bool,
    mending: Mending, stream: bool,
) -> tuple[bytes, bool]:  # fmt: skip
    """(body to send, whether the gateway added include_usage), ``payload`` mended in place.

    Called again only when a retry lands on an engine of another dialect,
    with the body sent before: what was mended then stays mended.
    """
    changed = payload.get("model") != served
    if changed:
        payload["model"] = served
    if mend_request(path, payload, mending):
        changed = True
    if mend_lora(payload, served, mending):
        changed = True
    injected = False
    if stream and inject_usage:
        options = payload.get("stream_options")
        if not isinstance(options, dict):
            payload["stream_options"] = {"include_usage": True}
            injected = changed = True
        elif options.get("include_usage") is not True:
            options["include_usage"] = True
            injected = changed = True
    return (orjson.dumps(payload) if changed else body), injected


def _asked_usage(payload: dict[str, Any]) -> bool:
    options = payload.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _streamed_body(payload: dict[str, Any], mending: Mending) -> bytes:
    body = dict(payload, stream=True)
    body.pop("stream_options", None)
    if mending.reports_stream_usage:
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)
