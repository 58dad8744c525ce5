"""Server-sent events as engines stream them: whole events passed on, their end and usage noted.

What every relay of a stream shares (:class:`EventBuffer`), and the chat and
completions relay (:class:`StreamRelay`). Anything after the first byte was
relayed is reported in-band (:func:`sse_error`): the status is gone.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import orjson

from llmgw.gateway.metering.usage import Usage, find_usage

_EVENT_SPLIT = re.compile(rb"(?:\r?\n){2}")
_USAGE_MARK = b'"usage":{'
_USAGE_MARK_SPACED = b'"usage": {'
# A finish reason that is a string, not null: the answer really ended.
_FINISH_MARK = b'"finish_reason":"'
_FINISH_MARK_SPACED = b'"finish_reason": "'
_DONE_MARK = b"[DONE]"
_DONE_EVENTS = (b"data: [DONE]", b"data:[DONE]")
# Where _take_events has something to do: the first usage or [DONE] mark.
_MARKS = re.compile(rb'"usage": ?\{|\[DONE\]')


def _last_boundary(data: bytes) -> int:
    """End (exclusive) of the last complete SSE event in ``data``, or -1."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else -1, crlf + 4 if crlf >= 0 else -1)


class EventBuffer:
    """Holds a stream's bytes until they complete an SSE event: relays pass whole events on."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    def whole_events(self, chunk: bytes) -> bytes:
        """The events ``chunk`` completes, with what was held before them (b"": none yet)."""
        if self._pending:
            data = self._pending + chunk
        elif chunk[-2:] == b"\n\n":
            return chunk  # the usual: whole events (_last_boundary would say len(chunk))
        else:
            data = chunk
        cut = _last_boundary(data)
        if cut < 0:
            self._pending = data
            return b""
        self._pending = data[cut:]
        return data[:cut]

    def flush(self) -> bytes:
        """What is held (the end of a stream that ended mid-event)."""
        rest, self._pending = self._pending, b""
        return rest


class StreamRelay(EventBuffer):
    """Passes an SSE stream through whole events at a time, noting the usage.

    Events are forwarded as soon as they are complete (engines write whole
    events, so this adds no delay), which also means an error event appended
    after a failure never lands in the middle of a half-sent line. When the
    gateway itself asked the engine for ``include_usage``, the usage-only event
    is removed so the client sees the stream it asked for.

    A stream is whole only with a finish reason and then ``[DONE]``: an
    engine that stops early without either (llama_cpp.server cuts a running
    stream when another request arrives, and still sends ``[DONE]``) would
    otherwise hand the client a short answer that looks complete. So
    ``[DONE]`` is passed on only after a finish reason; the caller reports
    an error for a stream that is not :attr:`whole`. With ``hold_done`` it is
    never passed on: the caller adds what must precede it (a usage chunk it
    counted), then ``[DONE]`` itself. ``observe`` sees every complete event
    block before it is relayed (to count what the client received).
    """

    __slots__ = ("_hold_done", "_observe", "_strip", "done", "events", "finished", "usage")

    def __init__(
        self,
        strip_usage: bool,
        *,
        hold_done: bool = False,
        observe: Callable[[bytes], None] | None = None,
    ) -> None:
        super().__init__()
        self._strip = strip_usage
        self._hold_done = hold_done
        self._observe = observe
        self.usage: Usage | None = None
        self.events = 0
        self.finished = False  # a finish reason was seen
        self.done = False  # [DONE] was seen

    @property
    def whole(self) -> bool:
        """The engine ended the stream properly: a finish reason, then [DONE]."""
        return self.finished and self.done

    def feed(self, chunk: bytes) -> bytes:
        complete = self.whole_events(chunk)
        if not complete:
            return b""
        self.events += complete.count(b"data:")
        if (
            not self.finished
            and (_FINISH_MARK in complete or _FINISH_MARK_SPACED in complete)
            and _DONE_MARK not in complete
        ):
            # With a [DONE] in the same block, which came first decides
            # (_take_events looks at the events in order): a [DONE] before
            # the finish reason is the engine ending early, whatever
            # follows it in the same read (found by bench/fuzz.py: it went
            # out to the client when both arrived in one read).
            self.finished = True
        if self._observe is not None:
            self._observe(complete)
        if _USAGE_MARK in complete or _USAGE_MARK_SPACED in complete or _DONE_MARK in complete:
            # One pass over the events for both: an engine's last chunk holds
            # the usage and [DONE] together, and splitting it twice was ~15 %
            # of the gateway's CPU per streamed request.
            complete = self._take_events(complete)
        return complete

    def _take_events(self, block: bytes) -> bytes:
        """``block`` less a usage-only event the client did not ask for and a held [DONE]."""
        if b"\r" not in block and b"\n\n\n" not in block and block[:1] != b"\n":
            # Events apart by exactly one blank line (what engines send): the
            # ones before the first mark are split and joined back unchanged,
            # so they go out as they are, and only the rest is looked at (the
            # last of a read's events are usually the usage and [DONE]).
            mark = _MARKS.search(block)
            if mark is not None:
                cut = block.rfind(b"\n\n", 0, mark.start())
                if cut >= 0:
                    head = block[: cut + 2]
                    if not self.finished and (_FINISH_MARK in head or _FINISH_MARK_SPACED in head):
                        self.finished = True
                    return head + self._kept_events(block[cut + 2 :])
        return self._kept_events(block)

    def _kept_events(self, block: bytes) -> bytes:
        """Each event of ``block`` looked at: the events kept, joined."""
        kept: list[bytes] = []
        for event in _EVENT_SPLIT.split(block):
            if not event:
                continue
            if not self.finished and (_FINISH_MARK in event or _FINISH_MARK_SPACED in event):
                self.finished = True
            if _USAGE_MARK in event or _USAGE_MARK_SPACED in event:
                usage = find_usage(event)
                if usage is not None:
                    self.usage = usage
                    if self._strip and (b'"choices":[]' in event or b'"choices": []' in event):
                        continue
            elif _DONE_MARK in event and event.strip() in _DONE_EVENTS:
                self.done = True
                if not self.finished or self._hold_done:
                    continue
            kept.append(event)
        return b"\n\n".join(kept) + b"\n\n" if kept else b""


def sse_error(message: str, code: str = "upstream_error") -> bytes:
    """An error event for a stream that already started (status 200 is gone)."""
    payload = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + orjson.dumps(payload) + b"\n\n"
