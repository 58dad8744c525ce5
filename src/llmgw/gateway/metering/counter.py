"""Counting a stream whose engine reports no usage, exactly, with the engine's own tokenizer.

Counts are never estimated from the number of events: the completion is
the text the client received, tokenized by the engine (less what its
tokenizer adds to an empty text, e.g. BOS); a completion prompt given as one
string is simply tokenized, as the engine does before generating. A chat
prompt is rendered with the chat template the engine declared
(:mod:`llmgw.gateway.metering.template`) and tokenized: nothing generates
for a count, so the engine's time and its prompt cache are the clients'.
Only where the engine declared no template, or the request is one the
rendering is not certain for (tools, content parts), is it what the engine
reports for a one-token, non-streamed copy of the request. The calls
themselves are :mod:`llmgw.gateway.metering.tokenizer`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Coroutine
from typing import Any

from llmgw.gateway.engineclient import Upstream
from llmgw.gateway.metering.tally import StreamTally
from llmgw.gateway.metering.tokenizer import CountFailed, EngineTokenizer
from llmgw.gateway.metering.usage import Usage
from llmgw.gateway.routing.replica import Replica
from llmgw.gateway.routing.turns import Turns
from llmgw.http.upstream import BodyBroken, ConnectFailed, UpstreamTimeout

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

# What each endpoint's tokenizer counts for an empty text (BOS and the like),
# by (replica id, URL): asked once per endpoint, then remembered.
_bases: dict[tuple[str, str], int] = {}
_MAX_BASES = 4096


class StreamCounter:
    """Counts one finished stream on the endpoint that produced it."""

    __slots__ = ("_early", "_key", "_path", "_payload", "_request_id", "_tokenizer", "_turns")

    def __init__(
        self,
        upstream: Upstream,
        replica: Replica,
        path: str,
        payload: dict[str, Any],
        request_id: str,
    ) -> None:
        self._tokenizer = EngineTokenizer(upstream, replica, path, payload)
        self._key = (replica.replica_id, replica.url)
        self._path = path
        self._payload = payload
        self._request_id = request_id
        self._early: asyncio.Task[int] | None = None
        self._turns = replica.turns if replica.serial else None

    @property
    def chat(self) -> bool:
        return self._path == CHAT

    def begin(self, waited_for: bool = True) -> None:
        """Ask for the prompt's count now, while the stream still runs.

        An engine that serves one request at a time (llama_cpp.server) then
        takes it right after this stream: asked after the stream, it would
        queue behind every request that arrived meanwhile (and a one-token
        copy would evaluate the whole prompt again). (The agent starts
        llama_cpp.server with interrupt_requests off, so a request that
        waits does not cut the running stream short.) Not there where
        nobody waits for the count (``waited_for`` False): it would go
        before the next client's prompt; it takes the last turn after the
        stream instead (usage).
        """
        if waited_for or self._turns is None:
            self._early = asyncio.get_running_loop().create_task(self._prompt())

    def _prompt(self) -> Coroutine[Any, Any, int]:
        prompt = self._payload.get("prompt")
        if self._path == COMPLETIONS and isinstance(prompt, str) and "suffix" not in self._payload:
            return self._tokenizer.count(prompt)
        template = self._tokenizer.mending.chat_prompt
        if self._path == CHAT and template is not None:
            rendered = template.render(self._payload)
            if rendered is not None:
                return self._rendered(rendered)
        return self._tokenizer.prompt_tokens()

    async def _rendered(self, text: str) -> int:
        """A chat prompt rendered as the engine renders it, counted by its tokenize route.

        The template writes the BOS text itself and the engine tokenizes the
        rendering without adding its tokenizer's own; the tokenize route adds
        it (what it counts for an empty text), so that is taken off.
        """
        known = _bases.get(self._key)
        count = self._tokenizer.count
        total, base = await asyncio.gather(
            count(text), count("") if known is None else _known(known)
        )
        return max(0, total - base)

    async def usage(
        self, tally: StreamTally, timeout_s: float | None = None, waited_for: bool = True
    ) -> tuple[Usage, bool]:
        """The stream's usage, and whether every part of it was counted.

        A part the engine could not count (logged) counts 0: what was counted
        is still exact, and metered; a usage chunk is sent only when complete.
        ``timeout_s`` None: COUNT_TIMEOUT_S. ``waited_for`` False: nobody
        waits for the count (metering only), and on an engine that computes
        one request at a time it takes the last turn (:meth:`_in_turn`).
        """
        if timeout_s is None:
            timeout_s = COUNT_TIMEOUT_S
        try:
            # asyncio.timeout, not 3.11's wait_for, which can swallow a cancel
            # (a stop) landing as the count completes.
            async with asyncio.timeout(timeout_s):
                if not waited_for and self._turns is not None and self._early is None:
                    return await self._in_turn(tally, self._turns)
                return await self._usage(tally)
        except TimeoutError:
            log.warning("request %s: could not count its stream on %s within %ss",
                        self._request_id, self._tokenizer.url, timeout_s)  # fmt: skip
            return Usage(), False

    async def _in_turn(self, tally: StreamTally, turns: Turns) -> tuple[Usage, bool]:
        """The counts in a turn at the engine that clients' requests all go before.

        Such an engine takes each request under one lock: counts sent
        beside the gateway's turns came before the next client's prompt,
        ~10-50 ms each on llama_cpp.server, paid by that client's first
        token (bench/routing_real.py: TTFT mean 12 % above sglang-router's,
        which meters nothing, at the same hit rate). In the last turn they
        use the engine's idle time; a count passed over MAX_PASSED times
        goes next all the same, so metering keeps up with a busy engine.
        """
        await turns.take(math.inf)
        try:
            return await self._usage(tally)
        finally:
            turns.release()

    async def _usage(self, tally: StreamTally) -> tuple[Usage, bool]:
        known = _bases.get(self._key)
        count = self._tokenizer.count
        counts = await asyncio.gather(
            self._early or self._prompt(),
            count("") if known is None else _known(known),
            *(count(text) for text in tally.completions(_first_stop(self._payload))),
            return_exceptions=True,
        )
        failures = [c for c in counts if isinstance(c, BaseException)]
        for failure in failures:
            if not isinstance(failure, (CountFailed, ConnectFailed, BodyBroken, UpstreamTimeout)):
                raise failure
            log.warning("request %s: could not count part of its stream on %s: %s",
                        self._request_id, self._tokenizer.url, failure)  # fmt: skip
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


def _first_stop(payload: dict[str, Any]) -> str | None:
    stop = payload.get("stop")
    if isinstance(stop, list):
        stop = stop[0] if stop else None
    return stop if isinstance(stop, str) and stop else None


async def _known(value: int) -> int:
    return value
