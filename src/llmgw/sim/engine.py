"""A simulated inference engine behind a real OpenAI-compatible HTTP server.

Benchmarks and scale tests need engines by the dozen on a 2-core machine, and
tests need engines that fail on cue; a real engine gives neither. Each
:class:`SimEngine` is one aiohttp server on its own port, driven by one
:class:`~llmgw.sim.core.EngineCore` task, all sharing the caller's event loop.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed or
not, with ``usage`` and ``prompt_tokens_details.cached_tokens``),
``POST /v1/embeddings`` (a deterministic vector), ``GET /v1/models``,
``GET /health`` and ``GET /metrics`` (vLLM's metric names); and those of
``SimParams.routes`` (all by default): ``/v1/responses``, ``/v1/rerank``,
``/v1/score``, ``/v1/audio/transcriptions`` (llmgw.sim.extra_routes).

Life cycle: the server listens at once; ``/health`` answers 503 during the
start-up delay (``startup_s * time_factor``), then 200. Faults
(``SimParams.fault``):

- ``fail_at_start``: after the start-up delay ``/health`` answers 500 forever
  and :meth:`SimEngine.wait_exit` returns 1; run as a process
  (``python -m llmgw.sim.engine``) the process exits with status 1, as an
  engine that cannot load its model does.
- ``crash_mid_stream``: the connection is dropped after ``crash_after_tokens``
  output tokens (before any response, when not streaming).
- ``hang``: completions are accepted and never answered; ``/health`` stays
  200, the worst case for a router.
- ``slow``: prefill and decode take 10 times longer.

``hang_after_s`` (beside any fault but ``fail_at_start``): that long after it
became ready, the engine wedges the way a deadlocked engine or a stuck CUDA
context does. Its process lives on, running requests stop producing tokens,
and every request, ``/health`` and ``/metrics`` included, is accepted and
never answered until the engine is stopped. Unlike ``hang``, a health check
sees it, which is what the agent's liveness probe is for.

``stall_after_s`` (likewise): that long after it became ready, the engine
stops making progress while its HTTP server answers on, as vLLM does with its
engine core stuck inside a CUDA call: running requests stay running and get
no more tokens, new ones queue, ``/health`` answers 200 and ``/metrics`` shows
the running requests beside token counters that no longer move. That is what
the agent's progress check is for.

``python -m llmgw.sim.engine --host H --port P --model NAME --params-json '{...}'``
runs engines as a process (the agent starts replicas that way, with an argv
list; llmgw.sim.process); ``llmgw sim engine`` is the same with friendlier flags.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import ssl
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from aiohttp import web

from llmgw.errors import ValidationError
from llmgw.sim import metrics, openai_api, tokens
from llmgw.sim.core import EngineCore, Phase, QueueFullError, SimRequest
from llmgw.sim.extra_routes import ExtraRoutes
from llmgw.sim.lora import LoraRoutes
from llmgw.sim.openai_api import ParsedCompletion
from llmgw.sim.responses import client_left, drop, error, json_response, model_not_found, read_json
from llmgw.wire import SimParams

EngineState = Literal["created", "starting", "ready", "hung", "failed", "stopped"]

log = logging.getLogger("llmgw.sim.engine")

# Long enough for in-flight streams to notice, short enough that stopping
# dozens of engines in a test or a benchmark does not add up to minutes.
_SHUTDOWN_TIMEOUT_S = 0.5
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_ids = itertools.count(1)


class SimEngine:
    """One simulated engine: ``await start(host, port)``, ``await stop()``."""

    def __init__(
        self, model: str = "sim", params: SimParams | None = None, *, api_key: str | None = None
    ) -> None:
        self.model = model
        self.params = params or SimParams()
        # Like a real engine started with a key: everything but /health needs
        # it as a bearer token (the agent's probes of /metrics send it too).
        self._auth = f"Bearer {api_key}".encode() if api_key else None
        self.core = EngineCore(self.params)
        self.state: EngineState = "created"
        self.host = "127.0.0.1"
        self.port: int | None = None
        self._id = next(_ids)
        self._requests = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._core_task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._settled = asyncio.Event()
        self._exit: asyncio.Future[int] | None = None
        self._registry = metrics.make_registry(model, self.core)
        self.started_at: float | None = None
        self.ready_at: float | None = None
        self.stalled = False  # stall_after_s has passed: no engine steps any more
        self.tls = False  # listens with TLS (start's ``tls``)
        self.lora = LoraRoutes(model, self.params)

    # -- life cycle ----------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL without ``/v1`` (what ``wire.Endpoint.url`` holds)."""
        if self.port is None:
            raise RuntimeError("engine not started")
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    async def start(
        self, host: str = "127.0.0.1", port: int = 0, tls: ssl.SSLContext | None = None
    ) -> int:
        """Listen on ``host:port`` (0: an ephemeral port) and return the port.

        ``tls``: listen with TLS (as the agent starts real engines with the
        node's certificate), so that path is tested without a GPU.

        Returns as soon as the server listens; readiness follows the start-up
        delay (poll ``/health`` or ``state``).
        """
        if self.state != "created":
            raise RuntimeError(f"engine already {self.state}")
        # Only an engine that will wedge pays for the middleware that wedges it.
        wedges = [self._wedged] if self.params.hang_after_s is not None else []
        guard = [self._guarded] if self._auth is not None else []
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=guard + wedges)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        ExtraRoutes(self).mount(app)  # responses, rerank, score, transcriptions
        self.lora.mount(app)  # LoRA adapters and sleep, where its params enable them
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        # handler_cancellation: a client that hangs up cancels its handler,
        # which frees the request's KV blocks at once, as vLLM aborts it.
        runner = web.AppRunner(
            app,
            access_log=None,
            handler_cancellation=True,
            shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
        )
        await runner.setup()
        try:
            site = web.TCPSite(runner, host, port, ssl_context=tls)
            await site.start()
        except OSError:
            await runner.cleanup()
            raise
        self._runner = runner
        self.tls = tls is not None
        self.host = host
        self.port = int(runner.addresses[0][1])
        self.state = "starting"
        self.started_at = time.time()
        loop = asyncio.get_running_loop()
        self._exit = loop.create_future()
        self._core_task = loop.create_task(self.core.run(), name=f"sim-core-{self._id}")
        self._tasks = [
            self._core_task,
            loop.create_task(self._start_up(), name=f"sim-start-{self._id}"),
        ]
        return self.port

    async def _start_up(self) -> None:
        await asyncio.sleep(self.params.startup_s * self.params.time_factor)
        if self.params.fault == "fail_at_start":
            self.state = "failed"
            if self._exit is not None and not self._exit.done():
                self._exit.set_result(1)
        else:
            self.state = "ready"
            self.ready_at = time.time()
        self._settled.set()
        if self.state != "ready":
            return
        p = self.params
        after = [(p.stall_after_s, self._stall), (p.hang_after_s, self._wedge)]
        waited = 0.0
        due = [(seconds, act) for seconds, act in after if seconds is not None]
        for seconds, act in sorted(due, key=lambda item: item[0]):
            await asyncio.sleep((seconds - waited) * p.time_factor)
            waited = seconds
            act()

    def _stall(self) -> None:
        log.warning("sim engine %s on port %s stalls now (stall_after_s)", self.model, self.port)
        self.stalled = True
        # The core's lists keep their requests: /metrics goes on counting them
        # as running, and the token counters stop where they are.
        if self._core_task is not None:
            self._core_task.cancel()

    def _wedge(self) -> None:
        log.warning("sim engine %s on port %s hangs now (hang_after_s)", self.model, self.port)
        self.state = "hung"
        # No more engine steps: running requests wait for tokens that never come.
        if self._core_task is not None:
            self._core_task.cancel()

    async def wait_ready(self) -> bool:
        """Wait out the start-up delay: True when ready, False when it failed."""
        await self._settled.wait()
        return self.state == "ready"

    async def wait_exit(self) -> int:
        """Wait until the engine gives up (1: failed at start) or is stopped (0)."""
        if self._exit is None:
            raise RuntimeError("engine not started")
        return await asyncio.shield(self._exit)

    async def stop(self) -> None:
        if self.state in ("created", "stopped"):
            self.state = "stopped"
            return
        self._stopping.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._runner is not None:
            await self._runner.cleanup()
        self.state = "stopped"
        self._settled.set()
        if self._exit is not None and not self._exit.done():
            self._exit.set_result(0)

    def stats(self) -> dict[str, Any]:
        """A snapshot for benchmarks and the fleet: state, queues, cache, totals."""
        c, kv = self.core.counters, self.core.kv
        return {
            "model": self.model,
            "url": self.url if self.port is not None else None,
            "state": self.state,
            "stalled": self.stalled,
            "running": self.core.running,
            "waiting": self.core.waiting,
            "kv_usage": kv.usage,
            "kv_used_blocks": kv.used_blocks,
            "kv_cached_blocks": kv.cached_blocks,
            "kv_evictions": kv.evictions,
            "prefix_queries": c.prefix_queries,
            "prefix_hits": c.prefix_hits,
            "prompt_tokens": c.prompt_tokens,
            "generation_tokens": c.generation_tokens,
            "finished": c.finished,
            "aborted": c.aborted,
        }

    # -- HTTP ----------------------------------------------------------------

    def _not_serving(self) -> web.Response | None:
        if self.state == "ready":
            return None
        if self.state == "failed":
            return error(500, "engine failed at start (fault fail_at_start)", "server_error", 500)
        return error(503, f"engine is {self.state}", "service_unavailable", 503, retry_after=True)

    @web.middleware
    async def _guarded(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        given = request.headers.get("Authorization", "").encode()
        if request.path != "/health" and not hmac.compare_digest(given, self._auth or b""):
            return error(
                401, "missing or wrong API key", "invalid_request_error", "invalid_api_key"
            )
        return await handler(request)

    @web.middleware
    async def _wedged(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        if self.state == "hung":
            await self._stopping.wait()
            drop(request)
            return web.Response(status=503)
        return await handler(request)

    async def _health(self, request: web.Request) -> web.Response:
        refusal = self._not_serving()
        return refusal if refusal is not None else web.Response(status=200)

    async def _metrics(self, request: web.Request) -> web.Response:
        body = metrics.render(self._registry)
        return web.Response(body=body, headers={"Content-Type": metrics.CONTENT_TYPE})

    async def _models(self, request: web.Request) -> web.Response:
        refusal = self._not_serving()
        if refusal is not None:
            return refusal
        card = {
            "id": self.model,
            "object": "model",
            "created": int(self.started_at or 0),
            "owned_by": "llmgw-sim",
            "max_model_len": self.params.kv_blocks * self.params.block_tokens,
        }
        adapters = self.lora.cards(int(self.started_at or 0))
        return json_response({"object": "list", "data": [card, *adapters]})

    async def _embeddings(self, request: web.Request) -> web.Response:
        refusal = self._not_serving()
        if refusal is not None:
            return refusal
        try:
            model, inputs, as_base64 = openai_api.embedding_inputs(await read_json(request))
        except ValidationError as exc:
            return error(400, str(exc), "invalid_request_error", None, param=exc.field)
        if model != self.model:
            return model_not_found(model)
        return web.Response(
            body=openai_api.embeddings_body(model, inputs, as_base64),
            content_type="application/json",
        )

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize for a prompt: ``{"prompt"}`` -> ``{"count", "tokens", ...}``."""
        refusal = self._not_serving()
        if refusal is not None:
            return refusal
        try:
            body = await read_json(request)
        except ValidationError as exc:
            return error(400, str(exc), "invalid_request_error", None)
        text = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(text, str):
            return error(400, "'prompt' must be a string", "invalid_request_error", None,
                          param="prompt")  # fmt: skip
        count = tokens.count_tokens(text)
        max_len = self.params.kv_blocks * self.params.block_tokens
        return json_response(
            {"count": count, "tokens": list(range(count)), "max_model_len": max_len}
        )

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    async def _complete(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        refusal = self._not_serving()
        if refusal is not None:
            return refusal
        if self.lora.sleeping:  # /health still answers 200, as vLLM's does asleep
            return error(503, "engine is asleep", "service_unavailable", 503, retry_after=True)
        try:
            parsed = openai_api.parse_completion(
                await read_json(request),
                chat=chat,
                max_completion_tokens=self.params.max_completion_tokens,
                stream_usage=self.params.stream_usage,
            )
        except ValidationError as exc:
            return error(400, str(exc), "invalid_request_error", None, param=exc.field)
        if not self.lora.serves(parsed.model):
            return model_not_found(parsed.model)
        if self.params.fault == "hang":
            await self._stopping.wait()
            drop(request)
            return web.Response(status=503)
        try:
            salt = b"" if parsed.model == self.model else parsed.model.encode()
            sim = self.core.submit(parsed.prompt, parsed.max_tokens, salt)
        except ValidationError as exc:
            return error(400, str(exc), "invalid_request_error", None, param=exc.field)
        except QueueFullError as exc:
            return error(503, str(exc), "service_unavailable", 503, retry_after=True)
        req_id = f"{'chatcmpl' if chat else 'cmpl'}-sim{self._id}-{next(self._requests)}"
        try:
            if parsed.stream:
                return await self._stream(request, parsed, sim, req_id)
            return await self._whole(request, parsed, sim, req_id)
        except ConnectionResetError:
            return client_left()
        finally:
            self.core.abort(sim)  # no-op once finished; frees blocks of a dropped request

    async def _stream(
        self, request: web.Request, parsed: ParsedCompletion, sim: SimRequest, req_id: str
    ) -> web.StreamResponse:
        crash_at = self._crash_at()
        out = openai_api.ChunkWriter(req_id, parsed.model, parsed.chat)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        # Like vLLM, the role chunk goes out with the first token, after
        # prefill: a router that waits for the first chunk (the gateway, to
        # know when a replica's queued prefill is done) must not see it early.
        role_due = parsed.chat
        sent = 0
        async for produced in sim.progress():
            upto = min(produced, crash_at) if crash_at is not None else produced
            if upto > sent:
                if role_due:
                    await resp.write(out.role())
                    role_due = False
                await resp.write(out.tokens(sent, upto))
                sent = upto
            if crash_at is not None and sent >= crash_at:
                if self.params.fault == "cut_stream":
                    # Ended cleanly but unfinished: no finish_reason, then [DONE].
                    await resp.write(out.done())
                    await resp.write_eof()
                else:
                    drop(request)
                return resp
        if sim.phase is Phase.ABORTED:
            drop(request)
            return resp
        tail = out.finish("length")
        if role_due:
            tail = out.role() + tail
        if parsed.include_usage:
            tail += out.usage(openai_api.usage(sim.prompt_tokens, sent, sim.cached_tokens))
        await resp.write(tail + out.done())
        await resp.write_eof()
        return resp

    async def _whole(
        self, request: web.Request, parsed: ParsedCompletion, sim: SimRequest, req_id: str
    ) -> web.StreamResponse:
        crash_at = self._crash_at()
        while not sim.finished:
            if crash_at is not None and sim.produced >= crash_at:
                drop(request)
                return web.Response(status=500)
            await sim.changed.wait()
            sim.changed.clear()
        if sim.phase is Phase.ABORTED or crash_at is not None:
            drop(request)
            return web.Response(status=500)
        usage = openai_api.usage(sim.prompt_tokens, sim.produced, sim.cached_tokens)
        body = openai_api.completion_body(req_id, parsed.model, parsed.chat, sim.produced, usage)
        return web.Response(body=body, content_type="application/json")

    def _crash_at(self) -> int | None:
        if self.params.fault not in ("crash_mid_stream", "cut_stream"):
            return None
        return self.params.crash_after_tokens


if __name__ == "__main__":
    # The agent runs `python -m llmgw.sim.engine`; the process's own parts
    # (argv, signals) live in llmgw.sim.process.
    from llmgw.sim.process import main

    sys.exit(main())
