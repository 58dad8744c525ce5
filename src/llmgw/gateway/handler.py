"""One OpenAI request, from bytes in to bytes out: the gateway's hot path.

Order of work is chosen so that the cheap refusals come first (no config, bad
key, body too big) and nothing is parsed twice: the body is parsed once, the
model looked up in a dict built per config version, the prompt hashed only
when the model's policy needs it, and the body re-encoded only when the
upstream must see something different (its served name, a usage request).

:func:`handle` is the front half every /v1 POST shares; chat, completions
and embeddings are then served here, the other routes by
:mod:`llmgw.gateway.passthrough`, both through :mod:`llmgw.gateway.forward`.

Time spent waiting for an on-demand replica or for the engine is excluded from
the overhead header: it reports what the gateway itself added.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from typing import Any, Protocol

import orjson

from llmgw.gateway.apiroutes import EMBEDDINGS, rerouted, route_router
from llmgw.gateway.assemble import Assembler
from llmgw.gateway.call import Call
from llmgw.gateway.checks.auth import KeyRecord, limit
from llmgw.gateway.checks.limits import cap_output_tokens
from llmgw.gateway.checks.validation import check_request
from llmgw.gateway.dialect import Mending, mend_request, refusal
from llmgw.gateway.emptystream import why_empty
from llmgw.gateway.forward import answer_whole, first_chunk, forward
from llmgw.gateway.front import (
    WATCH_AFTER_S,
    ClientGone,
    Runtime,
    Watch,
    authenticate,
    configured_snapshot,
    headers_of,
    new_request_id,
    parse,
    read_body,
    resolve,
    start_watch,
)
from llmgw.gateway.metering.account import account, count_later
from llmgw.gateway.metering.counter import ANSWER_COUNT_TIMEOUT_S, StreamCounter
from llmgw.gateway.metering.tally import StreamTally
from llmgw.gateway.metering.usage import Usage, counted_usage, find_usage, usage_of
from llmgw.gateway.proxy import StreamRelay, sse_error
from llmgw.gateway.responses import (
    JSON,
    REQUEST_ID,
    ApiError,
    Streamer,
    overhead_header,
    send_bytes,
    send_error,
)
from llmgw.gateway.routing.prefill import Prefill
from llmgw.gateway.routing.prefixindex import render_chat, render_completion
from llmgw.gateway.routing.replica import Replica
from llmgw.gateway.routing.router import ModelRouter
from llmgw.gateway.types import Receive, Scope, Send
from llmgw.http.upstream import BodyBroken, ConnectFailed, Response, UpstreamTimeout

log = logging.getLogger(__name__)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
POST_PATHS = {CHAT, COMPLETIONS, EMBEDDINGS}
STREAMABLE = {CHAT, COMPLETIONS}


def prompt_text(path: str, payload: dict[str, Any]) -> str | None:
    if path == CHAT:
        return render_chat(payload.get("messages"))
    if path == COMPLETIONS:
        return render_completion(payload.get("prompt"))
    return None


class Route(Protocol):
    """A POST route whose body and answers another module knows (llmgw.gateway.passthrough).

    It shares everything here up to the choice of a replica (auth, body cap,
    validation, the model, limits, a client that leaves) and proxies itself.
    """

    def parse(self, scope: Scope, body: bytes) -> dict[str, Any]: ...

    async def proxy(
        self, call: Call, payload: dict[str, Any], body: bytes, router: ModelRouter
    ) -> int: ...


async def handle(
    rt: Runtime, scope: Scope, receive: Receive, send: Send, route: Route | None = None
) -> None:
    """Serve one POST to a proxied /v1 path (``route``: one served by another module)."""
    started = time.perf_counter()
    request_id = new_request_id()
    id_header = (REQUEST_ID, request_id.encode())
    model = "-"
    record: KeyRecord | None = None
    watch: Watch | None = None
    timer: asyncio.TimerHandle | None = None
    status = 500
    path: str = scope["path"]
    try:
        snapshot = configured_snapshot(rt)
        headers = headers_of(scope)
        record = authenticate(rt, snapshot, headers.get(b"authorization"))
        body = await read_body(receive, rt.settings.max_body_bytes, headers.get(b"content-length"))
        payload = parse(body) if route is None else route.parse(scope, body)
        check_request(path, payload)  # before anything is routed or woken
        router = resolve(snapshot, record, payload)
        model = router.route.name
        cap = router.route.max_output_tokens
        if cap is not None and path in STREAMABLE and cap_output_tokens(payload, cap):
            body = orjson.dumps(payload)
        refusal = limit(record, time.monotonic())
        if refusal is not None:
            raise ApiError(
                429,
                refusal.message,
                kind=refusal.kind,
                code=refusal.code,
                retry_after=refusal.retry_after_s,
            )
        cancel_if_gone = getattr(send, "cancel_if_gone", None)
        if cancel_if_gone is not None:
            # llmgw's server cancels this task itself when the client leaves
            # (llmgw.http.cycle): no timer, no watcher task, no delay.
            cancel_if_gone()
        else:
            task = asyncio.current_task()
            if task is not None:
                watch = Watch()
                timer = asyncio.get_running_loop().call_later(
                    WATCH_AFTER_S, start_watch, receive, task, watch
                )
        current = rt.snapshot
        rename = current.renames.get(model) if current is not None else None
        call = Call(rt, record, model, started, request_id, id_header, send, rename)
        if route is None:
            # _Completion's steps are plain calls returning what to await:
            # this frame waits in the upstream client's own.
            prompt = prompt_text(path, payload) if router.wants_prompt else None
            if path == EMBEDDINGS:  # not every engine computes embeddings
                router = route_router(current, router, path)
            status = await forward(call, router, prompt, _Completion(call, path, payload, body))
        else:
            status = await route.proxy(call, payload, body, router)
    except ApiError as refused:
        status = refused.status
        overhead = overhead_header(time.perf_counter() - started)
        await send_error(send, refused, [id_header, overhead])
        if record is not None and model != "-":
            rt.usage.add(int(time.time()) // 60 * 60, record.key_id, model, 0, 0, 0, True)
    except ClientGone:
        status = 499  # nginx's "client closed request": nobody to answer
    except asyncio.CancelledError:
        if not (watch.gone if watch is not None else getattr(send, "disconnected", False)):
            raise
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        status = 499
    except Exception:
        log.exception("request %s failed inside the gateway", request_id)
        status = 500
        failure = ApiError(
            500,
            "The gateway failed to handle this request.",
            kind="server_error",
            code="internal_error",
        )
        # If the answer had already started, there is no status left to send.
        with contextlib.suppress(Exception):
            await send_error(send, failure, [id_header])
    finally:
        if watch is not None:
            watch.done = True
            if timer is not None:
                timer.cancel()
            if watch.task is not None:
                watch.task.cancel()
    rt.metrics.finished(model, status, time.perf_counter() - started)


class _Completion:
    """A chat, completion or embedding request on its way to engines of any dialect."""

    __slots__ = ("asked", "assemble", "body", "call", "injected", "mending", "path", "payload",
                 "stream", "unstreamed")  # fmt: skip

    def __init__(self, call: Call, path: str, payload: dict[str, Any], body: bytes) -> None:
        self.call = call
        self.path = path
        self.payload = payload
        self.stream = payload.get("stream") is True and path in STREAMABLE
        self.asked = self.stream and _asked_usage(payload)
        self.unstreamed = not self.stream and path in STREAMABLE
        self.body = body  # as sent upstream: mended for ``mending``
        self.injected = False  # the gateway added include_usage to it
        self.mending: Mending | None = None
        self.assemble = False

    def reroute(self, router: ModelRouter, replica: Replica) -> ModelRouter | None:
        if self.path != EMBEDDINGS:
            return None  # every engine serves chat and completions
        current = self.call.rt.snapshot
        return rerouted(current, router, replica, self.path)

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
        # gone is asked for a stream instead (llmgw.gateway.assemble).
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
        counter = None
        if replica.mending.count_streams:
            counter = StreamCounter(
                call.rt.upstream, replica, self.path, self.payload, call.request_id
            )
            counter.begin()
        return await _relay(call, response, first, before, counter, self.injected,
                            self.asked, replica.mending.legacy)  # fmt: skip

    async def _assembled(
        self, response: Response, replica: Replica, prefill: Prefill, before: float
    ) -> int:
        call = self.call
        first = await first_chunk(call, response, prefill, ttft=False)
        if not first:
            refused = await self._refused(response, replica, prefill, before)
            if refused is not None:
                return refused
        return await _assemble(call, response, first, self.path, self.payload, replica,
                               before)  # fmt: skip

    async def _refused(
        self, response: Response, replica: Replica, prefill: Prefill, before: float
    ) -> int | None:
        """Answer with the engine's refusal of a request whose stream ended empty (the status).

        llama_cpp.server refuses a prompt longer than its context inside the
        stream, which then ends without an event; unstreamed, it answers 400
        (llmgw.gateway.emptystream). None: no refusal, the empty stream is
        answered as one that ended early.
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


async def _relay(
    call: Call, response: Response, first: bytes, before: float, counter: StreamCounter | None,
    injected: bool, asked: bool, legacy: bool,
) -> int:  # fmt: skip
    """Relay a stream; ``counter`` given: the engine sends no usage, the gateway counts it."""
    model = call.model
    tally = StreamTally() if counter is not None else None
    relay = StreamRelay(
        strip_usage=injected,
        hold_done=tally is not None,
        observe=tally.add if tally is not None else None,
    )
    send = call.stream_send()
    # llmgw's server streams without ASGI messages (llmgw.http.connection); its
    # head waits for the first events, so each turn below sends before it waits.
    direct: Streamer | None = send if hasattr(send, "stream") else None  # type: ignore[assignment]
    failed = False
    usage: Usage | None = None
    counted = False  # else a counted stream is counted after it, off the client's time
    try:
        if direct is not None:
            direct.start(200, call.stream_headers(before))
        else:
            await send(call.stream_start(before))
        last = b""
        try:
            chunk: bytes | None = first
            while chunk is not None:
                out = relay.feed(chunk)
                if response.drained and (counter is None or not asked):
                    # The engine's answer is over: its last events go out with
                    # the stream's end, one write to the client instead of two
                    # (not when a count must come first: they would wait for it).
                    last = out
                    break
                if direct is not None:
                    await direct.stream(out)
                elif out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                chunk = await response.next_chunk()
        except (BodyBroken, ConnectFailed, UpstreamTimeout) as exc:
            failed = True
            log.info("stream of %s broke after it started: %s", model, exc)
            tail = relay.flush() + sse_error(f"The model `{model}` stopped answering: {exc}")
            if direct is not None:
                await direct.stream(tail, False)
            else:
                await send({"type": "http.response.body", "body": tail, "more_body": False})
            return 200
        tail = last + relay.flush()
        if not relay.whole:
            # Cut short by the engine yet ended as if complete: the client
            # must not take the short answer for the whole one.
            failed = True
            log.info("stream of %s ended early (finish reason: %s, [DONE]: %s)",
                     model, relay.finished, relay.done)  # fmt: skip
            tail += sse_error(
                f"The model `{model}` ended its answer before finishing it (the engine sent"
                " no finish_reason); the answer is incomplete.",
                code="upstream_incomplete",
            )
        elif counter is not None and tally is not None:
            if asked:
                usage, complete = await counter.usage(tally)
                counted = True
                if complete:
                    tail += tally.usage_event(usage, counter.chat)
            tail += b"data: [DONE]\n\n"
        if direct is not None:
            await direct.stream(tail, False)
        else:
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        return 200
    finally:
        response.release()
        if counter is not None and tally is not None and not counted:
            # Also a stream that broke or was cut: what the client received
            # was generated, and is metered.
            count_later(call, counter, tally, failed)
        else:
            if usage is None:
                usage = relay.usage
            if usage is None and legacy and relay.events:
                # An engine of an agent that declares no dialect may send no
                # usage: one event is about one token (the old estimate).
                usage = Usage(completion=max(0, relay.events - 1))
            account(call, usage, failed)


async def _assemble(
    call: Call, response: Response, first: bytes, path: str, payload: dict[str, Any],
    replica: Replica, before: float,
) -> int:  # fmt: skip
    """Read a stream to its end and answer with the unstreamed answer built from it.

    Nothing reaches the client before the end, so a stream that breaks is
    retried elsewhere like any unstreamed answer (BodyBroken propagates). A
    client that leaves cancels this task: the connection to the engine
    closes (the point of streaming), and what was generated is metered.
    """
    assembler = Assembler(path == CHAT)
    relay = StreamRelay(strip_usage=False, hold_done=True, observe=assembler.add)
    counter: StreamCounter | None = None
    if replica.mending.count_streams:
        counter = StreamCounter(call.rt.upstream, replica, path, payload, call.request_id)
        counter.begin()
    try:
        chunk: bytes | None = first
        while chunk is not None:
            relay.feed(chunk)
            chunk = await response.next_chunk()
        relay.feed(relay.flush() + b"\n\n")  # an engine that ends without a blank line
    except asyncio.CancelledError:
        _meter_failed(call, counter, assembler)
        raise
    finally:
        response.release()
    if assembler.error is not None or not (relay.whole and assembler.finished):
        error = assembler.error or {}
        why = error.get("message") or "the engine ended its answer before finishing it"
        _meter_failed(call, counter, assembler)
        failure = ApiError(502, f"The model `{call.model}` failed: {why}", kind="server_error",
                           code="upstream_incomplete")  # fmt: skip
        await send_error(call.send, failure, [call.id_header, overhead_header(before)])
        return 502
    usage_body = assembler.usage
    if usage_body is not None or counter is None:
        metered = usage_of(usage_body)
    else:
        # Before the answer: its usage is part of it.
        metered, complete = await counter.usage(assembler.tally, ANSWER_COUNT_TIMEOUT_S)
        usage_body = counted_usage(metered) if complete else None
    built_at = time.perf_counter()
    data = assembler.answer(usage_body)
    if call.rename is not None:
        data = call.rename(data)
    account(call, metered, False)
    overhead = before + (time.perf_counter() - built_at)
    call.rt.metrics.overhead_hist.observe(overhead)
    await send_bytes(call.send, 200, data, JSON, [call.id_header, overhead_header(overhead)])
    return 200


def _meter_failed(call: Call, counter: StreamCounter | None, assembler: Assembler) -> None:
    """Meter what an assembled answer that failed or was left had generated."""
    if counter is not None:
        count_later(call, counter, assembler.tally, True)
    else:
        account(call, usage_of(assembler.usage), True)
