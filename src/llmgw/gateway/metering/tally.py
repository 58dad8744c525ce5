"""What a stream delivered, per choice: the text to count where the engine reports no usage.

Fed whole SSE events (a relay's ``observe``); each chunk is parsed, which
only streams the gateway counts pay for: those engines generate a few dozen
tokens a second, and a chunk costs microseconds to parse. The same walk
over chunks serves the answer assembled from a stream
(:mod:`llmgw.gateway.routes.assemble`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import orjson

from llmgw.gateway.metering.usage import Usage


def sse_chunks(block: bytes) -> Iterator[dict[str, Any]]:
    """The JSON objects of a block of whole SSE events (``data: {...}``); anything else skipped."""
    for line in block.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if not data.startswith(b"{"):
            continue
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            continue
        if isinstance(chunk, dict):
            yield chunk


def indexed_choices(chunk: dict[str, Any]) -> Iterator[tuple[int, dict[str, Any]]]:
    """A chunk's choices with their index (0 where the engine gave none or a bad one)."""
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return
    for choice in choices:
        if isinstance(choice, dict):
            index = choice.get("index", 0)
            yield (index if isinstance(index, int) else 0), choice


class StreamTally:
    """The text a stream delivered, per choice, and the fields of its chunks."""

    __slots__ = ("finishes", "head", "texts")

    def __init__(self) -> None:
        self.texts: dict[int, list[str]] = {}
        self.finishes: dict[int, str] = {}
        self.head: dict[str, Any] | None = None

    def add(self, block: bytes) -> None:
        for chunk in sse_chunks(block):
            self.chunk(chunk)

    def chunk(self, chunk: dict[str, Any]) -> None:
        """Take one parsed chunk (for a caller that parsed it already)."""
        if self.head is None and "id" in chunk:
            self.head = {
                "id": chunk.get("id"),
                "object": chunk.get("object"),
                "created": chunk.get("created"),
                "model": chunk.get("model"),
            }
        for index, choice in indexed_choices(chunk):
            pieces = self.texts.setdefault(index, [])
            finish = choice.get("finish_reason")
            if isinstance(finish, str):
                self.finishes[index] = finish
            text = choice.get("text")
            if isinstance(text, str):
                pieces.append(text)
            delta = choice.get("delta")
            if isinstance(delta, dict):
                _delta_text(delta, pieces)

    def completions(self, stop: str | None = None) -> list[str]:
        """The text of each choice, with ``stop`` after those that ended at a stop.

        An engine counts the tokens of the stop string it matched, which it
        never sends: llama_cpp.server reported 6 completion tokens for a
        5-token text that ended at ``stop: ["\\n"]``. ``stop`` is the request's
        first stop string, the one llama-cpp-python looks for first; an
        answer that ended at its end-of-text token with stop strings given
        is then counted a token or so high, which cannot be told apart from
        the stream.
        """
        return [
            "".join(pieces) + (stop if stop and self.finishes.get(i) == "stop" else "")
            for i, pieces in sorted(self.texts.items())
        ]

    def usage_event(self, usage: Usage, chat: bool) -> bytes:
        """OpenAI's last chunk of a stream with include_usage: empty choices, the usage."""
        head = self.head or {}
        created = head.get("created")
        kind = "chat.completion.chunk" if chat else "text_completion"
        chunk: dict[str, Any] = {
            "id": head.get("id") or "",
            "object": head.get("object") or kind,
            "created": created if isinstance(created, int) else int(time.time()),
            "model": head.get("model") or "",
            "choices": [],
            "usage": {
                "prompt_tokens": usage.prompt,
                "completion_tokens": usage.completion,
                "total_tokens": usage.prompt + usage.completion,
            },
        }
        return b"data: " + orjson.dumps(chunk) + b"\n\n"


def _delta_text(delta: dict[str, Any], pieces: list[str]) -> None:
    for key in ("content", "reasoning_content"):
        value = delta.get(key)
        if isinstance(value, str):
            pieces.append(value)
    for call in tool_calls(delta):
        function = call.get("function")
        if isinstance(function, dict):
            for key in ("name", "arguments"):
                value = function.get(key)
                if isinstance(value, str):
                    pieces.append(value)


def tool_calls(delta: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The pieces of tool calls in a chat delta (each a part of one call, by its index)."""
    calls = delta.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            if isinstance(call, dict):
                yield call

