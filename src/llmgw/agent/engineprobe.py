"""The agent's HTTP calls to one replica's engine: probes, metrics scrapes, and the
runtime calls of agent.loras (adapters, sleep).

Every call carries the replica's engine key as a bearer token, since engines
differ in what they guard (llama_cpp.server's /v1/models, the readiness path,
needs it; vLLM's /health does not), and verifies an engine that listens with
TLS against the fleet's CA (agent.nodecert).
"""

from __future__ import annotations

import contextlib
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp

from llmgw.agent.progress import MAX_METRICS_BYTES, MetricsError, ProgressMetrics, read_progress


@dataclass(frozen=True)
class EngineEndpoint:
    session: aiohttp.ClientSession
    host: str  # where the engine listens
    port: int | None
    tls: bool = False
    key: str | None = None  # the replica's engine key
    # Verifies an engine that listens with TLS; None: aiohttp's default.
    probe_ssl: ssl.SSLContext | None = None

    def url(self, path: str) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{_url_host(_probe_host(self.host))}:{self.port}{path}"

    async def probe(self, path: str, timeout_s: float) -> str | None:
        """GET ``path``: None when the engine answers 200, else what went wrong."""
        try:
            async with self._get(path, timeout_s) as resp:
                return None if resp.status == 200 else f"HTTP {resp.status}"
        except TimeoutError:
            return f"no answer within {timeout_s:g} s"
        except (aiohttp.ClientError, OSError) as exc:
            return str(exc) or type(exc).__name__

    async def scrape(
        self, metrics: ProgressMetrics, timeout_s: float
    ) -> tuple[float, tuple[float, ...]]:
        """The engine's requests running and token counters, read from its metrics."""
        async with self._get(metrics.path, timeout_s) as resp:
            if resp.status != 200:
                raise MetricsError(f"HTTP {resp.status}")
            body = bytearray()
            async for chunk in resp.content.iter_chunked(64 * 1024):
                body += chunk
                if len(body) > MAX_METRICS_BYTES:
                    raise MetricsError(f"metrics larger than {MAX_METRICS_BYTES} bytes")
        return read_progress(body.decode("utf-8", errors="replace"), metrics)

    async def asleep(self, timeout_s: float) -> bool | None:
        """llama-server's own sleep (``GET /props``, answered asleep too); None: no answer."""
        async with self._get("/props", timeout_s) as resp:
            if resp.status != 200:
                return None
            body = await resp.content.read(MAX_METRICS_BYTES)
        try:
            props = json.loads(body)
        except ValueError:
            return None
        found = props.get("is_sleeping") if isinstance(props, dict) else None
        return found if isinstance(found, bool) else None

    async def post(
        self, path: str, body: dict[str, str] | list[dict[str, int | float]] | None,
        timeout_s: float,
    ) -> tuple[int, str]:
        """POST ``body`` (JSON) to ``path``: the status and the answer's first 2,000 characters."""
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else None
        verify: ssl.SSLContext | bool = (
            self.probe_ssl if self.tls and self.probe_ssl is not None else True
        )
        async with self.session.post(
            self.url(path), json=body, timeout=aiohttp.ClientTimeout(total=timeout_s),
            headers=headers, ssl=verify, allow_redirects=False,
        ) as resp:
            return resp.status, (await resp.text(errors="replace"))[:2000]

    @contextlib.asynccontextmanager
    async def _get(self, path: str, timeout_s: float) -> AsyncIterator[aiohttp.ClientResponse]:
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else None
        # True: aiohttp's default verification.
        verify: ssl.SSLContext | bool = (
            self.probe_ssl if self.tls and self.probe_ssl is not None else True
        )
        async with self.session.get(
            self.url(path), timeout=aiohttp.ClientTimeout(total=timeout_s), headers=headers,
            ssl=verify, allow_redirects=False,  # the engine key stays with the engine
        ) as resp:
            yield resp

def _probe_host(host: str) -> str:
    # An engine bound to every interface is reached locally over loopback.
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
