"""Quotas and budgets as Prometheus sees them: what each limit is, and how much of it is used.

From the leader's allowance book (llmgw.allowance): a calendar window's use
is the store's count when its ledger opened plus what the gateways reported
since, so it is as fresh as their last reports (a second). A limit nobody
used since the leader took over has no ledger and no series; a standby has
none: the alert rules read ``max by`` across instances.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from llmgw.allowance import AllowanceBook
from llmgw.wire import LimitKind

LABELS = ["tenant", "id", "name", "limit"]


def tenancy_families(book: AllowanceBook | None, names: dict[str, str]) -> Iterator[Metric]:
    """``names``: subject (``key:<id>``, ``team:<id>``) -> the key's or team's name."""
    limit = GaugeMetricFamily(
        "llmgw_tenant_limit",
        "A key's or team's token quota (tokens) or budget (US dollars) over its window.",
        labels=LABELS)
    used = GaugeMetricFamily(
        "llmgw_tenant_used",
        "What the key or team used of that limit in the window now running"
        " (tokens, or dollars at the catalog's prices).", labels=LABELS)
    latest: dict[tuple[str, LimitKind], tuple[int, float, float]] = {}
    for (subject, kind, window), ledger in (book.ledgers.items() if book else ()):
        if ledger.sliding:
            continue
        seen = latest.get((subject, kind))
        if seen is None or window > seen[0]:
            spent = ledger.base + sum(e.used_since_joined() for e in ledger.entries.values())
            latest[(subject, kind)] = (window, ledger.limit, spent)
    for (subject, limit_kind), (_, whole, spent) in sorted(latest.items()):
        tenant, _, ident = subject.partition(":")
        labels = [tenant, ident, names.get(subject, ""), limit_kind]
        limit.add_metric(labels, whole)
        used.add_metric(labels, spent)
    yield limit
    yield used
