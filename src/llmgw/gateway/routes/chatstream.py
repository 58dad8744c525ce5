"""Relaying a chat or completions stream, and how it ends and is metered on each kind of engine.

The relay itself is the same for every engine: whole SSE events passed on
as they come (:class:`~llmgw.gateway.routes.sse.StreamRelay`), an error event for
a stream that breaks or ends without its finish, one write for the engine's
last events and the stream's end. What differs is the end (an
:class:`Ending`):

* an engine that reports usage (:data:`REPORTED`): the stream ends as the
  engine ended it, and is metered with the usage it reported;
* an engine of an agent that declared no dialect (:data:`UNDECLARED`): as
  above, and where no usage came, one event is about one token;
* an engine that sends no usage (:class:`Counted`): the gateway counts what
  the client received with the engine's tokenizer; the usage chunk OpenAI
  sends goes before ``[DONE]`` for a client that asked for it, and the count
  of a client that did not is made after its answer, off its time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from llmgw.gateway.call import Call
from llmgw.gateway.metering.account import account, count_later
from llmgw.gateway.metering.counter import StreamCounter
from llmgw.gateway.metering.tally import StreamTally
from llmgw.gateway.metering.usage import Usage
from llmgw.gateway.routes.answer import stream_out
from llmgw.gateway.routes.sse import StreamRelay, sse_error
from llmgw.http.upstream import BodyBroken, ConnectFailed, Response, UpstreamTimeout

log = logging.getLogger(__name__)

_DONE = b"data: [DONE]\n\n"


class Ending:
    """How a stream of one kind of engine ends and is metered (engines that report usage)."""

    __slots__ = ("_estimate", "joins_last", "observe")

    # The relay holds [DONE] back for tail(), which adds what must precede it.
    hold_done = False
    # Whether tail() adds anything (a stream that ended whole).
    adds_tail = False

    def __init__(self, estimate: bool, joins_last: bool = True) -> None:
        self._estimate = estimate
        # The engine's last events may leave with the stream's end in one
        # write (not when the end waits for a count: they would wait for it).
        self.joins_last = joins_last
        # What sees each block of whole events before it is relayed (None: nothing).
        self.observe: Callable[[bytes], None] | None = None

    async def tail(self) -> bytes:
        """The stream's last bytes after the engine's, for a stream that ended whole."""
        return b""

    def meter(self, call: Call, relay: StreamRelay, failed: bool) -> None:
        """Meter the stream, however it ended (also one that broke or was cut)."""
        usage = relay.usage
        if usage is None and self._estimate and relay.events:
            # An engine of an agent that declares no dialect may send no
            # usage: one event is about one token, less the role's.
            usage = Usage(completion=max(0, relay.events - 1))
        account(call, usage, failed)


REPORTED = Ending(estimate=False)
UNDECLARED = Ending(estimate=True)


class Counted(Ending):
    """A stream the gateway counts (its engine sends no usage); one per request."""

    __slots__ = ("_asked", "_counter", "_tally", "_usage")

    hold_done = True
    adds_tail = True

    def __init__(self, counter: StreamCounter, asked: bool) -> None:
        super().__init__(estimate=False, joins_last=not asked)
        self._counter = counter
        self._asked = asked  # the client asked for the usage chunk
        self._tally = StreamTally()
        self._usage: Usage | None = None  # counted before the stream's end
        self.observe = self._tally.add

    async def tail(self) -> bytes:
        if not self._asked:
            return _DONE
        self._usage, complete = await self._counter.usage(self._tally)
        if not complete:
            return _DONE
        return self._tally.usage_event(self._usage, self._counter.chat) + _DONE

    def meter(self, call: Call, relay: StreamRelay, failed: bool) -> None:
        if self._usage is not None:
            account(call, self._usage, failed)
        else:
            # Also a stream that broke or was cut: what the client received
            # was generated, and is metered.
            count_later(call, self._counter, self._tally, failed)


async def relay_stream(
    call: Call, response: Response, first: bytes, before: float, relay: StreamRelay,
    ending: Ending,
) -> int:  # fmt: skip
    """Relay a stream from its ``first`` chunk to its end; 200 (sent before the stream)."""
    model = call.model
    out = stream_out(call)
    failed = False
    try:
        out.start(200, call.stream_headers(before))
        last = b""
        try:
            chunk: bytes | None = first
            while chunk is not None:
                data = relay.feed(chunk)
                if response.drained and ending.joins_last:
                    # The engine's answer is over: its last events go out with
                    # the stream's end, one write to the client instead of two.
                    last = data
                    break
                await out.stream(data)
                chunk = await response.next_chunk()
        except (BodyBroken, ConnectFailed, UpstreamTimeout) as exc:
            failed = True
            log.info("stream of %s broke after it started: %s", model, exc)
            await out.stream(
                relay.flush() + sse_error(f"The model `{model}` stopped answering: {exc}"), False
            )
            return 200
        tail = last + relay.flush()
        if not relay.whole:
            # Cut short by the engine yet ended as if complete: the client
            # must not take the short answer for the whole one.
            failed = True
            log.info("stream of %s ended early (finish reason: %s, [DONE]: %s)",
                     model, relay.finished, relay.done)  # fmt: skip
            tail += sse_error(
                f"The model `{model}` ended its answer before finishing it (the engine sent"
                " no finish_reason); the answer is incomplete.",
                code="upstream_incomplete",
            )
        elif ending.adds_tail:
            tail += await ending.tail()
        await out.stream(tail, False)
        return 200
    finally:
        response.release()
        ending.meter(call, relay, failed)
