"""One OpenAI request, from bytes in to bytes out: the front half every /v1 POST route shares.

Order of work is chosen so that the cheap refusals come first (no config, bad
key, body too big) and nothing is parsed twice: the body is parsed once (by
its route), checked against the route's envelope before anything is routed
or woken, the model looked up in a dict built per config version, the key's
limits applied. The route then owns the whole answer
(:mod:`llmgw.gateway.routes`), through :mod:`llmgw.gateway.forward`.

Time spent waiting for an on-demand replica or for the engine is excluded from
the overhead header: it reports what the gateway itself added.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from llmgw.gateway.call import Call
from llmgw.gateway.checks.auth import KeyRecord, authenticate
from llmgw.gateway.checks.validation import check_request
from llmgw.gateway.front import (
    ClientGone,
    Runtime,
    configured_snapshot,
    new_request_id,
    read_body,
    resolve,
)
from llmgw.gateway.replies import REQUEST_ID, ApiError, overhead_header, send_error
from llmgw.gateway.routes.table import Route
from llmgw.gateway.types import Receive, Reply, Scope
from llmgw.http.contract import request_headers

log = logging.getLogger(__name__)

# What a client gets for a failure inside the gateway (sent, never raised).
_FAILED = ApiError(
    500, "The gateway failed to handle this request.", kind="server_error", code="internal_error"
)


async def handle(rt: Runtime, route: Route, scope: Scope, receive: Receive, send: Reply) -> None:
    """Serve one POST to ``route``."""
    started = time.perf_counter()
    request_id = new_request_id()
    id_header = (REQUEST_ID, request_id.encode())
    model = "-"
    record: KeyRecord | None = None
    status = 500
    try:
        snapshot = configured_snapshot(rt)
        settings = rt.settings
        headers = request_headers(scope)
        given = headers.get(b"authorization")
        record = authenticate(snapshot.keys, settings.allow_anonymous, given)
        body = await read_body(receive, settings.max_body_bytes, headers.get(b"content-length"))
        payload = route.parse(scope, body)
        check_request(route.path, payload)  # before anything is routed or woken
        router = resolve(snapshot, record, payload)
        model = router.route.name
        refusal = await rt.tenancy.admit(record)
        if refusal is not None:
            raise refusal.error()
        # A client that leaves cancels this task: the engine's work for it
        # is wasted GPU time.
        send.cancel_if_gone()
        current = rt.snapshot
        rename = current.renames.get(model) if current is not None else None
        call = Call(rt, record, model, started, request_id, id_header, send, rename,
                    rt.metrics.model(model))
        # The route's steps are plain calls returning what to await: this
        # frame waits in forward's own.
        status = await route.serve(call, payload, body, router)
    except ApiError as refused:
        status = refused.status
        overhead = overhead_header(time.perf_counter() - started)
        await send_error(send, refused, [id_header, overhead])
        if record is not None and model != "-":
            rt.usage.add(int(time.time()) // 60 * 60, record.key_id, model, 0, 0, 0, True)
    except ClientGone:
        status = 499  # nginx's "client closed request": nobody to answer
    except asyncio.CancelledError:
        if not send.disconnected:
            raise
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        status = 499
    except Exception:
        log.exception("request %s failed inside the gateway", request_id)
        status = 500
        # If the answer had already started, there is no status left to send.
        with contextlib.suppress(Exception):
            await send_error(send, _FAILED, [id_header])
    rt.metrics.finished(model, status, time.perf_counter() - started)
