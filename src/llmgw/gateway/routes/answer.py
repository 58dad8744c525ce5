"""Answering a client with what an engine sent, for every route.

A stream's first chunk is read before anything goes to the client (so a
replica that fails during prefill is still retried elsewhere); an
unstreamed answer is passed on whole, renamed for an external model and
metered; a stream goes out through the server's Reply
(llmgw.http.contract), with no ASGI messages.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from llmgw.gateway.call import Call
from llmgw.gateway.external import RenamingReply
from llmgw.gateway.metering.account import account
from llmgw.gateway.metering.usage import Usage
from llmgw.gateway.replies import JSON, engine_failed, overhead_header, send_bytes
from llmgw.gateway.routing.prefill import Prefill
from llmgw.gateway.types import Reply
from llmgw.http.upstream import Response


def stream_out(call: Call) -> Reply:
    """Where ``call``'s streamed answer goes, one ``stream`` call per event block.

    The head waits for the first events (Reply.start), so a relay sends on
    each turn before it waits. An external model's stream is renamed piece
    by piece.
    """
    rename = call.rename
    return call.send if rename is None else RenamingReply(call.send, rename)


async def first_chunk(call: Call, response: Response, prefill: Prefill, ttft: bool = True) -> bytes:
    """A stream's first chunk, read before anything goes to the client.

    Nothing is sent before it, so a replica that dies during prefill is still
    retried elsewhere. Empty where the stream ended without one.
    """
    first = await response.next_chunk()
    if first is None:
        # Over before its first event (an engine that refused the request
        # inside its stream): no prefix was cached, no prefill was timed.
        prefill.done()
        return b""
    prefill.started(streamed=True)
    if ttft:
        call.counters.ttft.observe(time.perf_counter() - call.started - call.waited)
    return first


async def answer_whole(
    call: Call, response: Response, prefill: Prefill, before: float,
    usage_in: Callable[[bytes], Usage | None],
) -> int:  # fmt: skip
    """Answer with the engine's unstreamed answer as it is (but for the model's name)."""
    if response.status == 200:
        prefill.started(streamed=False)
    else:
        prefill.done()
    data = await response.read()
    status = response.status
    kind = response.content_type or JSON
    if status >= 500:
        failure = engine_failed(call.model, call.request_id, status, data)
        data, kind = failure.body(), JSON
    elif call.rename is not None:
        data = call.rename(data)
    read_at = time.perf_counter()
    ok = status < 400
    account(call, usage_in(data) if ok else None, not ok)
    overhead = before + (time.perf_counter() - read_at)
    call.rt.metrics.overhead_hist.observe(overhead)
    await send_bytes(call.send, status, data, kind, [call.id_header, overhead_header(overhead)])
    return status
