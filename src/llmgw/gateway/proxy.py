"""Talking to engines: one pooled aiohttp client, usage extraction, the SSE relay.

aiohttp rather than httpx: as a proxy client httpx's pool was the bottleneck
in LiteLLM's measurements (research/gateway.md §1). One session, keep-alive,
no cookie jar, no decompression (bodies are passed through as they are).

Only failures that happen before the engine's answer could have reached the
client are :class:`UpstreamUnavailable` (and so retried elsewhere); anything
after the first byte was relayed is the stream's problem, reported in-band.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import aiohttp
import orjson
from yarl import URL

from llmgw.gateway.settings import GatewaySettings

# Connection-level failures: refused, reset, closed before the answer, or a
# connect that timed out. A response that arrived (any status) is not one.
RETRYABLE = (
    aiohttp.ClientConnectionError,  # refused, reset, server disconnected, connect timeout
    aiohttp.ClientPayloadError,  # body cut short (non-streaming: nothing relayed yet)
    ConnectionError,
)


class UpstreamUnavailable(Exception):
    """The replica could not be reached or dropped the connection before answering."""


@dataclass(slots=True)
class Usage:
    prompt: int = 0
    completion: int = 0
    cached: int = 0


class Upstream:
    """The gateway's client for engines (one per gateway, created in ``start``)."""

    def __init__(self, settings: GatewaySettings) -> None:
        self._settings = settings
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[tuple[str, str], URL] = {}

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0,  # bounded by the engines' own queues, not by an arbitrary pool size
            keepalive_timeout=60.0,
            ttl_dns_cache=300,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept"),
            timeout=aiohttp.ClientTimeout(
                total=self._settings.upstream_timeout_s,
                sock_connect=self._settings.connect_timeout_s,
            ),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def url(self, base: str, path: str) -> URL:
        # yarl parses and quotes on every construction; engines and paths are few.
        key = (base, path)
        url = self._urls.get(key)
        if url is None:
            if len(self._urls) > 4096:
                self._urls.clear()
            url = self._urls[key] = URL(base + path, encoded=True)
        return url

    async def post(self, url: URL, body: bytes, request_id: str) -> aiohttp.ClientResponse:
        session = self._session
        if session is None:
            raise UpstreamUnavailable("gateway is not started")
        try:
            return await session.post(
                url,
                data=body,
                headers={"Content-Type": "application/json", "X-Request-Id": request_id},
            )
        except RETRYABLE as exc:
            raise UpstreamUnavailable(f"{url.host}:{url.port}: {exc!r}") from None
        except TimeoutError:
            raise UpstreamUnavailable(f"{url.host}:{url.port}: connect timed out") from None


async def read_all(response: aiohttp.ClientResponse) -> bytes:
    """The whole body; a cut-off body is UpstreamUnavailable (nothing was relayed yet)."""
    try:
        return await response.read()
    except RETRYABLE as exc:
        raise UpstreamUnavailable(f"body cut short: {exc!r}") from None
    finally:
        response.release()


def _closing_brace(data: bytes, start: int) -> int:
    depth = 0
    for index in range(start, min(len(data), start + 4096)):
        char = data[index]
        if char == 0x7B:  # {
            depth += 1
        elif char == 0x7D:  # }
            depth -= 1
            if depth == 0:
                return index
    return -1


def find_usage(data: bytes) -> Usage | None:
    """The last ``"usage": {...}`` object in ``data``, without parsing the rest.

    Embedding answers are large arrays of floats; locating the small usage
    object and parsing only it keeps the cost independent of answer size.
    """
    at = data.rfind(b'"usage"')
    if at < 0:
        return None
    start = data.find(b"{", at + 7, at + 32)
    if start < 0:
        return None
    end = _closing_brace(data, start)
    if end < 0:
        return None
    try:
        usage = orjson.loads(data[start : end + 1])
    except orjson.JSONDecodeError:
        return None
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(
        prompt=_int(usage.get("prompt_tokens")),
        completion=_int(usage.get("completion_tokens")),
        cached=_int(cached),
    )


def _int(value: object) -> int:
    return value if isinstance(value, int) and value > 0 else 0


_EVENT_SPLIT = re.compile(rb"(?:\r?\n){2}")
_USAGE_MARK = b'"usage":{'
_USAGE_MARK_SPACED = b'"usage": {'


def _last_boundary(data: bytes) -> int:
    """End (exclusive) of the last complete SSE event in ``data``, or -1."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else -1, crlf + 4 if crlf >= 0 else -1)


class StreamRelay:
    """Passes an SSE stream through whole events at a time, noting the usage.

    Events are forwarded as soon as they are complete (engines write whole
    events, so this adds no delay), which also means an error event appended
    after a failure never lands in the middle of a half-sent line. When the
    gateway itself asked the engine for ``include_usage``, the usage-only event
    is removed so the client sees the stream it asked for.
    """

    __slots__ = ("_pending", "_strip", "events", "usage")

    def __init__(self, strip_usage: bool) -> None:
        self._strip = strip_usage
        self._pending = b""
        self.usage: Usage | None = None
        self.events = 0

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk if self._pending else chunk
        cut = _last_boundary(data)
        if cut < 0:
            self._pending = data
            return b""
        self._pending = data[cut:]
        complete = data[:cut]
        self.events += complete.count(b"data:")
        if _USAGE_MARK in complete or _USAGE_MARK_SPACED in complete:
            complete = self._take_usage(complete)
        return complete

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest

    def _take_usage(self, block: bytes) -> bytes:
        kept: list[bytes] = []
        for event in _EVENT_SPLIT.split(block):
            if not event:
                continue
            if _USAGE_MARK in event or _USAGE_MARK_SPACED in event:
                usage = find_usage(event)
                if usage is not None:
                    self.usage = usage
                    if self._strip and (b'"choices":[]' in event or b'"choices": []' in event):
                        continue
            kept.append(event)
        return b"".join(e + b"\n\n" for e in kept)


def sse_error(message: str, code: str = "upstream_error") -> bytes:
    """An error event for a stream that already started (status 200 is gone)."""
    payload = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + orjson.dumps(payload) + b"\n\n"
