"""One OpenAI request, from bytes in to bytes out: the gateway's hot path.

Order of work is chosen so that the cheap refusals come first (no config, bad
key, body too big) and nothing is parsed twice: the body is parsed once, the
model looked up in a dict built per config version, the prompt hashed only
when the model's policy needs it, and the body re-encoded only when the
upstream must see something different (its served name, a usage request).

Time spent waiting for an on-demand replica or for the engine is excluded from
the overhead header: it reports what the gateway itself added.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import count
from typing import Any, Protocol

import orjson

from llmgw.gateway.assemble import Assembler, counted_usage, usage_of
from llmgw.gateway.auth import KeyRecord, authorize, limit
from llmgw.gateway.dialect import (
    METER_TIMEOUT_S,
    Mending,
    StreamCounter,
    StreamTally,
    mend_request,
)
from llmgw.gateway.external import renaming_send
from llmgw.gateway.http1 import BodyBroken, ConnectFailed, Response, UpstreamTimeout
from llmgw.gateway.limits import cap_output_tokens
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.ondemand import WaitRoom
from llmgw.gateway.prefix import render_chat, render_completion
from llmgw.gateway.proxy import StreamRelay, Upstream, Usage, find_usage, sse_error
from llmgw.gateway.responses import (
    JSON,
    REQUEST_ID,
    ApiError,
    overhead_header,
    send_bytes,
    send_error,
    send_json,
)
from llmgw.gateway.routing import ModelRouter, Pick, Replica
from llmgw.gateway.settings import GatewaySettings
from llmgw.gateway.snapshot import Snapshot
from llmgw.gateway.types import Receive, Scope, Send
from llmgw.gateway.usage import UsageBatcher
from llmgw.gateway.validation import check_request

log = logging.getLogger(__name__)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
POST_PATHS = {CHAT, COMPLETIONS, EMBEDDINGS}
STREAMABLE = {CHAT, COMPLETIONS}

_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
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
    snapshot: Snapshot | None = None


# A request answered faster than this never pays for a disconnect watcher
# (a task per request was ~5 % of the gateway's CPU); a client that leaves a
# long generation is noticed at most this late.
_WATCH_AFTER_S = 0.05


class _ClientGone(Exception):
    """The client hung up before its request was complete."""


class _Watch:
    """Shared between a request and its disconnect watcher."""

    __slots__ = ("done", "gone", "task")

    def __init__(self) -> None:
        self.done = False
        self.gone = False
        self.task: asyncio.Task[None] | None = None


def _start_watch(receive: Receive, request: asyncio.Task[Any], watch: _Watch) -> None:
    if not watch.done:
        watch.task = asyncio.get_running_loop().create_task(
            _watch_disconnect(receive, request, watch)
        )


async def _watch_disconnect(receive: Receive, request: asyncio.Task[Any], watch: _Watch) -> None:
    # After the body, the next ASGI message is http.disconnect: either the
    # client left (cancel the upstream request, it is wasted GPU time) or the
    # server finished the response (``done`` is already set then).
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
    if not watch.done:
        watch.gone = True
        request.cancel()


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value  # type: ignore[no-any-return]
    return None


def authenticate(rt: Runtime, snapshot: Snapshot, scope: Scope) -> KeyRecord:
    raw = _header(scope, b"authorization")
    if raw is None:
        if rt.settings.allow_anonymous:
            return snapshot.keys.anonymous
        raise ApiError(
            401,
            "You didn't provide an API key. Send it as 'Authorization: Bearer sk-llmgw-...'.",
            code="invalid_api_key",
        )
    record = snapshot.keys.by_header.get(raw)
    if record is None:
        scheme, _, token = raw.decode("latin-1").partition(" ")
        token = token.strip()
        record = snapshot.keys.lookup(token) if scheme.lower() == "bearer" and token else None
        if record is None:
            shown = f"{token[:8]}****{token[-4:]}" if len(token) > 16 else "****"
            raise ApiError(401, f"Incorrect API key provided: {shown}.", code="invalid_api_key")
        snapshot.keys.remember(raw, record)
    refusal = authorize(record)
    if refusal is not None:
        raise ApiError(refusal.status, refusal.message, kind=refusal.kind, code=refusal.code)
    return record


async def read_body(scope: Scope, receive: Receive, max_bytes: int) -> bytes:
    declared = _header(scope, b"content-length")
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
            raise _ClientGone
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


def resolve(snapshot: Snapshot, record: KeyRecord, payload: dict[str, Any]) -> ModelRouter:
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "The request must name a 'model'.", param="model", code="missing_model")
    router = snapshot.routes.get(model)
    if router is None or not record.may_use(router.route):
        raise ApiError(
            404,
            f"The model `{model}` does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )
    return router


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
        self, rt: Runtime, payload: dict[str, Any], body: bytes, router: ModelRouter,
        record: KeyRecord, started: float, request_id: str, id_header: tuple[bytes, bytes],
        send: Send,
    ) -> int: ...  # fmt: skip


async def handle(
    rt: Runtime, scope: Scope, receive: Receive, send: Send, route: Route | None = None
) -> None:
    """Serve one POST to a proxied /v1 path (``route``: one served by another module)."""
    started = time.perf_counter()
    request_id = new_request_id()
    id_header = (REQUEST_ID, request_id.encode())
    model = "-"
    record: KeyRecord | None = None
    watch = _Watch()
    timer: asyncio.TimerHandle | None = None
    status = 500
    try:
        snapshot = configured_snapshot(rt)
        record = authenticate(rt, snapshot, scope)
        body = await read_body(scope, receive, rt.settings.max_body_bytes)
        payload = parse(body) if route is None else route.parse(scope, body)
        check_request(scope["path"], payload)  # before anything is routed or woken
        router = resolve(snapshot, record, payload)
        model = router.route.name
        cap = router.route.max_output_tokens
        if cap is not None and scope["path"] in STREAMABLE and cap_output_tokens(payload, cap):
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
        task = asyncio.current_task()
        if task is not None:
            timer = asyncio.get_running_loop().call_later(
                _WATCH_AFTER_S, _start_watch, receive, task, watch
            )
        if route is None:
            status = await _proxy(rt, scope["path"], payload, body, router, record, started,
                                  request_id, id_header, send)  # fmt: skip
        else:
            status = await route.proxy(rt, payload, body, router, record, started, request_id,
                                       id_header, send)  # fmt: skip
    except ApiError as refused:
        status = refused.status
        overhead = overhead_header(time.perf_counter() - started)
        await send_error(send, refused, [id_header, overhead])
        if record is not None and model != "-":
            rt.usage.add(int(time.time()) // 60 * 60, record.key_id, model, 0, 0, 0, True)
    except _ClientGone:
        status = 499  # nginx's "client closed request": nobody to answer
    except asyncio.CancelledError:
        if not watch.gone:
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
        watch.done = True
        if timer is not None:
            timer.cancel()
        if watch.task is not None:
            watch.task.cancel()
    rt.metrics.request(model, status)
    rt.metrics.latency(model, time.perf_counter() - started)


async def _replica_for(
    rt: Runtime, router: ModelRouter, prompt: str | None, tried: list[Replica], deadline: float
) -> tuple[ModelRouter, Pick | None, float]:
    """A pick, waiting for a replica if the model has none to offer (and the time waited).

    Any model waits while it has no replica at all. An on-demand model also
    waits while every replica it has is cooling down or failed this request:
    that is how its requests ride out the loss of its only replica's node,
    until the control plane's replacement arrives (or the cooled replica
    answers again), instead of failing with 503 meanwhile. ``deadline``
    (time.monotonic()) is the request's, however many times it waits.
    """
    on_demand = router.route.on_demand
    pick = router.pick(prompt, tried, fallback=not on_demand)
    if pick is not None or (tried and not on_demand):
        return router, pick, 0.0
    name = router.route.name
    if router.route.parked:
        raise ApiError(
            503,
            f"The model `{name}` cannot be started: {router.route.parked_reason or 'parked'}.",
            kind="service_unavailable_error",
            code="model_parked",
            retry_after=rt.settings.retry_after_s * 12,
        )
    if rt.room.full(name):
        raise ApiError(
            429,
            f"Too many requests are waiting for the model `{name}` to start.",
            kind="requests",
            code="rate_limit_exceeded",
            retry_after=rt.settings.retry_after_s,
        )
    began = time.monotonic()
    if rt.room.enter(name):
        rt.demand(name)
    try:
        while True:
            # Woken by a config that serves the model, or when a cooled (or
            # just failed) replica may be tried again: it may only have restarted.
            wake_at = min(deadline, router.cooling_ends() or deadline)
            if tried:
                wake_at = min(wake_at, time.monotonic() + rt.settings.cooldown_s)
            await rt.room.wait(name, wake_at)
            snapshot = rt.snapshot
            fresh = snapshot.routes.get(name) if snapshot is not None else None
            if fresh is not None:
                router = fresh
                pick = router.pick(prompt, fallback=not on_demand)
                if pick is not None:
                    return router, pick, time.monotonic() - began
            if time.monotonic() >= deadline:
                raise ApiError(
                    503,
                    f"The model `{name}` is starting and was not ready in time.",
                    kind="service_unavailable_error",
                    code="model_not_ready",
                    retry_after=rt.settings.retry_after_s,
                )
    finally:
        rt.room.leave(name)


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


class _Prefill:
    """Uncached prompt tokens charged to a replica until its answer starts.

    The start of the answer is also when the replica holds the prompt's
    prefix (so the router records it then) and, for a stream that queued
    behind none of this gateway's other prefills on the replica, a
    measurement of the model's prefill speed.
    """

    __slots__ = ("ahead", "pick", "router", "sent_at", "tokens")

    def __init__(self, router: ModelRouter, pick: Pick) -> None:
        self.router = router
        self.pick = pick
        self.tokens = pick.uncached_tokens
        self.ahead = pick.replica.pending_prefill
        pick.replica.pending_prefill += self.tokens
        self.sent_at = time.perf_counter()

    def started(self, streamed: bool) -> None:
        if streamed and self.ahead < 1.0:
            self.router.measured(self.tokens, time.perf_counter() - self.sent_at)
        self.router.record(self.pick)
        self.done()

    def done(self) -> None:
        if self.tokens:
            self.pick.replica.pending_prefill -= self.tokens
            self.tokens = 0.0


async def _proxy(
    rt: Runtime,
    path: str,
    payload: dict[str, Any],
    body: bytes,
    router: ModelRouter,
    record: KeyRecord,
    started: float,
    request_id: str,
    id_header: tuple[bytes, bytes],
    send: Send,
) -> int:
    settings = rt.settings
    metrics = rt.metrics
    prompt = prompt_text(path, payload) if router.policy == "prefix" else None
    stream = payload.get("stream") is True and path in STREAMABLE
    asked = stream and _asked_usage(payload)
    unstreamed = not stream and path in STREAMABLE
    upstream_body, injected = body, False
    mending: Mending | None = None
    model = router.route.name
    # An external model's answers carry the upstream's name for it: put back
    # the catalog's (llmgw.gateway.external).
    rename = rt.snapshot.renames.get(model) if rt.snapshot is not None else None
    tried: list[Replica] = []
    waited = 0.0
    wait_deadline = time.monotonic() + settings.queue_wait_s
    attempts = 0
    while attempts <= settings.retries:
        router, pick, wait = await _replica_for(rt, router, prompt, tried, wait_deadline)
        waited += wait
        if pick is None:
            break
        # After a wait the retries start again: what failed before it is
        # gone or back, and the wait itself is bounded by its deadline.
        attempts = 1 if wait else attempts + 1
        replica = pick.replica
        if replica.mending is not mending:
            mending = replica.mending
            upstream_body, added = _upstream_body(
                path, payload, upstream_body, router.route.served_name,
                settings.inject_stream_usage, mending, stream,
            )  # fmt: skip
            injected = injected or added
        if not tried:
            metrics.routed(model, pick.outcome)
        replica.in_flight += 1
        replica.requests += 1
        replica.last_request_at = time.time()
        prefill = _Prefill(router, pick)
        metrics.in_flight(model, 1)
        before = time.perf_counter() - started - waited
        response: Response | None = None
        # An engine that finishes an unstreamed answer for a client who has
        # gone is asked for a stream instead (llmgw.gateway.assemble).
        assemble = unstreamed and replica.mending.assemble_unstreamed
        sent = _streamed_body(payload, replica.mending) if assemble else upstream_body
        try:
            response = await rt.upstream.post(
                rt.upstream.target(replica.url, path, replica.engine_key), sent, request_id
            )
            if response.status in (401, 403):
                # The engine refused the gateway's engine key (a routing table
                # older than the engine): no fault of the client's key, and
                # another replica may take the request, as if unreachable.
                raise ConnectFailed(f"engine refused the engine key ({response.status})")
            replica.connect_succeeded()
            if stream and response.status == 200:
                # Nothing goes to the client before the first chunk, so a replica
                # that dies during prefill is still retried elsewhere.
                first = await response.next_chunk()
                prefill.started(streamed=True)
                metrics.ttft(model, time.perf_counter() - started - waited)
                relayed, response = response, None
                counter = None
                if replica.mending.count_streams:
                    counter = StreamCounter(rt.upstream, replica, path, payload, request_id)
                    counter.begin()
                out = send if rename is None else renaming_send(send, rename)
                return await _relay(rt, relayed, first or b"", model, record, injected,
                                    before, id_header, out, counter, asked,
                                    replica.mending.legacy)  # fmt: skip
            if assemble and response.status == 200:
                first = await response.next_chunk()
                prefill.started(streamed=True)
                relayed, response = response, None
                return await _assemble(rt, relayed, first or b"", path, payload, replica,
                                       model, record, before, id_header, send, request_id,
                                       rename)  # fmt: skip
            if response.status == 200:
                prefill.started(streamed=False)
            else:
                prefill.done()
            data = await response.read()
            if rename is not None:
                data = rename(data)
            return await _answer(rt, response, data, model, record, before,
                                 time.perf_counter(), id_header, send)  # fmt: skip
        except (ConnectFailed, BodyBroken) as exc:
            # Nothing reached the client yet: another replica may answer.
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


def _account(rt: Runtime, model: str, record: KeyRecord, usage: Usage | None, error: bool) -> None:
    usage = usage or Usage()
    total = usage.prompt + usage.completion
    if total and record.tpm is not None:
        record.tpm.charge(total)
    minute = int(time.time()) // 60 * 60
    rt.usage.add(minute, record.key_id, model, usage.prompt, usage.completion, usage.cached, error)
    rt.metrics.tokens(model, usage.prompt, usage.completion, usage.cached)


async def _answer(
    rt: Runtime, response: Response, data: bytes, model: str, record: KeyRecord,
    before: float, read_at: float, id_header: tuple[bytes, bytes], send: Send,
) -> int:  # fmt: skip
    status = response.status
    ok = status < 400
    _account(rt, model, record, find_usage(data) if ok else None, not ok)
    overhead = before + (time.perf_counter() - read_at)
    rt.metrics.overhead(overhead)
    await send_bytes(
        send, status, data, response.content_type or JSON, [id_header, overhead_header(overhead)]
    )
    return status


async def _relay(
    rt: Runtime, response: Response, first: bytes, model: str, record: KeyRecord,
    injected: bool, before: float, id_header: tuple[bytes, bytes], send: Send,
    counter: StreamCounter | None, asked: bool, legacy: bool,
) -> int:  # fmt: skip
    """Relay a stream; ``counter`` given: the engine sends no usage, the gateway counts it."""
    tally = StreamTally() if counter is not None else None
    relay = StreamRelay(
        strip_usage=injected,
        hold_done=tally is not None,
        observe=tally.add if tally is not None else None,
    )
    rt.metrics.overhead(before)
    failed = False
    usage: Usage | None = None
    counted = False  # else a counted stream is counted after it, off the client's time
    try:
        await send({
            "type": "http.response.start", "status": 200,
            "headers": [*_SSE_HEADERS, id_header, overhead_header(before)],
        })  # fmt: skip
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
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                chunk = await response.next_chunk()
        except (BodyBroken, ConnectFailed, UpstreamTimeout) as exc:
            failed = True
            log.info("stream of %s broke after it started: %s", model, exc)
            tail = relay.flush() + sse_error(f"The model `{model}` stopped answering: {exc}")
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
        await send({"type": "http.response.body", "body": tail, "more_body": False})
        return 200
    finally:
        response.release()
        if counter is not None and tally is not None and not counted:
            # Also a stream that broke or was cut: what the client received
            # was generated, and is metered.
            _count_later(rt, model, record, counter, tally, failed)
        else:
            if usage is None:
                usage = relay.usage
            if usage is None and legacy and relay.events:
                # An engine of an agent that declares no dialect may send no
                # usage: one event is about one token (the old estimate).
                usage = Usage(completion=max(0, relay.events - 1))
            _account(rt, model, record, usage, failed)


def _streamed_body(payload: dict[str, Any], mending: Mending) -> bytes:
    body = dict(payload, stream=True)
    body.pop("stream_options", None)
    if mending.reports_stream_usage:
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


async def _assemble(
    rt: Runtime, response: Response, first: bytes, path: str, payload: dict[str, Any],
    replica: Replica, model: str, record: KeyRecord, before: float,
    id_header: tuple[bytes, bytes], send: Send, request_id: str,
    rename: Callable[[bytes], bytes] | None,
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
        counter = StreamCounter(rt.upstream, replica, path, payload, request_id)
        counter.begin()
    try:
        chunk: bytes | None = first
        while chunk is not None:
            relay.feed(chunk)
            chunk = await response.next_chunk()
        relay.feed(relay.flush() + b"\n\n")  # an engine that ends without a blank line
    except asyncio.CancelledError:
        if counter is not None:
            _count_later(rt, model, record, counter, assembler.tally, True)
        else:
            _account(rt, model, record, usage_of(assembler.usage), True)
        raise
    finally:
        response.release()
    if assembler.error is not None or not (relay.whole and assembler.finished):
        error = assembler.error or {}
        why = error.get("message") or "the engine ended its answer before finishing it"
        if counter is not None:
            _count_later(rt, model, record, counter, assembler.tally, True)
        else:
            _account(rt, model, record, usage_of(assembler.usage), True)
        failure = ApiError(502, f"The model `{model}` failed: {why}", kind="server_error",
                           code="upstream_incomplete")  # fmt: skip
        await send_error(send, failure, [id_header, overhead_header(before)])
        return 502
    usage_body = assembler.usage
    if usage_body is not None or counter is None:
        metered = usage_of(usage_body)
    else:
        # Before the answer: its usage is part of it.
        metered, complete = await counter.usage(assembler.tally)
        usage_body = counted_usage(metered) if complete else None
    built_at = time.perf_counter()
    data = assembler.answer(usage_body)
    if rename is not None:
        data = rename(data)
    _account(rt, model, record, metered, False)
    overhead = before + (time.perf_counter() - built_at)
    rt.metrics.overhead(overhead)
    await send_bytes(send, 200, data, JSON, [id_header, overhead_header(overhead)])
    return 200


_later: set[asyncio.Task[None]] = set()


async def settle_counts(timeout_s: float) -> None:
    """Wait (at most ``timeout_s``) for streams still being counted, so a stop meters them."""
    if _later:
        await asyncio.wait(set(_later), timeout=timeout_s)


def _count_later(
    rt: Runtime, model: str, record: KeyRecord, counter: StreamCounter, tally: StreamTally,
    failed: bool,
) -> None:  # fmt: skip
    """Count a stream the client did not want usage for after its answer ended."""

    async def count() -> None:
        usage, _ = await counter.usage(tally, METER_TIMEOUT_S)
        _account(rt, model, record, usage, failed)

    task = asyncio.get_running_loop().create_task(count())
    _later.add(task)
    task.add_done_callback(_later.discard)


def configured_snapshot(rt: Runtime) -> Snapshot:
    """The routing snapshot, or a 503 before the first config has arrived."""
    snapshot = rt.snapshot
    if snapshot is None:
        raise ApiError(
            503,
            "The gateway has not received its configuration yet.",
            kind="service_unavailable_error",
            code="not_ready",
            retry_after=1,
        )
    return snapshot


async def list_models(rt: Runtime, scope: Scope, send: Send) -> None:
    request_id = new_request_id()
    extra = [(REQUEST_ID, request_id.encode())]
    try:
        snapshot = configured_snapshot(rt)
        record = authenticate(rt, snapshot, scope)
        path: str = scope["path"]
        if path in ("/v1/models", "/v1/models/"):
            await send_json(send, 200, snapshot.listing(record.allowed), extra)
            return
        name = path[len("/v1/models/") :]
        router = snapshot.routes.get(name)
        if router is None or not record.may_use(router.route):
            raise ApiError(
                404,
                f"The model `{name}` does not exist or you do not have access to it.",
                param="model",
                code="model_not_found",
            )
        entry = {"id": name, "object": "model", "created": 0, "owned_by": "llmgw"}
        await send_json(send, 200, entry, extra)
    except ApiError as error:
        await send_error(send, error, extra)
