"""An engine's tokenizer, reached over HTTP: the gateway has none of its own.

Two questions are asked of it: how many tokens a text is (the engine's
tokenize route, as its dialect names it), and, only where the engine
declared no chat template the gateway can render (metering.template), how
many tokens a chat prompt is once the engine applied its template: asked as
a one-token, non-streamed copy of the request, whose usage says it. That
copy is a generation (engine time, and a state in a bounded prompt cache),
which is why a declared template is rendered and tokenized instead.
"""

from __future__ import annotations

import os
from typing import Any

import orjson

from llmgw.gateway.dialect import Mending
from llmgw.gateway.engineclient import Upstream
from llmgw.gateway.metering.usage import find_usage
from llmgw.gateway.routing.replica import Replica


class CountFailed(Exception):
    """The engine's tokenizer (or its one-token answer) gave no count."""


# Fields of a request that change what is generated but not the prompt: the
# one-token copy that measures a chat prompt leaves them out.
_PROBE_DROPS = frozenset(
    {"stream", "stream_options", "max_tokens", "max_completion_tokens", "n", "best_of",
     "logprobs", "top_logprobs", "echo"}
)  # fmt: skip


class EngineTokenizer:
    """The tokenizer of the replica that served one request (``path``, ``payload``)."""

    __slots__ = ("_engine_key", "_path", "_payload", "_upstream", "mending", "url")

    def __init__(
        self, upstream: Upstream, replica: Replica, path: str, payload: dict[str, Any]
    ) -> None:
        self._upstream = upstream
        self.url = replica.url
        self._engine_key = replica.engine_key
        self.mending: Mending = replica.mending
        self._path = path
        self._payload = payload

    async def count(self, text: str) -> int:
        """The tokens of ``text`` by the engine's tokenize route."""
        path = self.mending.tokenize_path
        if path is None:
            raise CountFailed("the engine declares no tokenize route")
        body = {"model": self._payload.get("model"), self.mending.tokenize_field: text}
        try:
            answer = orjson.loads(await self._post(path, body))
        except orjson.JSONDecodeError as exc:
            raise CountFailed(f"{path} answered no JSON: {exc}") from None
        count = answer.get("count") if isinstance(answer, dict) else None
        if isinstance(count, int):
            return count
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if isinstance(tokens, list):
            return len(tokens)
        raise CountFailed(f"{path} answered neither a count nor tokens")

    async def prompt_tokens(self) -> int:
        """The request's prompt tokens, as the engine reports them for a one-token copy."""
        body = {k: v for k, v in self._payload.items() if k not in _PROBE_DROPS}
        body["stream"] = False
        body["max_tokens"] = 1
        usage = find_usage(await self._post(self._path, body))
        if usage is None:
            raise CountFailed(f"the one-token copy on {self._path} reported no usage")
        return usage.prompt

    async def _post(self, path: str, body: dict[str, Any]) -> bytes:
        target = self._upstream.target(self.url, path, self._engine_key)
        # An id of its own: engines key requests by X-Request-Id (vLLM
        # refuses a second request under an id still running).
        response = await self._upstream.post(target, orjson.dumps(body), os.urandom(16).hex())
        try:
            data = await response.read()
        finally:
            response.release()
        if response.status != 200:
            raise CountFailed(f"{path} answered {response.status}: {data[:200]!r}")
        return data
