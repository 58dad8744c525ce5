"""The simulated engine's routes beyond chat: responses, rerank, score, transcriptions.

Shaped like vLLM's answers (OpenAI's where vLLM follows it), so the
gateway's pass-through, usage and streams are tested end to end with the
official openai client, and costed by the same engine core as chat (queue,
prefill with prefix caching, decode), so they load a replica as real
requests do:

* ``/v1/responses``: ``input`` (text or messages) and ``instructions`` are
  rendered as chat messages are, so a conversation shares its KV prefix
  across the two APIs; ``max_output_tokens`` (default 16) tokens are
  generated; streamed, the events are ``response.created``, ``...in_progress``,
  ``...output_item.added``, ``...content_part.added``, one
  ``response.output_text.delta`` per token, the ``.done`` events, then
  ``response.completed`` carrying ``usage`` (input/output tokens). The first
  event goes out with the first token, after prefill, as the gateway expects
  of every stream (DESIGN.md §6).
* ``/v1/rerank`` and ``/v1/score``: one prefill of all the texts and one
  step; scores are a hash of each pair, in (0, 1). Rerank's usage is vLLM's
  ``{"total_tokens"}`` only, score's has ``prompt_tokens``.
* ``/v1/audio/transcriptions``: a multipart form; the audio costs one token
  per 1,000 bytes of prefill and the transcript one token per 4,000 bytes
  (at least 1, at most 64). ``response_format`` json, verbose_json, text,
  srt or vtt; usage is ``{"type": "duration", "seconds"}`` as vLLM's (16 kHz
  16-bit mono assumed), and a stream (``stream=true``) sends chat-style
  chunks then ``[DONE]``, with prompt/completion usage when
  ``stream_include_usage`` is true.

Which of these an engine serves is ``SimParams.routes`` (None: all).
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from llmgw.errors import ValidationError
from llmgw.sim import tokens
from llmgw.sim.core import Phase, QueueFullError, SimRequest
from llmgw.sim.responses import client_left, error, json_response, read_json
from llmgw.wire import EXTRA_ROUTES

if TYPE_CHECKING:
    from llmgw.sim.engine import SimEngine


_DEFAULT_OUTPUT = 16
_AUDIO_BYTES_PER_SECOND = 32000  # 16 kHz, 16-bit, mono
_ids = itertools.count(1)


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return error(status, message, kind, status, param=param)


def _relevance(query: str, document: str) -> float:
    digest = hashlib.blake2b(f"{query}\0{document}".encode(), digest_size=4).digest()
    return round((int.from_bytes(digest, "little") + 1) / (2**32 + 2), 6)


def _texts(value: Any, field: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        out = []
        for item in value:
            text = item.get("text") if isinstance(item, dict) else item
            if not isinstance(text, str):
                raise ValidationError(f"'{field}' items must be strings or {{'text'}}", field=field)
            out.append(text)
        return out
    raise ValidationError(f"'{field}' must be a string or a non-empty list", field=field)


def _input_messages(body: dict[str, Any]) -> str:
    """The Responses API's instructions and input, rendered as the chat route renders messages."""
    parts: list[str] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        parts.append(tokens.render_message("system", instructions))
    given = body.get("input")
    items = [{"role": "user", "content": given}] if isinstance(given, str) else given
    if not isinstance(items, list) or not items:
        raise ValidationError("'input' must be a string or a non-empty list", field="input")
    for item in items:
        if not isinstance(item, dict):
            raise ValidationError("'input' items must be objects", field="input")
        content = item.get("content")
        if isinstance(content, list):
            content = "".join(
                p.get("text", "") for p in content if isinstance(p, dict)
                and isinstance(p.get("text"), str)
            )
        parts.append(tokens.render_message(str(item.get("role", "user")), str(content or "")))
    parts.append(tokens.GENERATION_CUE)
    return "".join(parts)


class ExtraRoutes:
    """The extra routes of one :class:`~llmgw.sim.engine.SimEngine`."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine

    def mount(self, app: web.Application) -> None:
        handlers: dict[str, Callable[[web.Request], Awaitable[web.StreamResponse]]] = {
            "/v1/responses": self._responses,
            "/v1/rerank": self._rerank,
            "/v1/score": self._score,
            "/v1/audio/transcriptions": self._transcribe,
        }
        routes = self.engine.params.routes
        for path in EXTRA_ROUTES if routes is None else routes:
            app.router.add_post(path, handlers[path])

    # -- shared --------------------------------------------------------------

    async def _json_body(self, request: web.Request) -> dict[str, Any]:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise ValidationError("request body must be a JSON object")
        model = body.get("model")
        if model != self.engine.model:
            raise LookupError(model)
        return body

    def _submit(self, prompt: str, max_tokens: int) -> SimRequest:
        return self.engine.core.submit(prompt.encode("utf-8"), max_tokens)

    async def _finish(self, sim: SimRequest) -> None:
        while not sim.finished:
            await sim.changed.wait()
            sim.changed.clear()

    async def _serve(
        self, request: web.Request,
        answer: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:  # fmt: skip
        refusal = self.engine._not_serving()
        if refusal is not None:
            return refusal
        try:
            return await answer(request)
        except ValidationError as exc:
            return _error(400, str(exc), exc.field)
        except LookupError as exc:
            return _error(404, f"The model `{exc.args[0]}` does not exist.", "model")
        except QueueFullError as exc:
            return _error(503, str(exc))
        except ConnectionResetError:
            return client_left()

    # -- /v1/responses ---------------------------------------------------------

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, self._respond)

    async def _respond(self, request: web.Request) -> web.StreamResponse:
        body = await self._json_body(request)
        prompt = _input_messages(body)
        limit = body.get("max_output_tokens") or _DEFAULT_OUTPUT
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValidationError("'max_output_tokens' must be an integer >= 1",
                                  field="max_output_tokens")  # fmt: skip
        sim = self._submit(prompt, limit)
        resp_id = f"resp_sim{next(_ids)}"
        try:
            if body.get("stream") is True:
                return await self._respond_stream(request, body, sim, resp_id)
            await self._finish(sim)
            if sim.phase is Phase.ABORTED:
                return web.Response(status=500)
            return json_response(self._response(body, resp_id, sim, "completed"))
        finally:
            self.engine.core.abort(sim)

    def _response(
        self, body: dict[str, Any], resp_id: str, sim: SimRequest, status: str
    ) -> dict[str, Any]:
        done = status == "completed"
        text = tokens.filler_text(sim.produced)
        message = {"type": "message", "id": f"msg_{resp_id}", "status": status, "role": "assistant",
                   "content": [{"type": "output_text", "text": text, "annotations": []}]}
        usage = {
            "input_tokens": sim.prompt_tokens,
            "input_tokens_details": {"cached_tokens": sim.cached_tokens},
            "output_tokens": sim.produced,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": sim.prompt_tokens + sim.produced,
        }  # fmt: skip
        return {
            "id": resp_id, "object": "response", "created_at": int(time.time()),
            "status": status, "model": self.engine.model, "output": [message] if done else [],
            "instructions": body.get("instructions"), "max_output_tokens":
            body.get("max_output_tokens"), "parallel_tool_calls": True, "tool_choice": "auto",
            "tools": [], "temperature": 1.0, "top_p": 1.0, "text": {"format": {"type": "text"}},
            "truncation": "disabled", "error": None, "incomplete_details": None,
            "metadata": {}, "usage": usage if done else None,
        }  # fmt: skip

    async def _respond_stream(
        self, request: web.Request, body: dict[str, Any], sim: SimRequest, resp_id: str
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        seq = itertools.count()
        item = {"item_id": f"msg_{resp_id}", "output_index": 0, "content_index": 0}

        def event(kind: str, **fields: Any) -> bytes:
            data = {"type": kind, "sequence_number": next(seq), **fields}
            return f"event: {kind}\ndata: ".encode() + orjson.dumps(data) + b"\n\n"

        sent = 0
        opened = False
        async for produced in sim.progress():
            if produced > sent:
                out = b""
                if not opened:  # with the first token, after prefill
                    opened = True
                    started = self._response(body, resp_id, sim, "in_progress")
                    added = {"type": "message", "id": item["item_id"], "status": "in_progress",
                             "role": "assistant", "content": []}  # fmt: skip
                    out += event("response.created", response=started)
                    out += event("response.in_progress", response=started)
                    out += event("response.output_item.added", output_index=0, item=added)
                    out += event("response.content_part.added", **item,
                                 part={"type": "output_text", "text": "", "annotations": []})
                out += b"".join(event("response.output_text.delta", **item,
                                      delta=tokens.filler_token(i))
                                for i in range(sent, produced))  # fmt: skip
                sent = produced
                await resp.write(out)
        if sim.phase is Phase.ABORTED:
            return resp
        final = self._response(body, resp_id, sim, "completed")
        message = final["output"][0]
        text = message["content"][0]["text"]
        await resp.write(
            event("response.output_text.done", **item, text=text)
            + event("response.content_part.done", **item, part=message["content"][0])
            + event("response.output_item.done", output_index=0, item=message)
            + event("response.completed", response=final)
        )
        await resp.write_eof()
        return resp

    # -- /v1/rerank and /v1/score -----------------------------------------------

    async def _pool(self, texts: list[str]) -> int:
        """Prefill ``texts`` as one request (a pooling model's pass); its prompt tokens."""
        sim = self._submit("".join(texts), 1)
        try:
            await self._finish(sim)
        finally:
            self.engine.core.abort(sim)
        return sim.prompt_tokens

    async def _rerank(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, self._ranked)

    async def _ranked(self, request: web.Request) -> web.StreamResponse:
        body = await self._json_body(request)
        query = body.get("query")
        if not isinstance(query, str):
            raise ValidationError("'query' must be a string", field="query")
        documents = _texts(body.get("documents"), "documents")
        used = await self._pool([query, *documents])
        results = sorted(
            ({"index": i, "document": {"text": doc}, "relevance_score": _relevance(query, doc)}
             for i, doc in enumerate(documents)),
            key=lambda r: -float(r["relevance_score"]),  # type: ignore[arg-type]
        )  # fmt: skip
        top = body.get("top_n")
        if isinstance(top, int) and top > 0:
            results = results[:top]
        return json_response({"id": f"rerank-sim{next(_ids)}", "model": self.engine.model,
                              "usage": {"total_tokens": used}, "results": results})  # fmt: skip

    async def _score(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, self._scored)

    async def _scored(self, request: web.Request) -> web.StreamResponse:
        body = await self._json_body(request)
        # vLLM's names for the two sides, in its order (as gateway.checks.validation).
        pairs = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))
        one, two = next(
            (pair for pair in pairs if all(body.get(side) is not None for side in pair)),
            ("text_1", "text_2"),
        )
        first = _texts(body.get(one), one)
        second = _texts(body.get(two), two)
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise ValidationError(f"{one} and {two} must have the same length", field=two)
        used = await self._pool([*first, *second])
        data = [{"index": i, "object": "score", "score": _relevance(a, b)}
                for i, (a, b) in enumerate(zip(first, second, strict=True))]  # fmt: skip
        usage = {"prompt_tokens": used, "total_tokens": used, "completion_tokens": 0}
        return json_response({"id": f"score-sim{next(_ids)}", "object": "list",
                              "created": int(time.time()), "model": self.engine.model,
                              "data": data, "usage": usage})  # fmt: skip

    # -- /v1/audio/transcriptions ------------------------------------------------

    async def _transcribe(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, self._transcript)

    async def _transcript(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        model = form.get("model")
        if model != self.engine.model:
            raise LookupError(model)
        upload = form.get("file")
        if not isinstance(upload, web.FileField):
            raise ValidationError("'file' must be a file", field="file")
        size = len(upload.file.read())
        output = max(1, min(size // 4000, 64))
        # The audio's "tokens": its bytes, one token per 1,000 (a stand-in
        # for the encoder's frames), hashed so equal files share a prefix.
        audio = hashlib.blake2b(str(size).encode(), digest_size=8).hexdigest()
        sim = self._submit(audio * max(1, size // 4000), output)
        try:
            if str(form.get("stream", "false")).lower() == "true":
                usage = str(form.get("stream_include_usage", "false")).lower() == "true"
                return await self._transcript_stream(request, sim, usage)
            await self._finish(sim)
            if sim.phase is Phase.ABORTED:
                return web.Response(status=500)
        finally:
            self.engine.core.abort(sim)
        text = tokens.filler_text(sim.produced).strip()
        seconds = max(1, -(-size // _AUDIO_BYTES_PER_SECOND))
        usage_ = {"type": "duration", "seconds": seconds}
        fmt = str(form.get("response_format", "json"))
        if fmt == "text":
            return web.Response(text=text + "\n", content_type="text/plain")
        if fmt in ("srt", "vtt"):
            cue = f"00:00:00,000 --> 00:00:{min(seconds, 59):02d},000"
            head = "WEBVTT\n\n" if fmt == "vtt" else "1\n"
            return web.Response(text=f"{head}{cue}\n{text}\n", content_type="text/plain")
        if fmt == "verbose_json":
            return json_response({"task": "transcribe", "language": "en",
                                  "duration": float(seconds), "text": text, "segments": [],
                                  "usage": usage_})  # fmt: skip
        return json_response({"text": text, "usage": usage_})

    async def _transcript_stream(
        self, request: web.Request, sim: SimRequest, include_usage: bool
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        head = {"id": f"trsc-sim{next(_ids)}", "object": "transcription.chunk",
                "created": int(time.time()), "model": self.engine.model}  # fmt: skip

        def chunk(delta: dict[str, Any], finish: str | None, **extra: Any) -> bytes:
            choice = {"delta": delta, "finish_reason": finish, "stop_reason": None}
            return b"data: " + orjson.dumps({**head, "choices": [choice], **extra}) + b"\n\n"

        sent = 0
        async for produced in sim.progress():
            if produced > sent:
                await resp.write(b"".join(chunk({"content": tokens.filler_token(i)}, None)
                                          for i in range(sent, produced)))  # fmt: skip
                sent = produced
        if sim.phase is Phase.ABORTED:
            return resp
        tail = chunk({}, "stop")
        if include_usage:
            usage = {"prompt_tokens": sim.prompt_tokens, "completion_tokens": sent,
                     "total_tokens": sim.prompt_tokens + sent}  # fmt: skip
            tail += b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}) + b"\n\n"
        await resp.write(tail + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
