"""Mending engine dialects: what the gateway changes so every engine speaks OpenAI.

Each engine adapter declares what its engine gets wrong (:class:`wire.EngineDialect`);
the control plane passes it with every endpoint. Here it is compiled once per
endpoint into a :class:`Mending` (shared between endpoints that speak alike),
so the request path reads two booleans instead of interpreting a dialect.

Four things are mended:

* a limit in ``max_completion_tokens`` (what current OpenAI clients send) is
  sent as ``max_tokens`` to an engine that ignores the former, which would
  otherwise generate until its context is full;
* a stream from an engine that sends no usage is counted by the gateway after
  the stream, with the engine's own tokenizer, and the usage chunk OpenAI
  sends is added for a client that asked for it. Counts are exact, never
  estimated from the number of events: the completion is the text the client
  received, tokenized by the engine (less what its tokenizer adds to an empty
  text, e.g. BOS); a chat prompt is what the engine itself reports for a
  one-token, non-streamed copy of the request, since only the engine knows the
  chat template it applied (a completion prompt given as one string is simply
  tokenized, as the engine does before generating);
* a non-streamed request to an engine that would finish it for a client who
  has left is sent as a stream, and the non-streamed answer is assembled from
  it (llmgw.gateway.assemble), with the usage the engine reports in streams
  or, where it reports none, counted as above;
* a chat message of the ``developer`` role (OpenAI's new name for
  ``system``) is sent as ``system`` to an engine that knows no such role.

A request the engine would answer wrongly or fail on is refused with 400
naming the field (:func:`refusal`): ``n`` > 1 where the engine returns one
choice, logprobs where it returns none.

An endpoint whose agent reported no dialect is served unmended, as before
dialects existed (:data:`LEGACY`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from llmgw import wire
from llmgw.gateway.proxy import Upstream, Usage, find_usage
from llmgw.gateway.responses import ApiError
from llmgw.http.upstream import BodyBroken, ConnectFailed, UpstreamTimeout

if TYPE_CHECKING:
    from llmgw.gateway.routing.replica import Replica

log = logging.getLogger(__name__)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# Counting a stream runs after it. A client that asked for usage waits for
# the end of its stream meanwhile: a count that takes longer than this costs
# it the usage chunk, not the answer. A count nobody waits for (metering
# only) may take much longer: llama_cpp.server serves one request at a time,
# and the count queues behind every request that arrived during the stream.
COUNT_TIMEOUT_S = 30.0
METER_TIMEOUT_S = 600.0
# A non-streamed answer always carries its usage (OpenAI's shape), and its
# client waits for the whole answer anyway: an answer built from a stream
# waits this long for the count, which on a one-request-at-a-time engine
# queues behind every request waiting for it (16 at once took over 30 s).
ANSWER_COUNT_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class Mending:
    """What the gateway does for one kind of endpoint, compiled from its dialect."""

    # The engine ignores max_completion_tokens: send the limit as max_tokens.
    rename_max_completion_tokens: bool
    # The engine sends no usage in streams: count them (needs a tokenize route).
    count_streams: bool
    tokenize_path: str | None
    tokenize_field: str
    # The engine finishes a non-streamed request whatever happens to its
    # client: send it as a stream and assemble the answer. Only where the
    # stream's usage is known (reported, or countable): an answer without
    # usage would cost the client more than an unstopped engine costs.
    assemble_unstreamed: bool = False
    # The engine reports usage in a stream when asked (include_usage).
    reports_stream_usage: bool = True
    # The engine knows no "developer" role: send such messages as "system".
    developer_as_system: bool = False
    # The engine returns no logprobs / one choice only: refuse requests for more.
    logprobs: bool = True
    choices: bool = True
    # No dialect was reported (an older agent): nothing is mended, and a
    # stream without usage is metered by its number of events, as before.
    legacy: bool = False


LEGACY = Mending(False, False, None, "input", legacy=True)
_compiled: dict[tuple[Any, ...], Mending] = {}


def mending_for(dialect: wire.EngineDialect | None) -> Mending:
    """The mending of one endpoint (called when a config arrives, never per request)."""
    if dialect is None:
        return LEGACY
    key = (
        dialect.max_completion_tokens,
        dialect.stream_usage,
        dialect.tokenize_path,
        dialect.tokenize_field,
        dialect.stops_unstreamed,
        dialect.developer_role,
        dialect.logprobs,
        dialect.choices,
    )
    mending = _compiled.get(key)
    if mending is None:
        count_streams = not dialect.stream_usage and dialect.tokenize_path is not None
        mending = Mending(
            rename_max_completion_tokens=not dialect.max_completion_tokens,
            count_streams=count_streams,
            tokenize_path=dialect.tokenize_path,
            tokenize_field=dialect.tokenize_field,
            assemble_unstreamed=not dialect.stops_unstreamed
            and (dialect.stream_usage or count_streams),
            reports_stream_usage=dialect.stream_usage,
            developer_as_system=not dialect.developer_role,
            logprobs=dialect.logprobs,
            choices=dialect.choices,
        )
        _compiled[key] = mending
    return mending


def mend_request(path: str, payload: dict[str, Any], mending: Mending) -> bool:
    """Rewrite what the engine would ignore or refuse; True when ``payload`` changed."""
    changed = _mend_limit(path, payload, mending)
    if path == CHAT and mending.developer_as_system and _developer_as_system(payload):
        changed = True
    return changed


def _developer_as_system(payload: dict[str, Any]) -> bool:
    """Send ``developer`` messages as ``system``, which OpenAI treats them as.

    llama_cpp.server refused the role (a 500 with its validation error), and
    llama-server's built-in templates would write it as a turn of that name.
    """
    messages = payload.get("messages")
    if not isinstance(messages, list):
        return False
    changed = False
    for i, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "developer":
            messages[i] = {**message, "role": "system"}
            changed = True
    return changed


def refusal(path: str, payload: dict[str, Any], mending: Mending, model: str) -> ApiError | None:
    """400 naming the field, for a request the engine would answer wrongly or fail on.

    llama_cpp.server answers ``n: 2`` with one choice, and without
    ``--logits_all`` (as the agent starts it) fails on ``top_logprobs`` (a 500
    unstreamed, a stream cut before its first token) and answers a bare
    ``logprobs: true`` with ``logprobs: null``.
    """
    if path not in (CHAT, COMPLETIONS):
        return None
    n = payload.get("n")
    if not mending.choices and isinstance(n, int) and n > 1:
        return _unsupported(
            "n", f"The model `{model}`'s engine returns one choice: `n` must be 1"
            f" (got {n}); send {n} requests for {n} answers."
        )  # fmt: skip
    if mending.logprobs:
        return None
    if path == CHAT and payload.get("logprobs") is True:
        param = "top_logprobs" if payload.get("top_logprobs") is not None else "logprobs"
    elif path == COMPLETIONS and payload.get("logprobs") is not None:
        param = "logprobs"
    else:
        return None
    return _unsupported(
        param, f"The model `{model}`'s engine returns no log probabilities: leave out `{param}`."
    )


def _unsupported(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="unsupported_parameter")


def _mend_limit(path: str, payload: dict[str, Any], mending: Mending) -> bool:
    """``max_completion_tokens`` to ``max_tokens`` where the engine ignores it.

    And on ``/v1/completions`` for every engine: OpenAI's legacy endpoint
    only knows ``max_tokens``, and engines there ignore the other name. Both
    given: the smaller limit holds.
    """
    if "max_completion_tokens" not in payload:
        return False
    if not (mending.rename_max_completion_tokens or path == COMPLETIONS):
        return False
    limit = payload.pop("max_completion_tokens")
    if limit is None:
        return True
    current = payload.get("max_tokens")
    if isinstance(current, int) and isinstance(limit, int) and current <= limit:
        return True
    payload["max_tokens"] = limit
    return True


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
    """The text a stream delivered, per choice, and the fields of its chunks.

    Fed whole SSE events; parses each chunk (only for endpoints whose streams
    the gateway counts: those engines generate a few dozen tokens a second,
    and a chunk costs microseconds to parse).
    """

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


# What each endpoint's tokenizer counts for an empty text (BOS and the like),
# by (replica id, URL): asked once per endpoint, then remembered.
_bases: dict[tuple[str, str], int] = {}
_MAX_BASES = 4096


class CountFailed(Exception):
    """The engine's tokenizer (or its one-token answer) gave no count."""


# Fields of a request that change what is generated but not the prompt: the
# one-token copy that measures a chat prompt leaves them out.
_PROBE_DROPS = frozenset(
    {"stream", "stream_options", "max_tokens", "max_completion_tokens", "n", "best_of",
     "logprobs", "top_logprobs", "echo"}
)  # fmt: skip


class StreamCounter:
    """Counts one finished stream on the endpoint that produced it."""

    __slots__ = ("_early", "_engine_key", "_key", "_path", "_payload", "_replica_url",
                 "_request_id", "_upstream", "mending")  # fmt: skip

    def __init__(
        self,
        upstream: Upstream,
        replica: Replica,
        path: str,
        payload: dict[str, Any],
        request_id: str,
    ) -> None:
        self._upstream = upstream
        self._replica_url = replica.url
        self._engine_key = replica.engine_key
        self._key = (replica.replica_id, replica.url)
        self.mending = replica.mending
        self._path = path
        self._payload = payload
        self._request_id = request_id
        self._early: asyncio.Task[int] | None = None

    @property
    def chat(self) -> bool:
        return self._path == CHAT

    def begin(self) -> None:
        """Ask for the prompt's count now, while the stream still runs.

        An engine that serves one request at a time (llama_cpp.server) then
        takes it right after this stream, while its state still holds this
        prompt: asked after the stream, it would queue behind every request
        that arrived meanwhile and evaluate the whole prompt again. (The
        agent starts llama_cpp.server with interrupt_requests off, so a
        request that waits does not cut the running stream short.)
        """
        self._early = asyncio.get_running_loop().create_task(self._prompt())

    def _prompt(self) -> Coroutine[Any, Any, int]:
        prompt = self._payload.get("prompt")
        if self._path == COMPLETIONS and isinstance(prompt, str) and "suffix" not in self._payload:
            return self._count(prompt)
        return self._probe()

    async def usage(
        self, tally: StreamTally, timeout_s: float | None = None
    ) -> tuple[Usage, bool]:
        """The stream's usage, and whether every part of it was counted.

        A part the engine could not count (logged) counts 0: what was counted
        is still exact, and metered; a usage chunk is sent only when complete.
        ``timeout_s`` None: COUNT_TIMEOUT_S.
        """
        if timeout_s is None:
            timeout_s = COUNT_TIMEOUT_S
        try:
            # asyncio.timeout, not 3.11's wait_for, which can swallow a cancel
            # (a stop) landing as the count completes.
            async with asyncio.timeout(timeout_s):
                return await self._usage(tally)
        except TimeoutError:
            log.warning("request %s: could not count its stream on %s within %ss",
                        self._request_id, self._replica_url, timeout_s)  # fmt: skip
            return Usage(), False

    async def _usage(self, tally: StreamTally) -> tuple[Usage, bool]:
        known = _bases.get(self._key)
        counts = await asyncio.gather(
            self._early or self._prompt(),
            self._count("") if known is None else _known(known),
            *(self._count(text) for text in tally.completions(_first_stop(self._payload))),
            return_exceptions=True,
        )
        failures = [c for c in counts if isinstance(c, BaseException)]
        for failure in failures:
            if not isinstance(failure, (CountFailed, ConnectFailed, BodyBroken, UpstreamTimeout)):
                raise failure
            log.warning("request %s: could not count part of its stream on %s: %s",
                        self._request_id, self._replica_url, failure)  # fmt: skip
        prompt_tokens, base = counts[0], counts[1]
        if isinstance(base, int):
            if len(_bases) >= _MAX_BASES:
                _bases.clear()
            _bases[self._key] = base
            completion = sum(max(0, n - base) for n in counts[2:] if isinstance(n, int))
        else:
            completion = 0
        prompt_tokens = prompt_tokens if isinstance(prompt_tokens, int) else 0
        return Usage(prompt=prompt_tokens, completion=completion), not failures

    async def _post(self, path: str, body: dict[str, Any]) -> bytes:
        target = self._upstream.target(self._replica_url, path, self._engine_key)
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

    async def _count(self, text: str) -> int:
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

    async def _probe(self) -> int:
        body = {k: v for k, v in self._payload.items() if k not in _PROBE_DROPS}
        body["stream"] = False
        body["max_tokens"] = 1
        usage = find_usage(await self._post(self._path, body))
        if usage is None:
            raise CountFailed(f"the one-token copy on {self._path} reported no usage")
        return usage.prompt


def _first_stop(payload: dict[str, Any]) -> str | None:
    stop = payload.get("stop")
    if isinstance(stop, list):
        stop = stop[0] if stop else None
    return stop if isinstance(stop, str) and stop else None


async def _known(value: int) -> int:
    return value
