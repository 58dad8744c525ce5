"""The gateway's link to a control plane in the same process.

``llmgw up`` and ``llmgw serve`` run the gateway beside the control plane;
this object gives it the same four calls the HTTP link makes
(llmgw.gateway.link.ControlPlaneLink), without a round trip through HTTP.

On a standby ``llmgw serve`` the gateway routes from the standby's views
(refreshed every few seconds) and records usage in the store, which any
instance may add to; demand is refused (the gateway logs it, and the request
waits, then gets 503), and load reports are dropped: both are the leader's
to act on, and this process holds no credential to forward them with. Hence
docs/install.md: send /v1 traffic to the leader (GET /healthz/leader).
"""

from __future__ import annotations

from llmgw.control.plane import ControlPlane
from llmgw.wire import (
    AllowanceAnswer,
    AllowanceReport,
    GatewayConfig,
    GatewayLoadReport,
    UsageRecord,
)


class InProcessLink:
    def __init__(self, cp: ControlPlane, *, watch_timeout_s: float = 25.0) -> None:
        self.cp = cp
        self.watch_timeout_s = watch_timeout_s

    async def watch_config(self, after_version: int) -> GatewayConfig:
        return await self.cp.gateways.watch(after_version, wait_s=self.watch_timeout_s)

    async def demand(self, model: str) -> None:
        await self.cp.catalog.demand(model)

    async def report_load(self, report: GatewayLoadReport) -> None:
        if not self.cp.is_leader:
            return  # see the module's docstring; a warning a second would be noise
        await self.cp.gateways.record_load(report)

    async def report_usage(self, records: list[UsageRecord]) -> None:
        await self.cp.gateways.record_usage(records)

    async def exchange_allowance(self, report: AllowanceReport) -> AllowanceAnswer:
        # A standby lends nothing (StandbyError): the gateway keeps its last
        # shares, as it would with the leader out of reach.
        return await self.cp.allowances.exchange(report)
