"""An open-loop load generator: timed chat requests, streamed, with time to first token.

Open loop on purpose: requests leave at their workload time whether or not
earlier ones were answered, as real users do. A closed loop (next request
when the last returns) slows down with the system it measures and hides the
queueing that separates a good router from a bad one.

Time to first token is taken at the first chunk that carries content: an
OpenAI chat stream starts with a role-only chunk, which engines send before
any prefill has happened. Times are read from ``time.perf_counter``, not
the event loop's clock: uvloop's ``loop.time()`` counts whole milliseconds
and is read once per loop iteration, so TTFTs taken from it landed on a
1 ms grid, and the routing benchmark's low-rate cells -- where every policy
prefills cold prompts at the engine's floor and their p90s differ by less
than that -- were decided by which side of a millisecond a sample fell.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from llmgw.sim.benchstats import RequestResult
from llmgw.sim.workloads import TimedRequest

# How long the run waits for requests still in flight after the last one was
# sent; what is left then is counted as unfinished (TTFT censored).
DEFAULT_DRAIN_S = 60.0


@dataclass
class Probe:
    """Something to do at a given time of the run (a metrics scrape at a stage edge)."""

    at_s: float
    action: Callable[[], Any]


@dataclass
class RunResult:
    results: list[RequestResult] = field(default_factory=list)
    ended_at: float = 0.0  # seconds since the start, when the run stopped waiting


def _body(req: TimedRequest) -> bytes:
    return orjson.dumps(
        {
            "model": req.model,
            "messages": req.messages,
            "max_tokens": req.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


async def send_one(
    session: aiohttp.ClientSession,
    url: str,
    req: TimedRequest,
    headers: dict[str, str],
    clock: Callable[[], float],
) -> RequestResult:
    """POST one streamed chat completion to ``url`` (a base URL ending in /v1)."""
    sent = clock()
    first: float | None = None
    tokens = cached = 0
    try:
        async with session.post(
            f"{url}/chat/completions", data=_body(req), headers=headers
        ) as resp:
            if resp.status != 200:
                text = (await resp.read())[:200].decode("utf-8", errors="replace")
                return RequestResult(
                    req.index, req.stage, sent, done_at=clock(), error=f"HTTP {resp.status}: {text}"
                )
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = orjson.loads(data)
                choices = chunk.get("choices") or ()
                if first is None and choices and (choices[0].get("delta") or {}).get("content"):
                    first = clock()
                usage = chunk.get("usage")
                if usage:
                    tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    cached = int(details.get("cached_tokens") or 0)
    except asyncio.CancelledError:
        return RequestResult(req.index, req.stage, sent, first, None, tokens, cached, "unfinished")
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        return RequestResult(
            req.index, req.stage, sent, first, clock(), tokens, cached, f"{type(exc).__name__}"
        )
    return RequestResult(req.index, req.stage, sent, first, clock(), tokens, cached)


async def run(
    requests: Sequence[TimedRequest],
    urls: Sequence[str],
    *,
    api_key: str | None = None,
    probes: Sequence[Probe] = (),
    drain_s: float = DEFAULT_DRAIN_S,
    local_host: str | None = None,
) -> RunResult:
    """Send ``requests`` at their times; request k goes to ``urls[k % len(urls)]``.

    Alternating between several URLs is how two gateway instances share the
    traffic. Probes run at their times without delaying any request.
    ``local_host``: the address to connect from (a loopback address of its
    own per tenant, as clients on other machines have their own).
    """
    if not urls:
        raise ValueError("run needs at least one URL")
    loop = asyncio.get_running_loop()
    start = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - start

    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    local = (local_host, 0) if local_host is not None else None
    connector = aiohttp.TCPConnector(limit=0, force_close=False, local_addr=local)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    sent: list[tuple[TimedRequest, asyncio.Task[RequestResult]]] = []
    probe_tasks = [loop.create_task(_probe_at(p, clock)) for p in probes]
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for req in sorted(requests, key=lambda r: r.at_s):
            delay = req.at_s - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            url = urls[req.index % len(urls)]
            sent.append((req, loop.create_task(send_one(session, url, req, headers, clock))))
        if sent:
            await asyncio.wait([task for _, task in sent], timeout=drain_s)
        ended = clock()
        for _, task in sent:
            task.cancel()
        outcomes = await asyncio.gather(*(task for _, task in sent), return_exceptions=True)
        results = [
            outcome
            if isinstance(outcome, RequestResult)
            # Cancelled before it even started: it never left, count it unfinished.
            else RequestResult(req.index, req.stage, req.at_s, error="unfinished")
            for (req, _), outcome in zip(sent, outcomes, strict=True)
        ]
    await asyncio.gather(*probe_tasks, return_exceptions=True)
    return RunResult(results=sorted(results, key=lambda r: r.index), ended_at=ended)


async def _probe_at(probe: Probe, clock: Callable[[], float]) -> None:
    await asyncio.sleep(max(0.0, probe.at_s - clock()))
    outcome = probe.action()
    if asyncio.iscoroutine(outcome):
        await outcome
