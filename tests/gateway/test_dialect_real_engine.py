"""llama_cpp.server's dialect, mended by the gateway, against the real engine.

The engine ignores ``stream_options`` and ``max_completion_tokens``; with the
dialect the llama.cpp adapter declares for it, the gateway adds the usage
chunk (counted with the engine's own tokenizer) and sends the limit as
``max_tokens``. Exactness is checked against the engine itself: a streamed
request must report what the same request reports unstreamed at
temperature 0.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from tests.gateway.conftest import async_client, make_config, running_gateway
from tests.gateway.test_real_engine import SERVED, Engine, engine  # noqa: F401 (fixture)

from llmgw import wire
from llmgw.agent.engines.llamacpp import PYTHON_DIALECT
from llmgw.gateway.link import MemoryLink

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]
PROMPT = "The three primary colours are"


def _config(real: Engine) -> wire.GatewayConfig:
    endpoint = wire.Endpoint(replica_id="llama-1", url=real.url, dialect=PYTHON_DIALECT)
    return make_config(1, [wire.ModelRoute(name="gemma", served_name=SERVED,
                                           endpoints=[endpoint])])  # fmt: skip


async def test_stream_usage_is_exact_and_limits_hold(engine: Engine) -> None:  # noqa: F811
    link = MemoryLink(poll_timeout_s=1.0)
    link.publish(_config(engine))
    async with running_gateway(link) as (_, url):
        client = async_client(url, timeout=120)
        chat: dict[str, Any] = {"model": "gemma", "messages": CHAT, "temperature": 0,
                                "max_tokens": 12}  # fmt: skip
        whole = await client.chat.completions.create(**chat)
        assert whole.usage is not None
        stream = await client.chat.completions.create(
            **chat, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        with_usage = [c for c in chunks if c.usage is not None]
        assert len(with_usage) == 1 and chunks[-1] is with_usage[0]
        assert with_usage[0].choices == []
        usage = with_usage[0].usage
        assert usage is not None
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
        # The chat prompt is the templated one the engine evaluated, not the text.
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            whole.usage.prompt_tokens, whole.usage.completion_tokens
        )  # fmt: skip
        for chunk in chunks:
            assert chunk.id and chunk.created and chunk.model and chunk.object

        plain: dict[str, Any] = {"model": "gemma", "prompt": PROMPT, "temperature": 0,
                                 "max_tokens": 8}  # fmt: skip
        whole_text = await client.completions.create(**plain)
        assert whole_text.usage is not None
        streamed = await client.completions.create(
            **plain, stream=True, stream_options={"include_usage": True}
        )
        last = [chunk async for chunk in streamed][-1]
        assert last.usage is not None and last.choices == []
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
            whole_text.usage.prompt_tokens, whole_text.usage.completion_tokens
        )  # fmt: skip

        # max_completion_tokens, which the engine ignores, bounds the answer.
        limited = await client.chat.completions.create(
            model="gemma", messages=[{"role": "user", "content": "Count from 1 to 50."}],
            temperature=0, max_completion_tokens=5,
        )  # fmt: skip
        assert limited.usage is not None and limited.usage.completion_tokens <= 5
        assert limited.choices[0].finish_reason == "length"
        stream = await client.chat.completions.create(
            model="gemma", messages=[{"role": "user", "content": "Count from 1 to 50."}],
            temperature=0, max_completion_tokens=5, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        last_chunk = [chunk async for chunk in stream][-1]
        assert last_chunk.usage is not None and last_chunk.usage.completion_tokens <= 5

        # Usage records carry the exact counts of all six requests.
        expected = (
            2 * whole.usage.prompt_tokens + 2 * whole_text.usage.prompt_tokens
            + limited.usage.prompt_tokens + last_chunk.usage.prompt_tokens,
            2 * whole.usage.completion_tokens + 2 * whole_text.usage.completion_tokens
            + limited.usage.completion_tokens + last_chunk.usage.completion_tokens,
        )  # fmt: skip
        got = (0, 0)
        for _ in range(100):
            got = (sum(r.prompt_tokens for r in link.usage),
                   sum(r.completion_tokens for r in link.usage))  # fmt: skip
            if got == expected:
                break
            await asyncio.sleep(0.05)
        assert got == expected
