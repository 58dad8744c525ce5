"""Engines the gateway's tests start: the simulator playing llama_cpp.server, and aiohttp stubs.

The sim's tokenizer is a documented rule (4 bytes a token), so the counts a
test expects are known; these parameters and this dialect are what the
llama.cpp adapter declares for llama_cpp.server (it ignores
``max_completion_tokens`` and ``stream_options``, and tokenizes on
``/tokenize``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from aiohttp import web
from openai.types import CompletionUsage

from llmgw import wire
from llmgw.gateway.link import MemoryLink
from llmgw.sim.engine import SimEngine

LLAMA_DIALECT = wire.EngineDialect(
    max_completion_tokens=False, stream_usage=False, tokenize_path="/tokenize",
    tokenize_field="prompt",
)  # fmt: skip
LLAMA_PARAMS = wire.SimParams(
    startup_s=0.0, decode_ms_per_token=0.2, prefill_tokens_per_s=1e6,
    max_completion_tokens=False, stream_usage=False,
)  # fmt: skip


@asynccontextmanager
async def running_sim(
    params: wire.SimParams = LLAMA_PARAMS, *, api_key: str | None = None
) -> AsyncIterator[SimEngine]:
    """A started, ready sim engine, stopped on the way out."""
    engine = SimEngine("sim", params, api_key=api_key)
    await engine.start("127.0.0.1", 0)
    assert await engine.wait_ready()
    try:
        yield engine
    finally:
        await engine.stop()


@asynccontextmanager
async def stub_engine(
    path: str, answer: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> AsyncIterator[str]:
    """An engine that answers POSTs to ``path`` with ``answer``, on a free port: its URL."""
    app = web.Application()
    app.router.add_post(path, answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def metered(link: MemoryLink) -> tuple[int, int]:
    """(prompt, completion) tokens over every usage row the gateway has sent."""
    return (sum(r.prompt_tokens for r in link.usage),
            sum(r.completion_tokens for r in link.usage))  # fmt: skip


def counts(usage: CompletionUsage | None) -> tuple[int, int, int]:
    """An answer's (prompt, completion, total) tokens; it must have reported usage."""
    assert usage is not None
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens
