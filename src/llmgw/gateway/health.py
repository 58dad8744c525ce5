"""Health checks of external models' URLs, run by each gateway off the request path.

The agent watches every engine llmgw runs; nobody watches a server llmgw
does not run, so the gateway does, for the URLs it routes to
(llmgw.control.external says why the gateway and not the control plane).
Every ``health_interval_s`` each URL gets ``GET /v1/models`` with the key
the gateway would send. A URL whose probes fail ``health_failures`` times in
a row leaves routing; the first probe that passes brings it back. Meanwhile
requests are never held up: a request that meets a dead URL before its probe
does is retried on another (the usual retries and cool-down).

Out of routing means cooled down until the next probe, so the router needs
nothing new and keeps its rule: if every URL of a model is out, they are all
offered again (a request that may fail beats one refused for certain).

What fails a probe: no connection (refused, reset, DNS, TLS), a 5xx, a
refused key (401/403), or no answer within ``health_timeout_s`` -- except
while this gateway has requests in flight on the URL: a server that runs one
request at a time (llama_cpp.server) answers its model list only after them,
and if it were dead those requests would fail and cool it down themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from llmgw.gateway.settings import GatewaySettings
from llmgw.gateway.snapshot import ConfigView, ExternalEndpoint

log = logging.getLogger(__name__)

PROBE_PATH = "/v1/models"


@dataclass(slots=True)
class UrlHealth:
    """What this gateway knows of one URL."""

    up: bool | None = None  # None: not probed yet (routed to meanwhile)
    reason: str | None = None
    failures: int = 0  # probes failed in a row


class _Busy(Exception):
    """The probe timed out while requests were in flight there: no verdict."""


class HealthProber:
    def __init__(
        self, settings: GatewaySettings, snapshot: Callable[[], ConfigView | None]
    ) -> None:
        self.settings = settings
        self._snapshot = snapshot
        self.health: dict[str, UrlHealth] = {}  # by replica id
        self._session: aiohttp.ClientSession | None = None
        self._tls: ssl.SSLContext | None = None

    def of(self, replica_id: str) -> UrlHealth | None:
        return self.health.get(replica_id)

    async def run(self) -> None:
        """Probe forever; one round never stops the next."""
        try:
            while True:
                try:
                    await self.probe_all()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("health probes of external models failed")
                await asyncio.sleep(self.settings.health_interval_s)
        finally:
            if self._session is not None:
                await self._session.close()
                self._session = None

    async def probe_all(self) -> None:
        snapshot = self._snapshot()
        targets = dict(snapshot.external) if snapshot is not None else {}
        for gone in [rid for rid in self.health if rid not in targets]:
            del self.health[gone]
        if not targets:
            return
        if self._session is None or self._session.closed:
            # Its own pool, and no cookies: probes must not look like a client.
            self._session = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar())
        results = await asyncio.gather(
            *(self._probe(self._session, e) for e in targets.values()), return_exceptions=True
        )
        for (replica_id, endpoint), result in zip(targets.items(), results, strict=True):
            if isinstance(result, _Busy):
                continue
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result
            problem = None if result is None else str(result)
            self._apply(replica_id, endpoint, problem)

    async def _probe(self, session: aiohttp.ClientSession, endpoint: ExternalEndpoint) -> None:
        """None when the URL answers; raises an exception saying why it does not."""
        if endpoint.key_problem is not None:
            raise LookupError(endpoint.key_problem)
        headers = {}
        if endpoint.replica.engine_key:
            headers["Authorization"] = f"Bearer {endpoint.replica.engine_key}"
        timeout = aiohttp.ClientTimeout(
            total=self.settings.health_timeout_s, connect=self.settings.connect_timeout_s
        )
        try:
            async with session.get(
                endpoint.url + PROBE_PATH, headers=headers, timeout=timeout,
                allow_redirects=False,
                ssl=self._tls_context() if endpoint.url.startswith("https:") else True,
            ) as answer:  # fmt: skip
                status = answer.status
                with contextlib.suppress(Exception):
                    await answer.read()
        except TimeoutError:
            if endpoint.replica.in_flight > 0:
                raise _Busy from None
            raise ConnectionError(
                f"no answer to GET {PROBE_PATH} within {self.settings.health_timeout_s:g} s"
            ) from None
        except aiohttp.ClientError as exc:
            raise ConnectionError(f"unreachable: {_plain(exc)}") from None
        if status in (401, 403):
            asked = "refused the API key" if headers else "wants an API key (set api_key_env)"
            raise PermissionError(f"{asked} (HTTP {status})")
        if status >= 500:
            raise ConnectionError(f"GET {PROBE_PATH} answered HTTP {status}")

    def _tls_context(self) -> ssl.SSLContext:
        # The system's trust store, as the request path uses (http.client),
        # read when first needed: aiohttp's own default is made at import.
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def _apply(self, replica_id: str, endpoint: ExternalEndpoint, problem: str | None) -> None:
        health = self.health.setdefault(replica_id, UrlHealth())
        replica = endpoint.replica
        if problem is None:
            if health.up is False:
                log.info("external model %s: %s is back", endpoint.model, endpoint.url)
                replica.cooled_until = 0.0
                replica.failures = 0
            health.up, health.reason, health.failures = True, None, 0
            return
        health.failures += 1
        health.reason = problem
        if health.failures < self.settings.health_failures and health.up is not False:
            return
        if health.up is not False:
            log.warning("external model %s: %s is down, out of routing: %s",
                        endpoint.model, endpoint.url, problem)  # fmt: skip
        health.up = False
        # Out until the probe after next at the earliest; each failed probe
        # extends it, the first that passes ends it.
        hold = 2 * self.settings.health_interval_s + self.settings.health_timeout_s
        replica.cooled_until = max(replica.cooled_until, time.monotonic() + hold)


def _plain(exc: aiohttp.ClientError) -> str:
    """aiohttp's error in a few words (its own text names the SSL context object)."""
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return (f"the TLS certificate of {exc.host}:{exc.port} is not trusted:"
                f" {exc.certificate_error}")
    if isinstance(exc, aiohttp.ClientConnectorError):
        error = exc.os_error
        return f"connect to {exc.host}:{exc.port}: {error.strerror or error}"
    return str(exc).strip() or type(exc).__name__
