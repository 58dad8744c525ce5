"""One request once its key and model are known: what every step of its answer takes.

Built once per request by the front half (:mod:`llmgw.gateway.handler`)
and handed to the route, the forwarding loop and the metering, so that each
step takes the request, not the ten values it was made of.
"""

from __future__ import annotations

from collections.abc import Callable

from llmgw.gateway.checks.auth import KeyRecord
from llmgw.gateway.front import Runtime
from llmgw.gateway.replies import overhead_header
from llmgw.gateway.routing.prefill import Prefill
from llmgw.gateway.types import Reply

_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class Call:
    """What one request's answer is sent and metered with (slots: a few attribute stores)."""

    __slots__ = ("counters", "id_header", "model", "prefill", "record", "rename", "request_id",
                 "rt", "send", "started", "waited")  # fmt: skip

    def __init__(
        self, rt: Runtime, record: KeyRecord, model: str, started: float, request_id: str,
        id_header: tuple[bytes, bytes], send: Reply, rename: Callable[[bytes], bytes] | None,
    ) -> None:  # fmt: skip
        self.rt = rt
        self.record = record
        self.model = model
        self.started = started
        self.request_id = request_id
        self.id_header = id_header
        self.send = send
        # An external model's answers carry the upstream's name for it: this
        # puts back the catalog's (llmgw.gateway.external).
        self.rename = rename
        self.waited = 0.0  # for an on-demand replica: not the gateway's overhead
        self.counters = rt.metrics.model(model)  # its model's metrics, updated in place
        # The last replica's charge: what the answer's usage teaches its router.
        self.prefill: Prefill | None = None

    def stream_headers(self, before: float) -> list[tuple[bytes, bytes]]:
        """A streamed answer's headers; ``before``, the overhead so far, is metered."""
        self.rt.metrics.overhead_hist.observe(before)
        return [*_SSE_HEADERS, self.id_header, overhead_header(before)]
