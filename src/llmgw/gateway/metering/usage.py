"""Usage as engines report it: found in an answer without parsing the rest, in any route's shape.

A usage object is a few hundred bytes at the end of answers that may be
megabytes (embeddings are large arrays of floats): it is located by its key
and only it is parsed, so the cost does not grow with the answer. Routes
report it in three shapes: chat's ``prompt_tokens``/``completion_tokens``,
the Responses API's ``input_tokens``/``output_tokens``, a reranker's
``total_tokens`` alone (:func:`usage_in` reads them all; the chat routes
read only the first, :func:`find_usage`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(slots=True)
class Usage:
    prompt: int = 0
    completion: int = 0
    cached: int = 0


_BRACES = re.compile(rb"[{}]")
_MAX_USAGE_BYTES = 64 * 1024


def _closing_brace(data: bytes, start: int) -> int:
    """Index of the ``}`` closing the object at ``start`` (objects without braces in strings).

    One pass over the braces, within :data:`_MAX_USAGE_BYTES` of the start:
    counting them afresh at each ``}`` is quadratic (a deeply nested usage
    object in an upstream's answer would hold the gateway's loop for
    minutes), and even one pass over a megabyte of braces takes seconds
    (both found by bench/fuzz.py). A usage object is a few hundred bytes;
    one that does not close within the limit is not one.
    """
    end = data.find(b"}", start)
    if end < 0 or data.count(b"{", start, end) == 1:
        return end  # the usual: a flat usage object
    depth = 0
    for brace in _BRACES.finditer(data, start, start + _MAX_USAGE_BYTES):
        depth += 1 if brace.group() == b"{" else -1
        if depth == 0:
            return brace.start()
    return -1


def find_usage(data: bytes) -> Usage | None:
    """The last ``"usage": {...}`` object in ``data``, without parsing the rest.

    Embedding answers are large arrays of floats; locating the small usage
    object and parsing only it keeps the cost independent of answer size.
    """
    usage = usage_object(data)
    return None if usage is None else chat_usage(usage)


def chat_usage(usage: dict[str, Any]) -> Usage:
    """What to meter of a usage object in chat's shape (``prompt_tokens``...)."""
    # Inline (once per answer): a count that is not a positive int is 0.
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if type(details) is dict else 0
    return Usage(
        prompt if type(prompt) is int and prompt > 0 else 0,
        completion if type(completion) is int and completion > 0 else 0,
        cached if type(cached) is int and cached > 0 else 0,
    )


def usage_object(data: bytes) -> dict[str, Any] | None:
    """The last ``"usage": {...}`` object in ``data`` as a dict (only it is parsed)."""
    at = data.rfind(b'"usage"')
    if at < 0:
        return None
    start = data.find(b"{", at + 7, at + 32)
    if start < 0:
        return None
    end = _closing_brace(data, start)
    if end < 0:
        return None
    try:
        usage = orjson.loads(data[start : end + 1])
    except orjson.JSONDecodeError:
        return None
    return usage if isinstance(usage, dict) else None



def usage_in(data: bytes) -> Usage | None:
    """The usage of an answer (or stream event) of any route's shape, or None.

    An answer without token counts (a rerank without ``usage``, a
    transcription that reports audio seconds) has none: it is metered as a
    request with 0 tokens.
    """
    usage = usage_object(data)
    if usage is None:
        return None
    prompt = _count(usage, "prompt_tokens", "input_tokens")
    completion = _count(usage, "completion_tokens", "output_tokens") or 0
    if prompt is None:
        # A reranker reports total_tokens only: all of it is input.
        total = usage.get("total_tokens")
        prompt = max(0, total - completion) if type(total) is int else 0
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    cached = _count(details, "cached_tokens") if isinstance(details, dict) else None
    return Usage(prompt=prompt, completion=completion, cached=cached or 0)


def _count(usage: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = usage.get(name)
        if type(value) is int and value >= 0:
            return value
    return None



def counted_usage(usage: Usage) -> dict[str, Any]:
    """OpenAI's usage object for counts the gateway made itself."""
    return {
        "prompt_tokens": usage.prompt,
        "completion_tokens": usage.completion,
        "total_tokens": usage.prompt + usage.completion,
    }


def usage_of(usage: dict[str, Any] | None) -> Usage:
    """What to meter of a usage object an engine reported (None: nothing)."""
    return Usage() if usage is None else chat_usage(usage)

