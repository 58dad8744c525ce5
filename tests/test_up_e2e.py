"""`llmgw up` end to end: a real llama.cpp engine on the real small model.

This is the promise of the README: one command on a machine without GPUs
serves a chat completion from a real model to the official openai client,
streamed and not, and Ctrl-C leaves no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI
from tests.servers import free_port, interrupt_up, spawn_up, wait_up_json
from tests.waiting import eventually_sync

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 420


def wait_ready(client: OpenAI, proc: subprocess.Popen[bytes], log: Path) -> float:
    """Retry a tiny completion until the replica answers; returns seconds waited."""
    started = time.monotonic()
    last_error: Exception | None = None
    while time.monotonic() - started < START_TIMEOUT_S:
        if proc.poll() is not None:
            pytest.fail(f"llmgw up exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=1
            )
            return time.monotonic() - started
        except Exception as exc:  # 503 while the engine loads
            last_error = exc
            time.sleep(1)
    pytest.fail(f"no completion within {START_TIMEOUT_S}s: {last_error}\n{log.read_text()[-4000:]}")


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def is_engine(argv: list[str]) -> bool:
    """llama_cpp.server itself, not its guard."""
    return "llama_cpp.server" in argv and "llmgw.agent.engineguard" not in argv


def assert_engine_takes_its_key_only(engine: psutil.Process, info: dict[str, str]) -> None:
    """The engine answers the gateway only: it was started with its replica's key, in
    its environment (its argv is world-readable in /proc), and refuses a direct
    call without that key, with a client's API key, or with another."""
    argv = engine.cmdline()
    url = f"http://{argv[argv.index('--host') + 1]}:{argv[argv.index('--port') + 1]}"
    key = engine.environ()["API_KEY"]  # llama_cpp.server's settings read it
    assert len(key) >= 40 and not any(key in item for item in argv)
    ask = {"model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    for headers in ({}, {"Authorization": f"Bearer {info['api_key']}"},
                    {"Authorization": f"Bearer {key[:-1]}"}):  # fmt: skip
        direct = httpx.post(f"{url}/v1/chat/completions", json=ask, headers=headers, timeout=60)
        assert direct.status_code in (401, 403), direct.text
        assert httpx.get(f"{url}/v1/models", headers=headers, timeout=60).status_code in (401, 403)
    keyed = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert keyed.status_code == 200
    # No read of the control plane shows it, to operators or anyone else.
    admin = {"Authorization": f"Bearer {info['admin_token']}"}
    for path in ("/replicas", "/nodes", "/models", "/events", "/summary"):
        read = httpx.get(f"{info['admin_url']}/admin/v1{path}", headers=admin, timeout=30)
        assert read.status_code == 200 and key not in read.text, path


def test_up_serves_the_real_model(tmp_path: Path, test_output: Path) -> None:
    port = free_port()
    data_dir = tmp_path / "data"
    log = test_output / "up-e2e.log"
    proc = spawn_up(data_dir, port, log)
    engine_pid = -1
    try:
        up_json = data_dir / "up.json"
        info = wait_up_json(proc, data_dir, log)
        assert oct(up_json.stat().st_mode & 0o777) == "0o600"
        assert info["api_url"] == f"http://127.0.0.1:{port}/v1"
        assert info["admin_token"].startswith("llmgw-admin-")
        assert info["api_key"].startswith("sk-llmgw-")
        banner = log.read_text()
        assert info["api_url"] in banner and "curl" in banner
        # Secrets stay in up.json: stdout is a journal or a CI log.
        assert str(up_json) in banner
        assert info["api_key"] not in banner and info["admin_token"] not in banner
        assert info["join_token"] not in banner
        # No API docs page that loads scripts from a CDN next to the console.
        for page in ("/admin/docs", "/redoc", "/docs"):
            assert httpx.get(info["admin_url"] + page).status_code == 404

        # Without a valid key: 401 with an OpenAI-shaped error.
        denied = httpx.post(f"{info['api_url']}/chat/completions", json={"model": "default"},
                            headers={"Authorization": "Bearer sk-llmgw-wrong"})
        assert denied.status_code == 401
        assert denied.json()["error"]["code"] == "invalid_api_key"

        client = OpenAI(base_url=info["api_url"], api_key=info["api_key"], max_retries=0,
                        timeout=120)
        waited = wait_ready(client, proc, log)

        started = time.monotonic()
        reply = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "Name three colours."}],
            max_tokens=24,
        )
        assert reply.choices[0].message.content
        assert reply.usage is not None and reply.usage.completion_tokens > 0
        # The starter model's system and developer messages reach it: the
        # template the agent supplies puts them before the first user turn
        # (llama.cpp's built-in gemma format dropped them).
        instructed = client.chat.completions.create(
            model="default", max_tokens=1,
            messages=[{"role": "system", "content": "Answer in French, in one short line."},
                      {"role": "user", "content": "Name three colours."}],
        )
        assert instructed.usage is not None
        assert instructed.usage.prompt_tokens >= reply.usage.prompt_tokens + 6

        pieces: list[str] = []
        first_token_s: float | None = None
        counting = {"model": "default", "temperature": 0, "max_tokens": 24,
                    "messages": [{"role": "user", "content": "Count from one to five."}]}
        whole = client.chat.completions.create(**counting)  # type: ignore[call-overload]
        started = time.monotonic()
        stream = client.chat.completions.create(  # type: ignore[call-overload]
            **counting, stream=True, stream_options={"include_usage": True}
        )
        usages = []
        for chunk in stream:
            if chunk.usage is not None:
                usages.append(chunk)
            if chunk.choices and chunk.choices[0].delta.content:
                if first_token_s is None:
                    first_token_s = time.monotonic() - started
                pieces.append(chunk.choices[0].delta.content)
        assert len(pieces) > 1, "a stream should arrive in several chunks"
        # llama_cpp.server sends no usage in streams: the gateway counts it
        # (the engine's dialect, reported by the agent), exactly.
        assert len(usages) == 1 and usages[0] is chunk and chunk.choices == []
        assert whole.usage is not None
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (
            whole.usage.prompt_tokens, whole.usage.completion_tokens)
        limited = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Count to fifty."}],
            max_completion_tokens=5,
        )
        assert limited.usage is not None and limited.usage.completion_tokens <= 5

        # The engine runs under its guard (llmgw.agent.engineguard), whose
        # command line names the engine's too.
        engines = [p for p in descendants(proc.pid) if is_engine(p.cmdline())]
        assert len(engines) == 1, "the engine should run as a child of llmgw up"
        engine_pid = engines[0].pid
        assert_engine_takes_its_key_only(engines[0], info)

        # Killing `llmgw up` as a whole (no clean stop) and starting it again on
        # the same data dir adopts the running engine: no restart, same process.
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert psutil.pid_exists(engine_pid), "the engine must survive its agent"
        proc = spawn_up(data_dir, port, log, append=True)
        readopted = wait_ready(client, proc, log)
        again = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Say yes."}], max_tokens=4
        )
        assert again.choices[0].message.content is not None
        assert psutil.pid_exists(engine_pid)
        engines_now = [p.pid for p in psutil.process_iter(["cmdline"])
                       if is_engine(p.info["cmdline"] or [])
                       and str(data_dir) in " ".join(p.info["cmdline"] or [])]
        assert engines_now == [engine_pid], "the engine was restarted instead of adopted"
        (test_output / "up-e2e-timings.json").write_text(
            json.dumps({"ready_after_s": round(waited, 2),
                        "first_token_s": round(first_token_s or -1, 3),
                        "ready_again_after_restart_s": round(readopted, 2)})
        )
    finally:
        children = []
        if proc.poll() is None:
            children = descendants(proc.pid)
            if not interrupt_up(proc):
                pytest.fail("llmgw up did not stop within 60 s of SIGINT")
    assert proc.returncode == 0, log.read_text()[-3000:]

    def left() -> list[psutil.Process]:
        return [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]

    eventually_sync(lambda: not left(), 0.5, what="no process left behind",
                    note=lambda: [c.cmdline() for c in left()])  # fmt: skip
    # The adopted engine is not a child of the second `up`, and must be gone too.
    assert not psutil.pid_exists(engine_pid) or (
        psutil.Process(engine_pid).status() == psutil.STATUS_ZOMBIE
    )
