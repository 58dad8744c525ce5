"""A non-streamed answer built from a stream, for engines that only stop a stream.

llama_cpp.server computes a non-streamed request in a worker thread that
nothing interrupts: a client that gives up leaves the engine generating to
its token limit, a minute or more of a CPU slot that other requests queue
behind. A stream it stops at the next chunk once the connection closes. For
an engine whose dialect says so (``EngineDialect.stops_unstreamed`` false)
the gateway asks for a stream and builds from its chunks the answer OpenAI
sends unstreamed, so a client that leaves costs a token, not the rest of the
answer.

The answer has OpenAI's non-streamed shape: ``id``, ``object``
(``chat.completion`` / ``text_completion``), ``created``, ``model``,
``system_fingerprint`` when the engine sent one, ``choices`` in index order
(chat: ``message`` with ``role``, ``content``, ``tool_calls`` when any,
``reasoning_content`` when the engine sent any; completions: ``text``), each
with ``finish_reason`` and ``logprobs`` (null unless the chunks carried
them), and ``usage``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson

from llmgw.gateway.call import Call
from llmgw.gateway.checks.validation import CHAT_PATH
from llmgw.gateway.metering.account import account, count_later
from llmgw.gateway.metering.counter import ANSWER_COUNT_TIMEOUT_S, StreamCounter
from llmgw.gateway.metering.tally import StreamTally, indexed_choices, sse_chunks, tool_calls
from llmgw.gateway.metering.usage import counted_usage, usage_of
from llmgw.gateway.replies import JSON, ApiError, overhead_header, send_bytes, send_error
from llmgw.gateway.routes.sse import StreamRelay
from llmgw.gateway.routing.replica import Replica
from llmgw.http.upstream import Response


class _Choice:
    __slots__ = ("content", "finish", "logprobs", "reasoning", "refusal", "role", "text", "tools")

    def __init__(self) -> None:
        self.role: str | None = None
        self.content: list[str] | None = None  # None: no content delta at all
        self.reasoning: list[str] = []
        self.refusal: list[str] = []
        self.text: list[str] = []
        self.finish: str | None = None
        self.logprobs: dict[str, Any] | None = None
        self.tools: dict[int, dict[str, Any]] = {}


class Assembler:
    """Collects a stream's chunks; :meth:`answer` renders the unstreamed answer.

    Also tallies the text per choice (:attr:`tally`), which is what the
    gateway counts when the engine reports no usage in streams.
    """

    __slots__ = ("_choices", "_head", "chat", "error", "tally", "usage")

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.tally = StreamTally()
        self.usage: dict[str, Any] | None = None  # as the engine reported it
        self.error: dict[str, Any] | None = None  # an error event in the stream
        self._head: dict[str, Any] = {}
        self._choices: dict[int, _Choice] = {}

    def add(self, block: bytes) -> None:
        """Take a block of whole SSE events (StreamRelay's ``observe``)."""
        for chunk in sse_chunks(block):
            self.tally.chunk(chunk)
            self._chunk(chunk)

    def _chunk(self, chunk: dict[str, Any]) -> None:
        error = chunk.get("error")
        if isinstance(error, dict):
            self.error = error
            return
        for key in ("id", "created", "model", "system_fingerprint"):
            if key not in self._head and chunk.get(key) is not None:
                self._head[key] = chunk[key]
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        for index, raw in indexed_choices(chunk):
            choice = self._choices.get(index)
            if choice is None:
                choice = self._choices[index] = _Choice()
            finish = raw.get("finish_reason")
            if isinstance(finish, str):
                choice.finish = finish
            text = raw.get("text")
            if isinstance(text, str):
                choice.text.append(text)
            delta = raw.get("delta")
            if isinstance(delta, dict):
                _take_delta(choice, delta)
            logprobs = raw.get("logprobs")
            if isinstance(logprobs, dict):
                _take_logprobs(choice, logprobs)

    def answer(self, usage: dict[str, Any] | None) -> bytes:
        """The unstreamed answer, with ``usage`` (the engine's, or one the gateway counted)."""
        head = self._head
        body: dict[str, Any] = {
            "id": head.get("id") or "",
            "object": "chat.completion" if self.chat else "text_completion",
            "created": head.get("created") or 0,
            "model": head.get("model") or "",
            "choices": [self._render(i, c) for i, c in sorted(self._choices.items())],
        }
        if "system_fingerprint" in head:
            body["system_fingerprint"] = head["system_fingerprint"]
        body["usage"] = usage
        return orjson.dumps(body)

    def _render(self, index: int, choice: _Choice) -> dict[str, Any]:
        out: dict[str, Any] = {"index": index}
        if self.chat:
            tools = [_tool(call) for _, call in sorted(choice.tools.items())]
            message: dict[str, Any] = {"role": choice.role or "assistant"}
            if choice.content is not None:
                message["content"] = "".join(choice.content)
            else:
                # OpenAI's content is null beside tool calls, a string otherwise.
                message["content"] = None if tools else ""
            if tools:
                message["tool_calls"] = tools
            if choice.reasoning:
                message["reasoning_content"] = "".join(choice.reasoning)
            if choice.refusal:
                message["refusal"] = "".join(choice.refusal)
            out["message"] = message
        else:
            out["text"] = "".join(choice.text)
        out["logprobs"] = choice.logprobs
        out["finish_reason"] = choice.finish
        return out

    @property
    def finished(self) -> bool:
        """Every choice the stream opened got its finish reason."""
        return bool(self._choices) and all(c.finish is not None for c in self._choices.values())


def _take_delta(choice: _Choice, delta: dict[str, Any]) -> None:
    role = delta.get("role")
    if isinstance(role, str):
        choice.role = role
    content = delta.get("content")
    if isinstance(content, str):
        if choice.content is None:
            choice.content = []
        choice.content.append(content)
    for key, pieces in (("reasoning_content", choice.reasoning), ("refusal", choice.refusal)):
        value = delta.get(key)
        if isinstance(value, str):
            pieces.append(value)
    for call in tool_calls(delta):
        _take_tool_call(choice, call)


def _take_tool_call(choice: _Choice, call: dict[str, Any]) -> None:
    # A call comes in pieces under one index: its id, type and name first,
    # then its arguments a few characters at a time.
    index = call.get("index", len(choice.tools))
    index = index if isinstance(index, int) else len(choice.tools)
    merged = choice.tools.get(index)
    if merged is None:
        merged = choice.tools[index] = {"id": None, "type": "function", "name": "", "args": []}
    if isinstance(call.get("id"), str):
        merged["id"] = call["id"]
    if isinstance(call.get("type"), str):
        merged["type"] = call["type"]
    function = call.get("function")
    if isinstance(function, dict):
        if isinstance(function.get("name"), str):
            merged["name"] += function["name"]
        if isinstance(function.get("arguments"), str):
            merged["args"].append(function["arguments"])


def _tool(call: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": call["id"],
        "type": call["type"],
        "function": {"name": call["name"], "arguments": "".join(call["args"])},
    }


def _take_logprobs(choice: _Choice, logprobs: dict[str, Any]) -> None:
    # Chat: {"content": [...], "refusal": [...]}; completions: {"tokens",
    # "token_logprobs", "top_logprobs", "text_offset"}, parallel lists. Each
    # chunk carries its tokens' share; the answer carries them all.
    if choice.logprobs is None:
        choice.logprobs = {}
    for key, value in logprobs.items():
        if isinstance(value, list):
            choice.logprobs.setdefault(key, []).extend(value)
        elif key not in choice.logprobs:
            choice.logprobs[key] = value


async def answer_assembled(
    call: Call, response: Response, first: bytes, path: str, payload: dict[str, Any],
    replica: Replica, before: float,
) -> int:  # fmt: skip
    """Read a stream to its end and answer with the unstreamed answer built from it.

    Nothing reaches the client before the end, so a stream that breaks is
    retried elsewhere like any unstreamed answer (BodyBroken propagates). A
    client that leaves cancels this task: the connection to the engine
    closes (the point of streaming), and what was generated is metered.
    """
    assembler = Assembler(path == CHAT_PATH)
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
