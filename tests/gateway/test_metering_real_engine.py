"""A llama_cpp.server stream is counted without the engine generating for it.

The engine reports no usage in streams. With the template the agent gave
it declared in its dialect, the gateway renders each chat prompt as the
engine does and counts it with the engine's tokenize route: the engine
serves exactly the client's requests (its access log), where a one-token
copy of each stream used to take a turn and a state of its prompt cache;
and the counts are still the engine's own (its unstreamed usage for the
same request).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from tests.gateway.conftest import async_client, make_config, running_gateway
from tests.gateway.sims import metered
from tests.gateway.test_real_engine import SERVED, Engine, llama_server
from tests.waiting import eventually

from llmgw import wire
from llmgw.agent.engines.llamacpppython import PYTHON_DIALECT, declared_template
from llmgw.agent.engines.templates import template_files
from llmgw.gateway.link import MemoryLink

pytestmark = pytest.mark.slow

TEMPLATE = template_files("gemma3")
DECLARED = PYTHON_DIALECT.model_copy(update={"chat_template": declared_template(TEMPLATE, [])})
# The engine's unstreamed answers passed through: the reference counts.
DIRECT = PYTHON_DIALECT.model_copy(update={"stops_unstreamed": True})

CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Name three colours of the rainbow."}],
    [{"role": "system", "content": "You answer in one short line."},
     {"role": "user", "content": "What is a lighthouse for?"}],
    [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"},
     {"role": "user", "content": "Now say it in French, with <b>bold</b> & {braces}."}],
]  # fmt: skip


@pytest.fixture(scope="module")
def templated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """llama_cpp.server as the agent starts it on the starter GGUF (its prompt cache on)."""
    options = ["--interrupt_requests", "false", "--chat_format", "hf-tokenizer-config",
               "--hf_tokenizer_config_path", TEMPLATE.tokenizer_config, "--cache", "true",
               "--cache_size", str(64 << 20)]  # fmt: skip
    with llama_server(tmp_path_factory.mktemp("templated"), *options) as run:
        yield run


async def test_streams_are_counted_exactly_without_a_generation(templated: Engine) -> None:
    link = MemoryLink(poll_timeout_s=1.0)
    routes = [
        wire.ModelRoute(name=name, served_name=SERVED,
                        endpoints=[wire.Endpoint(replica_id=f"llama-{name}", url=templated.url,
                                                 dialect=dialect)])
        for name, dialect in (("gemma", DECLARED), ("direct", DIRECT))
    ]  # fmt: skip
    link.publish(make_config(1, routes))
    async with running_gateway(link) as (_, url):
        client = async_client(url, timeout=120)
        expected = [0, 0]
        for messages in CHATS:
            chat: dict[str, Any] = {"messages": messages, "temperature": 0, "max_tokens": 6}
            whole = await client.chat.completions.create(model="direct", **chat)
            assert whole.usage is not None
            before = templated.requests()
            stream = await client.chat.completions.create(
                model="gemma", stream=True, stream_options={"include_usage": True}, **chat
            )
            chunks = [chunk async for chunk in stream]
            usage = chunks[-1].usage
            assert usage is not None and chunks[-1].choices == []
            # The engine's own counts, and the engine served the client's stream alone.
            assert (usage.prompt_tokens, usage.completion_tokens) == (
                whole.usage.prompt_tokens, whole.usage.completion_tokens
            ), messages  # fmt: skip
            assert templated.requests() == before + 1, "a copy of the stream ran on the engine"
            for at, value in enumerate((usage.prompt_tokens, usage.completion_tokens)):
                expected[at] += 2 * value
        # Both the direct answers and the counted streams are metered, exactly.
        await eventually(lambda: metered(link) == tuple(expected), 5, what=f"{expected} metered",
                         note=lambda: metered(link))  # fmt: skip
