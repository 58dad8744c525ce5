"""Choosing a replica and trying it, for every /v1 POST route: one loop.

Routes (:mod:`llmgw.gateway.routes`) differ in the body they send and in
how they answer (each request's :class:`Attempt`); what a replica is owed
does not, and lives here once: waiting for an on-demand model, a retry
elsewhere while nothing has reached the client, the replica's cool-down
after it failed, its in-flight count and pending prefill. Nothing here
reads an answer: the attempt does, and meters it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Sequence
from typing import Protocol

from llmgw.gateway.admission import Held
from llmgw.gateway.call import Call
from llmgw.gateway.checks.auth import KeyRecord
from llmgw.gateway.front import Runtime
from llmgw.gateway.replies import (
    ApiError,
    unavailable,
)
from llmgw.gateway.routing.policy import Pick
from llmgw.gateway.routing.prefill import Prefill
from llmgw.gateway.routing.replica import Replica
from llmgw.gateway.routing.router import ModelRouter
from llmgw.gateway.routing.turns import Turns
from llmgw.http.upstream import BodyBroken, ConnectFailed, Response, UpstreamTimeout

log = logging.getLogger(__name__)


class Attempt(Protocol):
    """What one request sends a replica, and how it answers the client with the reply."""

    def reroute(self, router: ModelRouter, replica: Replica) -> ModelRouter | None:
        """After a wait: the router to pick from again when ``replica`` cannot take the route."""
        ...

    def post(self, router: ModelRouter, replica: Replica) -> Awaitable[Response]:
        """The request sent to ``replica``: its answer's start, to await.

        Best not a coroutine of its own (return the upstream client's): each
        level of coroutines a request waits in is resumed at every wake-up.
        """
        ...

    def answer(
        self, response: Response, replica: Replica, prefill: Prefill, before: float
    ) -> Awaitable[int]:
        """Answer the client (the status sent); may raise BodyBroken before anything was sent."""
        ...


async def forward(
    call: Call, router: ModelRouter, prompt: str | None, attempt: Attempt,
    tokens: Sequence[int] | None = None,
) -> int:  # fmt: skip
    """Send the request to replicas of the model until one answers; the status sent.

    ``tokens``: the prompt's, where replicas publish their caches (gateway.kvtokens).
    """
    rt = call.rt
    settings = rt.settings
    counters = call.counters
    model = call.model
    tried: list[Replica] = []
    wait_deadline = time.monotonic() + settings.queue_wait_s
    attempts = 0
    held: Held | None = None
    try:
        while attempts <= settings.retries:
            # A replica to offer at once is the usual case: picked here,
            # without the coroutine that waits for one (a frame every request
            # paid for).
            on_demand = router.route.on_demand
            exclude = tried if held is None else held.passed_over(router.replicas, tried)
            pick = router.pick(prompt, exclude, fallback=not on_demand, tokens=tokens)
            wait = 0.0
            if pick is None and not (tried and not on_demand):
                router, pick, wait = await wait_for_replica(
                    rt, router, prompt, tried, wait_deadline
                )
                call.waited += wait
            if pick is None:
                break
            if held is None and router.route.max_concurrency is not None:
                # A model whose replicas take a known number of requests at
                # once: wait for a slot in its hold queue, then pick again
                # (loads moved meanwhile).
                held = await _hold(rt, call.record, router)
                call.waited += held.waited
                if held.waited or pick.replica.in_flight >= held.slots:
                    router = _fresh(rt, router)
                    continue
            # After a wait the retries start again: what failed before it is
            # gone or back, and the wait itself is bounded by its deadline.
            attempts = 1 if wait else attempts + 1
            replica = pick.replica
            if wait:
                other = attempt.reroute(router, replica)
                if other is not None:
                    router = other
                    continue
            if not tried:
                outcomes = counters.outcomes
                outcomes[pick.outcome] = outcomes.get(pick.outcome, 0) + 1
            replica.in_flight += 1
            replica.requests += 1
            replica.last_request_at = time.time()
            prefill = call.prefill = Prefill(router, pick)
            counters.in_flight += 1
            response: Response | None = None
            turns: Turns | None = None
            try:
                if replica.serial:
                    # Its engine computes one request at a time: this
                    # gateway sends it one, cheapest first (routing/turns.py).
                    call.waited += await replica.turns.take(pick.uncached_tokens, pick)
                    turns = replica.turns
                    prefill.turn_taken()
                before = time.perf_counter() - call.started - call.waited
                response = await attempt.post(router, replica)
                if response.status in (401, 403):
                    # The engine refused the gateway's engine key (a routing
                    # table older than the engine): no fault of the client's
                    # key, and another replica may take the request, as if
                    # unreachable.
                    raise ConnectFailed(f"engine refused the engine key ({response.status})")
                replica.connect_succeeded()
                return await attempt.answer(response, replica, prefill, before)
            except (ConnectFailed, BodyBroken) as exc:
                # Nothing reached the client yet: another replica may answer.
                log.info("%s: replica %s unavailable: %s", call.request_id, replica.replica_id, exc)
                replica.connect_failed(settings.cooldown_after, settings.cooldown_s)
                tried.append(replica)
                counters.retries += 1
            except UpstreamTimeout:
                raise ApiError(
                    504,
                    f"The model `{model}` did not answer within {settings.upstream_timeout_s} s.",
                    kind="server_error", code="upstream_timeout",
                ) from None  # fmt: skip
            finally:
                # Released twice where a relay took it: the second time is a no-op.
                if response is not None:
                    response.release()
                if turns is not None:
                    turns.release()
                replica.in_flight -= 1
                prefill.done()
                counters.in_flight -= 1
    finally:
        if held is not None:
            held.release()
    raise unavailable(
        f"No replica of the model `{model}` could be reached.",
        "upstream_unavailable",
        settings.retry_after_s,
    )


def _hold(rt: Runtime, record: KeyRecord, router: ModelRouter) -> Awaitable[Held]:
    """A slot in the model's hold queue (llmgw.gateway.admission), when its turn comes."""
    route = router.route
    assert route.max_concurrency is not None  # the caller's test
    snapshot = rt.snapshot
    gateways = snapshot.config.routing.gateways if snapshot is not None else 1
    return rt.admission.hold(record, route.name, route.max_concurrency, router.replicas,
                             gateways, router)  # fmt: skip


def _fresh(rt: Runtime, router: ModelRouter) -> ModelRouter:
    """The model's router in the config now (a request that waited may hold an old one)."""
    snapshot = rt.snapshot
    fresh = snapshot.routes.get(router.route.name) if snapshot is not None else None
    return fresh if fresh is not None and fresh.replicas else router


async def wait_for_replica(
    rt: Runtime, router: ModelRouter, prompt: str | None, tried: list[Replica], deadline: float
) -> tuple[ModelRouter, Pick, float]:
    """A pick after waiting for a replica, the model having none to offer (and the time waited).

    Any model waits while it has no replica at all. An on-demand model also
    waits while every replica it has is cooling down or failed this request:
    that is how its requests ride out the loss of its only replica's node,
    until the control plane's replacement arrives (or the cooled replica
    answers again), instead of failing with 503 meanwhile. ``deadline``
    (time.monotonic()) is the request's, however many times it waits.
    """
    on_demand = router.route.on_demand
    name = router.route.name
    if router.route.parked:
        raise unavailable(
            f"The model `{name}` cannot be started: {router.route.parked_reason or 'parked'}.",
            "model_parked",
            rt.settings.retry_after_s * 12,
        )
    if rt.room.full(name):
        raise ApiError(
            429,
            f"Too many requests are waiting for the model `{name}` to start.",
            kind="requests",
            code="rate_limit_exceeded",
            retry_after=rt.settings.retry_after_s,
        )
    began = time.monotonic()
    if rt.room.enter(name):
        rt.demand(name)
    try:
        while True:
            # Woken by a config that serves the model, or when a cooled (or
            # just failed) replica may be tried again: it may only have restarted.
            wake_at = min(deadline, router.cooling_ends() or deadline)
            if tried:
                wake_at = min(wake_at, time.monotonic() + rt.settings.cooldown_s)
            await rt.room.wait(name, wake_at)
            snapshot = rt.snapshot
            fresh = snapshot.routes.get(name) if snapshot is not None else None
            if fresh is not None:
                router = fresh
                pick = router.pick(prompt, fallback=not on_demand)
                if pick is not None:
                    return router, pick, time.monotonic() - began
            if time.monotonic() >= deadline:
                raise unavailable(
                    f"The model `{name}` is starting and was not ready in time.",
                    "model_not_ready",
                    rt.settings.retry_after_s,
                )
    finally:
        rt.room.leave(name)
