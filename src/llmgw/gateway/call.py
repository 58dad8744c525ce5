"""One request once its key and model are known: what every step of its answer takes.

Built once per request by the front half (:mod:`llmgw.gateway.handler`)
and handed to the route, the forwarding loop and the metering, so that each
step takes the request, not the ten values it was made of.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llmgw.gateway.checks.auth import KeyRecord
from llmgw.gateway.front import Runtime
from llmgw.gateway.metrics import ModelCounters
from llmgw.gateway.replies import overhead_header
from llmgw.gateway.routing.prefill import Prefill
from llmgw.gateway.types import Reply

_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


@dataclass(slots=True, eq=False)
class Call:
    """What one request's answer is sent and metered with (slots: a few attribute stores)."""

    rt: Runtime
    record: KeyRecord
    model: str
    started: float
    request_id: str
    id_header: tuple[bytes, bytes]
    send: Reply
    # An external model's answers carry the upstream's name for it: this
    # puts back the catalog's (llmgw.gateway.external).
    rename: Callable[[bytes], bytes] | None
    counters: ModelCounters  # its model's metrics (rt.metrics.model), updated in place
    waited: float = 0.0  # for an on-demand replica: not the gateway's overhead
    # The last replica's charge: what the answer's usage teaches its router.
    prefill: Prefill | None = None

    def stream_headers(self, before: float) -> list[tuple[bytes, bytes]]:
        """A streamed answer's headers; ``before``, the overhead so far, is metered."""
        self.rt.metrics.overhead_hist.observe(before)
        return [*_SSE_HEADERS, self.id_header, overhead_header(before)]
