"""OpenAI request parsing and response shapes for the simulated engine.

Pure functions, no I/O: the server (``llmgw.sim.engine``) calls them. A
malformed request becomes a ValidationError naming the field, which the server
turns into OpenAI's error shape with status 400, so a client bug shows as a
message rather than a 500.

Streaming chunks are built from two byte templates per request with only the
token's text in between: a token costs one small concatenation, not a dict
and a JSON encoding, because dozens of engines share one core.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
import time
from dataclasses import dataclass
from typing import Any

import orjson

from llmgw.errors import ValidationError
from llmgw.sim import tokens

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions; used for chat too
EMBEDDING_DIM = 16


@dataclass(frozen=True)
class ParsedCompletion:
    chat: bool
    model: str
    prompt: bytes
    max_tokens: int
    stream: bool
    include_usage: bool


def error_body(message: str, type_: str, code: str | int | None, param: str | None = None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


def parse_completion(
    body: Any, *, chat: bool, max_completion_tokens: bool = True, stream_usage: bool = True
) -> ParsedCompletion:
    """The request; ``max_completion_tokens``/``stream_usage`` False ignore those
    fields, as llama_cpp.server does (SimParams' dialect switches)."""
    if not isinstance(body, dict):
        raise ValidationError("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ValidationError("'model' must be a non-empty string", field="model")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValidationError("'messages' must be a non-empty list", field="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise ValidationError(f"messages[{i}] must be an object", field="messages")
        text = tokens.render_chat(messages)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ValidationError(
                "'prompt' must be a string (or a list of one string)", field="prompt"
            )
        text = prompt
    max_tokens = body.get("max_tokens")
    if max_completion_tokens:
        max_tokens = body.get("max_completion_tokens", max_tokens)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValidationError("'max_tokens' must be an integer >= 1", field="max_tokens")
    n = body.get("n", 1)
    if n not in (None, 1):
        raise ValidationError("only n=1 is supported", field="n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool | None):
        raise ValidationError("'stream' must be a boolean", field="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ValidationError("'stream_options' must be an object", field="stream_options")
    return ParsedCompletion(
        chat=chat,
        model=model,
        prompt=text.encode("utf-8"),
        max_tokens=max_tokens,
        stream=bool(stream),
        include_usage=stream_usage and bool(options.get("include_usage", False)),
    )


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class ChunkWriter:
    """Builds the SSE byte stream of one streamed completion."""

    def __init__(self, req_id: str, model: str, chat: bool) -> None:
        self.chat = chat
        self._head = {
            "id": req_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }
        head = orjson.dumps(self._head)[:-1]  # without the closing brace
        if chat:
            self._prefix = b"data: " + head + b',"choices":[{"index":0,"delta":{"content":'
            self._suffix = b'},"logprobs":null,"finish_reason":null}]}\n\n'
        else:
            self._prefix = b"data: " + head + b',"choices":[{"index":0,"text":'
            self._suffix = b',"logprobs":null,"finish_reason":null}]}\n\n'

    def _event(self, payload: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps({**self._head, **payload}) + b"\n\n"

    def role(self) -> bytes:
        """Chat streams open with the assistant role, as OpenAI's do."""
        delta = {"role": "assistant", "content": ""}
        return self._event({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})

    def tokens(self, start: int, stop: int) -> bytes:
        return b"".join(
            self._prefix + orjson.dumps(tokens.filler_token(i)) + self._suffix
            for i in range(start, stop)
        )

    def finish(self, reason: str) -> bytes:
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
        if self.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        return self._event({"choices": [choice]})

    def usage(self, usage_: dict[str, Any]) -> bytes:
        return self._event({"choices": [], "usage": usage_})

    @staticmethod
    def done() -> bytes:
        return b"data: [DONE]\n\n"


def completion_body(
    req_id: str, model: str, chat: bool, n_tokens: int, usage_: dict[str, Any]
) -> bytes:
    text = tokens.filler_text(n_tokens)
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return orjson.dumps(
        {
            "id": req_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": usage_,
        }
    )


def embedding_inputs(body: Any) -> tuple[str, list[str], bool]:
    """(model, inputs, as_base64) of an embeddings request."""
    if not isinstance(body, dict):
        raise ValidationError("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ValidationError("'model' must be a non-empty string", field="model")
    raw = body.get("input")
    inputs = [raw] if isinstance(raw, str) else raw
    if not isinstance(inputs, list) or not inputs or not all(isinstance(s, str) for s in inputs):
        raise ValidationError(
            "'input' must be a string or a non-empty list of strings", field="input"
        )
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise ValidationError(
            "'encoding_format' must be 'float' or 'base64'", field="encoding_format"
        )
    return model, inputs, fmt == "base64"


def embedding(text: str) -> list[float]:
    """A deterministic unit vector of EMBEDDING_DIM floats derived from the text."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=2 * EMBEDDING_DIM).digest()
    raw = [v / 32768.0 - 1.0 for v in struct.unpack(f"<{EMBEDDING_DIM}H", digest)]
    norm = math.sqrt(sum(v * v for v in raw)) or 1.0
    return [v / norm for v in raw]


def embeddings_body(model: str, inputs: list[str], as_base64: bool) -> bytes:
    data: list[dict[str, Any]] = []
    for i, text in enumerate(inputs):
        vector: list[float] | str = embedding(text)
        if as_base64:
            # OpenAI's base64 form: little-endian float32, what its clients decode.
            vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
        data.append({"object": "embedding", "index": i, "embedding": vector})
    n = sum(tokens.count_tokens(s) for s in inputs)
    return orjson.dumps(
        {
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": n, "total_tokens": n},
        }
    )
