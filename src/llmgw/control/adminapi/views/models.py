"""Model views: replica counts taken from the replica views, and what each should have."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from llmgw.control.adminapi.views.replicas import UNREACHABLE, ReplicaView
from llmgw.control.external import UrlState, url_state
from llmgw.control.scheduler.demand import asked_for, desired_given
from llmgw.control.secretenv import redacted
from llmgw.control.state import FleetState, ModelRecord
from llmgw.wire import ExternalSpec, ModelSpec, ReplicaState


@dataclass(slots=True)
class ExternalUrlView:
    """One URL of an external model, as the gateways' probes see it (control.external)."""

    url: str
    state: UrlState  # up, down, or unknown (no gateway has reported on it lately)
    reason: str | None
    checked_at: float | None


@dataclass(slots=True)
class ModelView:
    name: str
    spec: ModelSpec
    on_demand: bool
    min_replicas: int
    max_replicas: int
    # What it should have now: clamp(min, demand, max); see desired_now.
    desired: int
    # Asked for within its idle timeout (on-demand models).
    demanded: bool
    load_demand: int
    ready: int
    starting: int
    draining: int
    failed: int
    # Replicas serving or on their way to it: ready + starting.
    total: int
    parked: bool
    failures: int
    last_error: str | None
    # The one line to show: why parked, why unplaceable, or the last error.
    reason: str | None
    # The scheduler could not place what it is short of, on its last pass. A
    # parked model is not placed at all, so the pass after parking clears it.
    unplaceable: bool
    unplaceable_reason: str | None
    # An external model's URLs (None for a model llmgw runs). Its counts are
    # of URLs: desired all of them, ready those up, starting those unknown.
    external: list[ExternalUrlView] | None = None
    # A LoRA adapter's base model, and on how many of the base's replicas it
    # is loaded now (its own replica counts stay 0: it has none).
    base: str | None = None
    loaded_on: int = 0


# -- desired replicas -----------------------------------------------------------


def desired_now(model: ModelRecord, now: float, last_used: float | None = None) -> int:
    """clamp(min, demand, max): what the model should have now.

    Against this, not the minimum: an on-demand model's minimum is 0, so one
    that was asked for and fits nowhere would otherwise count as satisfied.
    The rule is the scheduler's (scheduler/demand.py), so that the summary's
    "short" is what the reconciler is working on; a test pins the two
    together. An on-demand model is in demand when asked for within its idle
    timeout, or while one of its live replicas was used (or started) within
    it (``last_used``: ReplicaTally.last_used); load demand is extra on top.
    """
    in_use = last_used is not None and now - last_used < model.spec.idle_timeout_s
    return desired_given(model, now, in_use=in_use)


# -- replica counts ---------------------------------------------------------------


class ReplicaTally:
    """Replicas per model and state, counted from replica views.

    Model views take their counts from here, so a model's ``ready`` is the
    number of ready replicas the replica listing shows for it.
    """

    __slots__ = ("_adapters", "_counts", "_last_used")

    def __init__(self, replicas: Iterable[ReplicaView] = ()) -> None:
        self._counts: dict[str, dict[str, int]] = {}
        self._last_used: dict[str, float] = {}
        # Adapter -> replicas with it loaded (detail views carry adapters).
        self._adapters: dict[str, int] = {}
        for replica in replicas:
            self.add(replica)

    def add(self, replica: ReplicaView) -> None:
        model, state = replica.model, replica.state
        per_state = self._counts.get(model)
        if per_state is None:
            per_state = self._counts[model] = {}
        per_state[state] = per_state.get(state, 0) + 1
        for name in replica.adapters:
            self._adapters[name] = self._adapters.get(name, 0) + 1
        if state in _LIVE and not replica.draining:
            # When it was last used, started or became ready; busy is now.
            latest = math.inf if replica.in_flight > 0 else max(
                replica.last_request_at or 0.0, replica.ready_at or 0.0, replica.created_at
            )
            if latest > self._last_used.get(model, -math.inf):
                self._last_used[model] = latest

    def of(self, model: str) -> dict[str, int]:
        return self._counts.get(model, {})

    def last_used(self, model: str) -> float | None:
        return self._last_used.get(model)

    def loaded_on(self, adapter: str) -> int:
        return self._adapters.get(adapter, 0)


# Unreachable ones too: the scheduler still counts them (it replaces them).
_LIVE = frozenset({ReplicaState.READY.value, ReplicaState.STARTING.value, UNREACHABLE})


# -- models -----------------------------------------------------------------------


def model_view(model: ModelRecord, tally: ReplicaTally, now: float) -> ModelView:
    """One model, its replica counts taken from the replica views (``tally``)."""
    if model.spec.external is not None:
        return external_model_view(model, model.spec.external, now)
    counts = tally.of(model.name)
    ready = counts.get(ReplicaState.READY.value, 0)
    starting = counts.get(ReplicaState.STARTING.value, 0)
    # The scheduler's word as it stands, parked or not: the summary applies
    # the reference's rule to it (summary.SummaryBuilder.add_model).
    unplaceable = model.unplaceable_reason is not None
    if model.parked:
        reason = model.last_error
    elif unplaceable:
        reason = model.unplaceable_reason
    else:
        reason = model.last_error
    spec = model.spec
    return ModelView(
        name=model.name,
        spec=redacted(spec),
        on_demand=spec.on_demand,
        min_replicas=spec.min_replicas,
        max_replicas=spec.max_replicas,
        desired=desired_now(model, now, tally.last_used(model.name)),
        demanded=asked_for(model, now),
        load_demand=model.load_demand,
        ready=ready,
        starting=starting,
        draining=counts.get(ReplicaState.DRAINING.value, 0),
        failed=counts.get(ReplicaState.FAILED.value, 0),
        total=ready + starting,
        parked=model.parked,
        failures=model.failures,
        last_error=model.last_error,
        reason=reason,
        unplaceable=unplaceable,
        unplaceable_reason=model.unplaceable_reason if unplaceable else None,
        base=spec.base,
        loaded_on=tally.loaded_on(model.name) if spec.base is not None else 0,
    )


def external_model_view(model: ModelRecord, external: ExternalSpec, now: float) -> ModelView:
    """An external model: each URL stands for a replica, up or down as the gateways see it.

    So the summary's rule holds unchanged: short while any URL is down or
    not yet checked, and the reason names the first URL that is down.
    """
    spec = model.spec
    urls: list[ExternalUrlView] = []
    for url in external.urls:
        state, why, checked = url_state(model.endpoint_health, url, now)
        urls.append(ExternalUrlView(url=url, state=state, reason=why, checked_at=checked))
    ready = sum(1 for u in urls if u.state == "up")
    unknown = sum(1 for u in urls if u.state == "unknown")
    down = next((u for u in urls if u.state == "down"), None)
    return ModelView(
        name=model.name, spec=redacted(spec), on_demand=False,
        min_replicas=spec.min_replicas, max_replicas=spec.max_replicas,
        desired=len(urls), demanded=False, load_demand=0,
        ready=ready, starting=unknown, draining=0, failed=0, total=ready + unknown,
        parked=False, failures=0, last_error=None,
        reason=f"{down.url} is down: {down.reason}" if down is not None else None,
        unplaceable=False, unplaceable_reason=None, external=urls,
    )  # fmt: skip


def iter_model_views(state: FleetState, now: float, tally: ReplicaTally) -> Iterator[ModelView]:
    models = state.models
    for name in sorted(models):
        yield model_view(models[name], tally, now)
