"""A small OpenAI-compatible engine stand-in for gateway tests (aiohttp.web, loopback).

It answers every endpoint the gateway proxies, says in each answer which
replica it is, records what it received, and can be told to be slow or to
break a stream midway. ``python fake_upstream.py NAME`` serves it in its own
process (printing the port), so a test can SIGKILL it like a crashed engine.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Seen:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    at: float


@dataclass
class FakeUpstream:
    name: str
    delay_s: float = 0.0
    tokens: int = 3
    token_delay_s: float = 0.0
    break_stream_after: int | None = None  # chunks sent before the connection is cut
    # Chunks sent before the stream ends cleanly but unfinished (no finish
    # reason, then [DONE]), as llama_cpp.server's interrupt_requests does.
    cut_stream_after: int | None = None
    send_done: bool = True  # end streams with [DONE]
    stream_usage: bool = True  # honour stream_options.include_usage
    keepalive_s: float = 75.0  # how long an idle keep-alive connection stays open
    # A prompt of more tokens (as _usage counts them) is refused as
    # llama_cpp.server refuses one longer than its context: 400 unstreamed,
    # and streamed a 200 whose stream ends before its first event.
    context_tokens: int | None = None
    seen: list[Seen] = field(default_factory=list)
    cancelled: int = 0
    port: int = 0
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_get("/v1/models", self._models)
        return app

    async def start(self) -> FakeUpstream:
        self._runner = web.AppRunner(
            self.app(),
            handler_cancellation=True,
            access_log=None,
            keepalive_timeout=self.keepalive_s,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        return self

    @property
    def connections(self) -> int:
        """Connections open to this engine now, idle keep-alive ones included."""
        server = self._runner.server if self._runner is not None else None
        return len(server.connections) if server is not None else 0

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _record(self, request: web.Request) -> dict[str, Any]:
        body = await request.json()
        self.seen.append(
            Seen(
                request.path,
                body,
                {k.lower(): v for k, v in request.headers.items()},
                time.monotonic(),
            )
        )
        if self.delay_s:
            await self._work(self.delay_s)
        return body  # type: ignore[no-any-return]

    async def _work(self, seconds: float) -> None:
        """Take ``seconds``, counting a cancel: the gateway closed the connection under it."""
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    def _usage(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = len(json.dumps(body.get("messages") or body.get("prompt") or body.get("input")))
        return {
            "prompt_tokens": prompt // 4,
            "completion_tokens": self.tokens,
            "total_tokens": prompt // 4 + self.tokens,
            "prompt_tokens_details": {"cached_tokens": 2},
        }

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        # An engine extension the gateway does not know (it checks OpenAI's
        # fields itself), so the engine's own refusal must come back as it is.
        if "top_k" in body and not isinstance(body["top_k"], int):
            error = {"message": "top_k must be an integer", "type": "invalid_request_error",
                     "param": "top_k", "code": "engine_refused"}  # fmt: skip
            return web.json_response({"error": error}, status=400)
        return await self._answer(request, body, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        return await self._answer(request, body, chat=False)

    async def _answer(
        self, request: web.Request, body: dict[str, Any], *, chat: bool
    ) -> web.StreamResponse:
        """A generation's answer: refused when too long, else streamed or whole as asked."""
        too_long = await self._too_long(request, body)
        if too_long is not None:
            return too_long
        if body.get("stream"):
            return await self._stream(request, body, chat=chat)
        return self._whole(body, chat=chat)

    async def _too_long(
        self, request: web.Request, body: dict[str, Any]
    ) -> web.StreamResponse | None:
        prompt = self._usage(body)["prompt_tokens"]
        if self.context_tokens is None or prompt <= self.context_tokens:
            return None
        if body.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write_eof()
            return response
        message = (
            f"This model's maximum context length is {self.context_tokens} tokens,"
            f" however you requested {prompt + (body.get('max_tokens') or 0)} tokens"
        )
        error = {"message": message, "type": "invalid_request_error", "param": "messages",
                 "code": "context_length_exceeded"}  # fmt: skip
        return web.json_response({"error": error}, status=400)

    def _whole(self, body: dict[str, Any], chat: bool) -> web.Response:
        """The unstreamed answer: one choice saying hello, as chat or as a completion."""
        text = f"hello from {self.name}"
        choice: dict[str, Any] = {"index": 0}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["finish_reason"] = "stop"
        return web.json_response({
            "id": "chatcmpl-1" if chat else "cmpl-1",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body["model"],
            "system_fingerprint": self.name,
            "choices": [choice],
            "usage": self._usage(body),
        })  # fmt: skip

    async def _embeddings(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        return web.json_response(
            {
                "object": "list",
                "model": body["model"],
                "data": [
                    {"object": "embedding", "index": i, "embedding": [0.25, -0.5, float(i)]}
                    for i in range(len(inputs))
                ],
                "usage": {"prompt_tokens": 4 * len(inputs), "total_tokens": 4 * len(inputs)},
            }
        )

    async def _models(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "list", "data": [{"id": self.name}]})

    async def _stream(
        self, request: web.Request, body: dict[str, Any], *, chat: bool
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        words = [f"hello from {self.name}"] + [f" t{i}" for i in range(1, self.tokens)]
        kind = "chat.completion.chunk" if chat else "text_completion"
        for index, word in enumerate(words):
            if self.break_stream_after is not None and index >= self.break_stream_after:
                assert request.transport is not None
                request.transport.abort()
                return response
            if self.cut_stream_after is not None and index >= self.cut_stream_after:
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
                return response
            choice: dict[str, Any] = {"index": 0, "finish_reason": None}
            if chat:
                choice["delta"] = (
                    {"content": word} if index else {"role": "assistant", "content": word}
                )
            else:
                choice["text"] = word
            chunk = {"id": "c1", "object": kind, "model": body["model"], "choices": [choice]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if self.token_delay_s:
                await self._work(self.token_delay_s)
        last: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
        last["delta" if chat else "text"] = {} if chat else ""
        finish = {"id": "c1", "object": kind, "model": body["model"], "choices": [last]}
        await response.write(b"data: " + json.dumps(finish).encode() + b"\n\n")
        options = body.get("stream_options") or {}
        if options.get("include_usage") and self.stream_usage:
            usage = {"id": "c1", "object": kind, "model": body["model"], "choices": [],
                     "usage": self._usage(body)}  # fmt: skip
            await response.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
        if self.send_done:
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _main(name: str, delay_s: float) -> None:
    upstream = await FakeUpstream(name, delay_s=delay_s).start()
    print(upstream.port, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(_main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 0.0))
