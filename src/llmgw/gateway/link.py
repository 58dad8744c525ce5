"""The gateway's only way to the control plane: four calls behind one Protocol.

``llmgw up``/``llmgw serve`` pass an in-process object; a standalone gateway
uses :class:`HttpControlPlaneLink` (the fixed protocol in the brief). Tests use
:class:`MemoryLink`. The gateway treats every failure of a link call the same
way: keep the last config, keep serving, try again later.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol

import aiohttp
import orjson

from llmgw import wire
from llmgw.allowance import AllowanceBook
from llmgw.cpclient import ControlPlaneCaller, NewerAnswers
from llmgw.errors import ControlPlaneUnavailable
from llmgw.failover import LeaderFinder
from llmgw.tls import ClientTrust

CONFIG_PATH = "/gateway/v1/config"
LOAD_PATH = "/gateway/v1/load"
DEMAND_PATH = "/gateway/v1/demand"
USAGE_PATH = "/gateway/v1/usage"
ALLOWANCE_PATH = "/gateway/v1/allowance"

log = logging.getLogger("llmgw.gateway.link")


class ControlPlaneLink(Protocol):
    async def watch_config(self, after_version: int) -> wire.GatewayConfig:
        """The config once its routing version is > ``after_version``, or the current one
        after the control plane's long-poll timeout."""
        ...

    async def demand(self, model: str) -> None: ...

    async def report_load(self, report: wire.GatewayLoadReport) -> None: ...

    async def report_usage(self, records: list[wire.UsageRecord]) -> None: ...

    async def exchange_allowance(self, report: wire.AllowanceReport) -> wire.AllowanceAnswer:
        """This worker's use of every limit it enforces, for its shares of them
        (llmgw.allowance)."""
        ...


class HttpControlPlaneLink:
    """The standalone gateway's link: long-poll for config, POSTs for the rest.

    The long poll is answered by the control plane after ~25 s at most; the
    client allows ``poll_timeout_s`` beyond that so a slow answer is not taken
    for an outage.

    Given several control-plane instances (a list, or comma-separated), every
    call goes to the leader among them (llmgw.failover).
    """

    def __init__(
        self,
        base_url: str | Sequence[str],
        token: str,
        *,
        poll_timeout_s: float = 40.0,
        request_timeout_s: float = 10.0,
        trust: ClientTrust | None = None,
    ) -> None:
        # Verifies an https:// control plane against the fleet's CA (llmgw.tls).
        self.caller = ControlPlaneCaller(base_url, trust=trust or ClientTrust())
        self._headers = {"Authorization": f"Bearer {token}"}
        self._poll_timeout = aiohttp.ClientTimeout(total=poll_timeout_s, connect=request_timeout_s)
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        # The instance whose routing version the gateway holds. Versions are
        # one instance's counter (a new leader, or a restarted one, counts
        # from its own start): elsewhere the gateway's version means nothing,
        # and asking for "newer than" it could wait out a whole long poll.
        self._versions_from: str | None = None
        # Fields of a config this gateway does not know are said once per set:
        # the control plane is upgraded first, so they are expected for a
        # while, and the config comes on every change.
        self._newer = NewerAnswers(log, "gateway")

    @property
    def leader(self) -> LeaderFinder:
        """The configured instances and the one calls go to now."""
        return self.caller.leader

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self._headers)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def watch_config(self, after_version: int) -> wire.GatewayConfig:
        def query(url: str) -> dict[str, int | str]:
            return {"after": after_version if url == self._versions_from else -1}

        try:
            url, body = await self._call("GET", CONFIG_PATH, None, self._poll_timeout, query)
        except ControlPlaneUnavailable:
            self._versions_from = None  # it may come back restarted
            raise
        config = self._newer.read(wire.GatewayConfig, body, f"GET {url}{CONFIG_PATH}")
        self._versions_from = url
        return config

    async def demand(self, model: str) -> None:
        payload = wire.DemandRequest(model=model).model_dump_json().encode()
        await self._call("POST", DEMAND_PATH, payload, self._timeout)

    async def report_load(self, report: wire.GatewayLoadReport) -> None:
        payload = report.model_dump_json().encode()
        await self._call("POST", LOAD_PATH, payload, self._timeout)

    async def report_usage(self, records: list[wire.UsageRecord]) -> None:
        payload = orjson.dumps([r.model_dump() for r in records])
        await self._call("POST", USAGE_PATH, payload, self._timeout)

    async def exchange_allowance(self, report: wire.AllowanceReport) -> wire.AllowanceAnswer:
        _, body = await self._call("POST", ALLOWANCE_PATH, report.model_dump_json().encode(),
                                   self._timeout)
        answer, _ = wire.read_from_newer(wire.AllowanceAnswer, body)
        return answer

    async def _call(
        self,
        method: str,
        path: str,
        payload: bytes | None,
        limits: aiohttp.ClientTimeout,
        params: Callable[[str], Mapping[str, int | str]] | None = None,
    ) -> tuple[str, bytes]:
        headers = {"Content-Type": "application/json"} if payload is not None else None
        answer = await self.caller.call(
            self._client(), method, path, data=payload, headers=headers, params=params,
            limits=limits, credential="gateway token",
        )
        return answer.url, answer.body


class MemoryLink:
    """An in-memory control plane for tests and embedding.

    ``publish`` hands a new config to every watcher at once; ``on_demand`` (if
    given) is called for each demand, e.g. to publish an endpoint later.
    """

    def __init__(
        self,
        config: wire.GatewayConfig | None = None,
        *,
        poll_timeout_s: float = 25.0,
        on_demand: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.config = config or wire.GatewayConfig(routing=wire.RoutingTable(version=0))
        self.poll_timeout_s = poll_timeout_s
        self.on_demand = on_demand
        self.demands: list[str] = []
        self.loads: list[wire.GatewayLoadReport] = []
        self.usage: list[wire.UsageRecord] = []
        self.fail = False  # when True every call raises, as if the control plane were down
        self._changed = asyncio.Event()
        # Shares of the config's limits, lent as a control plane would (no
        # store: calendar windows start from nothing).
        self.allowances = AllowanceBook(settle_s=0.0, now=time.monotonic())

    def publish(self, config: wire.GatewayConfig) -> None:
        self.config = config
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _check(self) -> None:
        if self.fail:
            raise ControlPlaneUnavailable("memory link set to fail")

    async def watch_config(self, after_version: int) -> wire.GatewayConfig:
        self._check()
        if self.config.routing.version <= after_version:
            changed = self._changed
            try:
                async with asyncio.timeout(self.poll_timeout_s):
                    await changed.wait()
            except TimeoutError:
                pass
        self._check()
        return self.config

    async def demand(self, model: str) -> None:
        self._check()
        self.demands.append(model)
        if self.on_demand is not None:
            await self.on_demand(model)

    async def report_load(self, report: wire.GatewayLoadReport) -> None:
        self._check()
        self.loads.append(report)

    async def report_usage(self, records: list[wire.UsageRecord]) -> None:
        self._check()
        self.usage.extend(records)

    async def exchange_allowance(self, report: wire.AllowanceReport) -> wire.AllowanceAnswer:
        self._check()
        return await lend_from_config(self.allowances, self.config, report)


async def lend_from_config(book: AllowanceBook, config: wire.GatewayConfig,
                           report: wire.AllowanceReport) -> wire.AllowanceAnswer:
    """Shares of the limits ``config``'s keys and teams carry, with no store behind them
    (calendar windows start from nothing): for tests and embedding."""
    holders: dict[str, wire.TenantLimits] = {f"key:{k.key_id}": k for k in config.keys}
    holders.update({f"team:{t.team_id}": t for t in config.teams})

    def limit_of(subject: str, kind: wire.LimitKind) -> float | None:
        holder = holders.get(subject)
        return holder.limit_of(kind) if holder is not None else None

    async def nothing_yet(subject: str, kind: wire.LimitKind, window: int) -> float:
        return 0.0

    return await book.exchange(report, time.monotonic(), limit_of, nothing_yet)
