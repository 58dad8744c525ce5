"""External models (``ModelSpec.external``): their endpoints, and their health as gateways see it.

An external model names servers llmgw does not run. The control plane puts
one endpoint per URL in the routing table and places nothing; the gateways
probe the URLs themselves (llmgw.gateway.health) and report what they see
with their load. Why the gateways and not the control plane: a URL is worth
routing to only if the process that sends the requests can reach it (a
hosted API may be reachable from the gateways' network and not from the
control plane's), the gateway already holds the key the probe must send
(the control plane never does), and a dead URL leaves routing as soon as the
gateway sees it, without a round trip through the control plane.

Reports are kept per gateway, in memory only (re-learnt within a report
interval after a restart), and read as: up when any gateway that reported
recently reached it, down when every such gateway failed to, unknown when
none did (no gateway runs, or none has probed it yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llmgw.wire import Endpoint, EngineDialect, ModelSpec

# Reports older than this are ignored: a gateway that stopped (or lost the
# control plane) must not pin a URL up or down. Many report intervals (1 s).
STALE_AFTER_S = 30.0

UrlState = Literal["up", "down", "unknown"]


def endpoint_id(model: str, url: str) -> str:
    """The replica id of one URL of an external model, the same in every process.

    Stable across catalog edits that keep the URL, so a gateway keeps the
    URL's prefix index, load and health when another URL is added.
    """
    return f"external:{model}:{url}"


def endpoints(spec: ModelSpec) -> list[Endpoint]:
    """One routing-table endpoint per URL of an external model."""
    external = spec.external
    if external is None:
        return []
    # An upstream that declares nothing speaks OpenAI: streams are asked for
    # include_usage and the usage is read from them (not the legacy guess).
    dialect = external.dialect or EngineDialect()
    return [
        Endpoint(
            replica_id=endpoint_id(spec.name, url),
            url=url.rstrip("/"),
            kv_capacity_tokens=spec.kv_capacity_tokens,
            dialect=dialect,
            external=True,
            api_key_env=external.api_key_env,
        )
        for url in external.urls
    ]


def index(specs: list[ModelSpec]) -> dict[str, tuple[str, str]]:
    """Endpoint id -> (model, URL), for reading the gateways' reports."""
    return {
        endpoint_id(spec.name, url): (spec.name, url)
        for spec in specs
        if spec.external is not None
        for url in spec.external.urls
    }


@dataclass(frozen=True, slots=True)
class Probe:
    """One gateway's last word on one URL."""

    up: bool
    reason: str | None
    at: float


# url -> gateway id -> its last report (ModelRecord.endpoint_health).
HealthReports = dict[str, dict[str, Probe]]


def record(reports: HealthReports, url: str, gateway: str, probe: Probe) -> None:
    reports.setdefault(url, {})[gateway] = probe


def url_state(
    reports: HealthReports, url: str, now: float
) -> tuple[UrlState, str | None, float | None]:
    """(state, why it is down, when it was last checked) of one URL over fresh reports."""
    fresh = [p for p in reports.get(url, {}).values() if now - p.at <= STALE_AFTER_S]
    if not fresh:
        return "unknown", None, None
    checked = max(p.at for p in fresh)
    if any(p.up for p in fresh):
        return "up", None, checked
    latest = max(fresh, key=lambda p: p.at)
    down = sum(1 for p in fresh if not p.up)
    reason = latest.reason or "unreachable"
    if down > 1:
        reason = f"{reason} (from {down} gateways)"
    return "down", reason, checked
