"""Why an engine's stream ended before its first event: its own refusal, asked again unstreamed.

OpenAI and vLLM refuse a request they cannot serve before any answer starts:
a prompt longer than the model's context gets ``400`` with code
``context_length_exceeded`` and a message naming the limit, streamed or not.
llama_cpp.server (llama-cpp-python 0.3) checks the prompt against its
context only when generation starts, which for a stream is after it has
answered ``200``: the check raises inside the stream, and the stream ends
with no event at all (the engine logs the ValueError; nothing reaches its
client). The gateway asks llama_cpp.server for a stream even where the
client did not (llmgw.gateway.routes.assemble), so every over-long prompt met this,
and its client got a ``502 upstream_incomplete`` (or, streamed, a ``200``
whose only event was that error) instead of the 400 it can act on.

The same request unstreamed is refused before any answer starts, with the
engine's own error in OpenAI's shape, the one its non-streamed route sends
(llama_cpp.server's "This model's maximum context length is 2048 tokens,
however you requested 3007 tokens (3002 in your prompt; 5 for the
completion)"). So a stream that ends empty is asked once more, unstreamed,
and a 4xx is the client's answer. Only then: a stream that started costs
nothing more, and an empty stream is never an answer, so nothing is lost by
asking. The copy keeps the client's limit (``max_tokens``) because the
engine's message counts it; were the copy accepted (an engine that ended a
stream empty for another reason), the engine would generate that answer for
nobody: a waste bounded by the limit, on a path that has not been seen to
happen.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import orjson

from llmgw.gateway.engineclient import Upstream
from llmgw.http.upstream import BodyBroken, ConnectFailed, Response, UpstreamTimeout

if TYPE_CHECKING:
    from llmgw.gateway.routing.replica import Replica

log = logging.getLogger(__name__)

# What makes the copy a stream; the rest of the request is sent as it was.
_STREAM_FIELDS = ("stream", "stream_options")


async def why_empty(
    upstream: Upstream, replica: Replica, path: str, payload: dict[str, Any], request_id: str
) -> Response | None:
    """The engine's refusal of ``payload`` unstreamed (a 4xx, unread; the caller releases it).

    None where it gives none: it accepts the copy, fails it with a 5xx (not
    the client's to act on: its stream's own error stands), refuses the
    gateway's engine key (401/403: the routing table's fault) or cannot be
    reached.
    """
    body = {k: v for k, v in payload.items() if k not in _STREAM_FIELDS}
    target = upstream.target(replica.url, path, replica.engine_key)
    try:
        # An id of its own (the engine may still hold the stream's), in the
        # same 32 hex digits: llama_cpp.server answers 400 to any other form.
        response = await upstream.post(target, orjson.dumps(body), os.urandom(16).hex())
    except (ConnectFailed, BodyBroken, UpstreamTimeout) as exc:
        log.info("request %s: its stream on %s ended empty, and asking why failed: %s",
                 request_id, replica.url, exc)  # fmt: skip
        return None
    if 400 <= response.status < 500 and response.status not in (401, 403):
        return response
    log.info("request %s: its stream on %s ended empty; unstreamed, the engine answered %d",
             request_id, replica.url, response.status)  # fmt: skip
    response.release()
    return None
