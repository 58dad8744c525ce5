"""The control plane's Prometheus metrics: what it did, and the fleet as the summary sees it.

Two kinds of families. Counters and histograms of the control plane's own
work (reconcile passes, placements and removals, agent reports, store
writes) are plain numbers updated where the work happens (counters.py)
and turned into families here, only when scraped. Fleet gauges (nodes, devices,
replicas, models) are not kept at all: each scrape folds the same views the
summary folds (``fleet_summary``), so a dashboard and ``GET
/admin/v1/summary`` can never show two different fleets. That fold is the
summary's, memoised per node and replica (adminapi/views/memo.py): about
20 ms at 2,000 nodes on this project's machines (docs/metrics.md has the
measurement), paid once per scrape rather than on every report.

A standby serves the same families from its refreshed views, with
``llmgw_control_leader`` 0: queries over several instances should select
the leader (``llmgw_control_leader == 1``) or use ``max``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from llmgw.control.adminapi.patroni import (
    PatroniReader,
    StoreStatus,
    patroni_urls_from_env,
)
from llmgw.control.adminapi.summary import Summary, fleet_summary
from llmgw.control.adminapi.views.models import ModelView
from llmgw.control.counters import ControlMetrics
from llmgw.control.gcpause import paused_gc
from llmgw.control.store.stats import WriteStats
from llmgw.control.tenancymetrics import tenancy_families
from llmgw.promkit import filled

if TYPE_CHECKING:
    from llmgw.control.plane import ControlPlane


def control_registry(cp: ControlPlane) -> CollectorRegistry:
    """A registry holding only the control plane's families (its own /metrics)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ControlCollector(cp))
    return registry


class ControlCollector(Collector):
    """Turns the control plane's counters and the fleet's views into families at scrape time.

    Registered in the gateway's registry by ``llmgw up`` and ``serve``, so
    their one /metrics carries both parts' families.
    """

    def __init__(self, cp: ControlPlane, patroni: PatroniReader | None = None) -> None:
        self._cp = cp
        self._patroni = patroni or PatroniReader(patroni_urls_from_env())

    def collect(self) -> Iterator[Metric]:
        cp = self._cp
        yield from _work_families(cp.metrics)
        yield from _store_families(cp.store.write_stats)
        yield GaugeMetricFamily(
            "llmgw_control_leader",
            "1 on the instance that leads (reconciles and takes writes), 0 on a standby.",
            value=1 if cp.is_leader else 0,
        )
        yield GaugeMetricFamily(
            "llmgw_control_leader_epoch",
            "The leader epoch this instance knows; it grows by one at every takeover.",
            value=cp.epoch,
        )
        yield from fleet_families(cp)
        yield from store_member_families(self._patroni.cached())
        names = {f"key:{k.key_id}": k.name for k in cp.keys.all()}
        names.update({f"team:{t.team_id}": t.name for t in cp.teams.all()})
        yield from tenancy_families(cp.allowances.current_book, names)


def _work_families(m: ControlMetrics) -> Iterator[Metric]:
    yield m.pass_seconds.family(
        "llmgw_control_reconcile_pass_seconds",
        "Time of one reconcile pass (reachability, decisions, store write, nudges).",
    )
    yield _counter("llmgw_control_reconcile_passes", "outcome", m.passes,
                   "Reconcile passes by outcome: ok, error (retried on the next tick),"
                   " stale_epoch (another instance leads; this one steps down).")
    if m.last_pass_at is not None:
        yield GaugeMetricFamily(
            "llmgw_control_last_reconcile_timestamp_seconds",
            "When the last reconcile pass ended (Unix time); stands still when the loop does.",
            value=m.last_pass_at,
        )
    yield _counter("llmgw_control_replicas_placed", "reason", m.placed,
                   "Replicas placed by the reconciler, by reason: short (the model had fewer"
                   " than it should) or move (make-before-break off a draining or lost node).")
    yield _counter("llmgw_control_replicas_removed", "reason", m.removed,
                   "Replicas removed by the reconciler, by reason: failed, replaced,"
                   " scaled-down, unloaded, evicted, drained, orphaned.")
    yield _counter("llmgw_control_agent_reports", "outcome", m.reports,
                   "Agent reports answered, by outcome: accepted, unauthorized, wrong_node,"
                   " invalid, unavailable (standby or store), error.")
    yield _counter("llmgw_control_agent_report_reads", "path", m.report_reads,
                   "Agent reports taken in, by how they were read: same_bytes (the node's"
                   " last report again), telemetry (the last report with new device"
                   " readings, validated alone) or validated (the whole report).")


def _store_families(stats: WriteStats) -> Iterator[Metric]:
    yield stats.seconds.family(
        "llmgw_control_store_write_seconds",
        "Time of one committed store write transaction, lock wait included.",
    )
    yield _counter("llmgw_control_store_write_errors", "kind", stats.errors,
                   "Store writes that failed, by kind: error (the database refused or was"
                   " away), stale_epoch (fenced out: another instance leads).")


def _counter(name: str, label: str, values: Mapping[str, int], documentation: str) -> Metric:
    """A counter family with one sample per label value."""
    return filled(CounterMetricFamily(name, documentation, labels=[label]), values)


# -- the fleet, from the summary's own fold ---------------------------------------------


NODE_STATES = ("ready", "cordoned", "draining", "unreachable")
REPLICA_STATES = ("ready", "starting", "draining", "failed", "unreachable")
MODEL_OTHER_STATES = ("starting", "draining", "failed")


def fleet_families(cp: ControlPlane, now: float | None = None) -> list[Metric]:
    """The fleet gauges: the summary's figures, and per model what it folded."""
    models: list[ModelView] = []
    with paused_gc():  # see paused_gc: thousands of short-lived views
        summary = fleet_summary(cp.state, time.time() if now is None else now,
                                StoreStatus(members=[]), on_model=models.append)
        out = _summary_families(summary)
        out.extend(_model_families(models))
        models.clear()
    return out


def _summary_families(s: Summary) -> list[Metric]:
    nodes = GaugeMetricFamily("llmgw_fleet_nodes", "Nodes by state.", labels=["state"])
    for state in NODE_STATES:
        nodes.add_metric([state], getattr(s.nodes, state))
    devices = GaugeMetricFamily(
        "llmgw_fleet_devices",
        "Placeable devices (cards, MIG instances, CPU slots) by class and state:"
        " used, free, unhealthy (neither used nor free).",
        labels=["class", "state"],
    )
    for use in s.gpus:
        devices.add_metric([use.gpu_class, "used"], use.used)
        devices.add_metric([use.gpu_class, "free"], use.free)
        devices.add_metric([use.gpu_class, "unhealthy"], use.unhealthy)
    replicas = GaugeMetricFamily("llmgw_fleet_replicas", "Replicas by state.", labels=["state"])
    for state in REPLICA_STATES:
        replicas.add_metric([state], getattr(s.replicas, state))
    models = GaugeMetricFamily(
        "llmgw_fleet_models",
        "Models by status: satisfied (ready >= desired, not parked) or short.",
        labels=["status"],
    )
    models.add_metric(["satisfied"], s.models.satisfied)
    models.add_metric(["short"], s.models.short)
    return [
        nodes, devices, replicas, models,
        GaugeMetricFamily("llmgw_fleet_models_unplaceable",
                          "Short models the scheduler cannot place (the summary's unplaceable).",
                          value=len(s.unplaceable)),
        GaugeMetricFamily("llmgw_fleet_models_parked",
                          "Models no longer retried after failing every start.",
                          value=len(s.parked)),
        GaugeMetricFamily("llmgw_fleet_idle_replicas",
                          "Ready replicas nothing asked for in 10 minutes or more.",
                          value=len(s.idle_replicas)),
    ]  # fmt: skip


def _model_families(models: list[ModelView]) -> list[Metric]:
    """Per model, what a person acts on; flags and zero counts only where they hold.

    A catalog of 1,000 models with every flag and state written out was
    9,000 series and ~50 ms of text per scrape, on the loop the gateway
    shares in ``llmgw up``; written only where true it is about 2 per
    model. An absent flag reads as 0 (``llmgw_model_short == 1`` for an
    alert, ``count(...)`` for a panel).
    """
    desired = GaugeMetricFamily(
        "llmgw_model_replicas_desired", "Replicas the model should have now.", labels=["model"]
    )
    replicas = GaugeMetricFamily(
        "llmgw_model_replicas", "The model's replicas by state (ready always, other states"
        " only when there are some).", labels=["model", "state"])  # fmt: skip
    short = GaugeMetricFamily(
        "llmgw_model_short", "1 for a model with fewer ready replicas than it should have, or"
        " parked (the summary's short); absent otherwise.", labels=["model"])  # fmt: skip
    unplaceable = GaugeMetricFamily(
        "llmgw_model_unplaceable", "1 for a short model the scheduler cannot place (the"
        " summary's unplaceable); absent otherwise.", labels=["model"])  # fmt: skip
    parked = GaugeMetricFamily(
        "llmgw_model_parked", "1 for a parked model; absent otherwise.", labels=["model"]
    )
    failures = GaugeMetricFamily(
        "llmgw_model_consecutive_failures",
        "Failed starts in a row (the model parks at the limit); absent when none.",
        labels=["model"],
    )
    for m in models:
        name = [m.name]
        desired.add_metric(name, m.desired)
        replicas.add_metric([m.name, "ready"], m.ready)
        for state in MODEL_OTHER_STATES:
            count = getattr(m, state)
            if count:
                replicas.add_metric([m.name, state], count)
        # The summary's rule (SummaryBuilder.add_model); tests pin the sums together.
        if m.parked or m.ready < m.desired:
            short.add_metric(name, 1)
            if m.unplaceable or (m.total <= m.ready and not m.parked):
                unplaceable.add_metric(name, 1)
        if m.parked:
            parked.add_metric(name, 1)
        if m.failures:
            failures.add_metric(name, m.failures)
    return [desired, replicas, short, unplaceable, parked, failures]


def store_member_families(status: StoreStatus | None) -> list[Metric]:
    """The replicated store's members, as Patroni last reported them (none for one database).

    Read in the background (PatroniReader.cached): the first scrape after a
    start may come before the first answer and shows none of these.
    """
    if status is None:
        return []
    members = GaugeMetricFamily(
        "llmgw_store_members", "1 per member of the replicated store, with its role and state.",
        labels=["member", "role", "state"])  # fmt: skip
    lag = GaugeMetricFamily(
        "llmgw_store_member_lag_bytes", "Bytes a member is behind the leader (0 for the"
        " leader); absent while Patroni does not know.", labels=["member"])  # fmt: skip
    for member in status.members:
        members.add_metric([member.name, member.role, member.state], 1)
        if member.lag >= 0:
            lag.add_metric([member.name], member.lag)
    error = GaugeMetricFamily(
        "llmgw_store_members_unreadable",
        "1 when Patroni is configured (LLMGW_PATRONI_URL) but could not be read.",
        value=1 if status.error else 0)  # fmt: skip
    return [members, lag, error]
