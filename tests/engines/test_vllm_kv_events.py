"""A real vLLM CPU engine publishing its KV-cache events, followed as the gateway follows them.

vLLM is started as the agent starts a replica whose catalog entry sets
``kv_events`` (VllmAdapter with an events port); the gateway's own parts
follow it: a ZeroMQ follower (routing.kvfollow) feeding the replica's exact
cache, the prompt tokenised by the engine's /tokenize through the gateway's
upstream client (gateway.kvtokens), and the prefix policy choosing between
it and a replica that holds nothing. Needs what ``make engines`` installs
(tests/engines/fleet.py says what is missing).

``LLMGW_KV_EVENTS_FIXTURE=DIR`` also writes the frames received to DIR
(one JSON list of hex strings per message; the topic frame is empty)
(tests/fixtures/vllm-kv-events/ was made so), for the unit tests that decode
real bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio
from tests.engines.fleet import engines_dir
from tests.servers import free_port

from llmgw import wire
from llmgw.agent.engines.base import LaunchContext
from llmgw.agent.engines.vllm import VllmAdapter
from llmgw.gateway.engineclient import Upstream
from llmgw.gateway.kvtokens import prompt_tokens
from llmgw.gateway.routing.kvcache import token_block_hashes
from llmgw.gateway.routing.kvfollow import KvFollowers
from llmgw.gateway.routing.measured import PrefillSpeed
from llmgw.gateway.routing.policy import HIT
from llmgw.gateway.routing.prefixindex import PrefixIndex
from llmgw.gateway.routing.replica import Replica
from llmgw.gateway.routing.router import ModelRouter
from llmgw.gateway.settings import GatewaySettings

MODEL = "gemma-kv"
BLOCK = 32  # tokens per block: what vLLM's CPU backend prefers (multiples of 32)
READY_WITHIN_S = 600.0
# A prompt of several blocks: a shared "system" record and a question.
RECORD = " ".join(f"item {i} is stored in aisle {i % 7} on shelf {i % 5}." for i in range(40))
MESSAGES = [{"role": "user", "content": f"{RECORD}\n\nWhich aisle holds item 12?"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    # vLLM and the model only (fleet.engine_env also wants llama-server).
    python = engines_dir() / "vllm" / "bin" / "python"
    weights = engines_dir() / "models" / "gemma-3-270m-hf"
    missing = [str(p) for p in (python, weights / "config.json") if not p.exists()]
    if missing:
        pytest.fail(f"this test needs what `make engines` installs; missing: {', '.join(missing)}",
                    pytrace=False)  # fmt: skip
    port, events_port = free_port(), free_port()
    spec = wire.ModelSpec(
        name=MODEL, engine=wire.EngineKind.VLLM, kv_events=True,
        weights=wire.WeightsSource(kind="local", path=str(weights)),
        engine_args=["--max-model-len", "1024", "--dtype", "bfloat16", "--enforce-eager",
                     "--block-size", str(BLOCK)],
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
    )  # fmt: skip
    assignment = wire.ReplicaAssignment(
        replica_id="kv-0", model=spec, shard=wire.ShardAssignment(node="test")
    )
    ctx = LaunchContext(assignment=assignment, weights_path=str(weights), host="127.0.0.1",
                        port=port, kv_events_port=events_port)  # fmt: skip
    launch = VllmAdapter(str(python)).build(ctx)
    assert "--kv-events-config" in launch.argv
    assert launch.dialect.kv_events_port == events_port
    run_env = {k: v for k, v in os.environ.items() if k.upper() not in launch.drop_env}
    run_env.update(launch.env)
    log = tmp_path_factory.mktemp("vllm-kv") / "vllm.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(launch.argv, stdout=out, stderr=subprocess.STDOUT, env=run_env,
                                start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_WITHIN_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited: {log.read_text(errors='replace')[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM not ready in {READY_WITHIN_S:g} s")
            time.sleep(1.0)
        yield url, f"tcp://127.0.0.1:{events_port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        if proc.poll() is None:
            os.killpg(proc.pid, 9)


@contextlib.asynccontextmanager
async def recorder(url: str) -> AsyncIterator[list[list[bytes]]]:
    """Every message published on ``url`` while inside, raw."""
    socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(url)
    frames: list[list[bytes]] = []

    async def pull() -> None:
        while True:
            frames.append(list(await socket.recv_multipart()))

    task = asyncio.get_running_loop().create_task(pull())
    try:
        yield frames
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        socket.close(0)


async def test_the_exact_cache_holds_a_chat_and_routes_its_repeat_there(
    engine: tuple[str, str],
) -> None:
    url, events = engine
    real = Replica(wire.Endpoint(replica_id="real", url=url, kv_events=events))
    other = Replica(wire.Endpoint(replica_id="other", url="http://127.0.0.1:9",
                                  kv_events="tcp://127.0.0.1:9"))  # fmt: skip
    route = wire.ModelRoute(name=MODEL, served_name=MODEL)
    router = ModelRouter(route, [other, real], PrefixIndex(), PrefillSpeed(1000.0, 4.0),
                         block_chars=64, chars_per_token=4.0, tokens_per_unit=2048.0,
                         ttft_slack_s=0.05, wait_ratio=0.5, spread=4.0, lone=True)  # fmt: skip
    followers = KvFollowers()
    upstream = Upstream(GatewaySettings(gateway_id="t"))
    await upstream.start()
    followers.sync(router.replicas)
    try:
        async with recorder(events) as frames:
            await asyncio.sleep(1.0)  # the subscribers connected (a SUB misses what came before)
            payload: dict[str, Any] = {"model": MODEL, "messages": MESSAGES}
            tokens = await prompt_tokens(upstream, real, "/v1/chat/completions", payload, MODEL)
            assert tokens is not None and len(tokens) >= 4 * BLOCK
            async with httpx.AsyncClient(timeout=120) as client:
                answer = await client.post(f"{url}/v1/chat/completions",
                                           json={**payload, "max_tokens": 4})  # fmt: skip
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["prompt_tokens"] == len(tokens)
            full = len(tokens) // BLOCK
            keys = token_block_hashes(tokens, BLOCK)
            deadline = time.monotonic() + 10
            # Every block in the full-attention group (the sliding-window ones
            # hold the window's: a hit on this prompt stops a block short).
            while real.exact is None or not all(key in real.exact.blocks for key in keys):
                if time.monotonic() > deadline:
                    save_fixture(Path(os.environ.get("LLMGW_KV_EVENTS_FIXTURE") or "/tmp"),
                                 frames, tokens)  # fmt: skip
                    pytest.fail("the prompt's blocks never showed")
                await asyncio.sleep(0.1)
        assert real.exact.block_size == BLOCK and real.exact.live and len(keys) == full
        assert real.exact.depth(keys) >= full - 1
        # "other" is followed too (nothing publishes there): not live, the estimate.
        assert router.exact_live() is real
        pick = router.pick("x" * 4 * len(tokens), tokens=tokens)
        assert pick is not None and pick.replica is real and pick.outcome == HIT
        fixture = os.environ.get("LLMGW_KV_EVENTS_FIXTURE")
        if fixture:
            save_fixture(Path(fixture), frames, tokens)
    finally:
        await followers.close()
        await upstream.close()


def save_fixture(folder: Path, frames: list[list[bytes]], tokens: list[int] | Any) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "frames.jsonl").write_text(
        "".join(json.dumps([part.hex() for part in message]) + "\n" for message in frames)
    )
    meta = {"engine": "vllm-cpu 0.32.0", "model": "gemma-3-270m (starter, HF conversion)",
            "block_size": BLOCK, "prompt_tokens": list(tokens), "messages": MESSAGES}  # fmt: skip
    (folder / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
