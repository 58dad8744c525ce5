"""The real engine stays within its memory budget under mixed client traffic.

What broke before (issue 12): after about seven minutes of ordinary traffic
the llama.cpp engine of ``llmgw up`` held 23.7 GB of RSS and the kernel's OOM
killer ended it; it grew by about 1 MB per generated token. Here about 200
requests go through the gateway with the official ``openai`` client: short
ones with small limits, ones with no limit at all (bounded by the catalog's
max_output_tokens, lowered for the run so it stays short on two cores),
streams, and clients that hang up mid-stream. The engine's RSS is sampled
throughout and must stay under its budget (the one the agent enforces) and
under 3 GB. The figures are written to test-output/memory-e2e.json.
"""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam
from tests.servers import free_port, interrupt_up, spawn_up, wait_up_json
from tests.test_up_e2e import descendants, wait_ready

pytestmark = pytest.mark.slow

GB = 1024**3
REQUESTS = 200
# The cap a request with no limit gets during the run (max_output_tokens).
UNLIMITED_CAP = 12
WORDS = ["river", "stone", "cloud", "apple", "seven", "blue", "lamp", "north", "garden"]


class RssSampler:
    """The engine's RSS every 0.2 s, on a thread: the peak, not only the last figure."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> int:
        rss = int(self.process.memory_info().rss)
        self.peak = max(self.peak, rss)
        return rss

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.now()
            except psutil.Error:
                return

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def one_request(client: OpenAI, index: int) -> str:
    """One of four kinds, in turn; returns the kind (the run counts them)."""
    rng = random.Random(index)
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 24)))
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": f"{index}: {words}"}]
    kind = ("limited", "stream", "unlimited", "disconnect")[index % 4]
    if kind == "limited":
        client.chat.completions.create(
            model="default", messages=messages, max_tokens=rng.randint(1, 6)
        )
    elif kind == "stream":
        stream = client.chat.completions.create(
            model="default",
            messages=messages,
            max_completion_tokens=rng.randint(2, 8),
            stream=True,
            stream_options={"include_usage": True},
        )
        for _ in stream:
            pass
    elif kind == "unlimited":
        client.chat.completions.create(model="default", messages=messages)
    else:
        stream = client.chat.completions.create(model="default", messages=messages, stream=True)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break  # hang up after the first token
        stream.close()
    return kind


def test_the_engine_stays_within_its_budget_under_mixed_traffic(
    tmp_path: Path, test_output: Path
) -> None:
    port = free_port()
    data_dir = tmp_path / "data"
    log = test_output / "memory-e2e.log"
    proc = spawn_up(data_dir, port, log)
    try:
        info = wait_up_json(proc, data_dir, log)
        client = OpenAI(base_url=info["api_url"], api_key=info["api_key"], max_retries=0,
                        timeout=120)  # fmt: skip
        wait_ready(client, proc, log)
        admin = {"Authorization": f"Bearer {info['admin_token']}"}
        # Bound the unlimited requests for the run: a gateway-side field, so
        # the engine keeps running (and its memory keeps its history).
        spec = httpx.get(f"{info['admin_url']}/admin/v1/models/gemma-3-270m", headers=admin)
        assert spec.status_code == 200, spec.text
        entry = spec.json()["spec"]
        entry["max_output_tokens"] = UNLIMITED_CAP
        put = httpx.put(
            f"{info['admin_url']}/admin/v1/models/gemma-3-270m", json=entry, headers=admin
        )
        assert put.status_code == 200, put.text
        _wait_for_cap(client)

        engines = descendants(proc.pid)
        # The engine itself, not its guard (llmgw.agent.engineguard), whose
        # command line names it too.
        (engine,) = [p for p in engines if "llama_cpp.server" in p.cmdline()
                     and "llmgw.agent.engineguard" not in p.cmdline()]
        record = _engine_record(data_dir)
        budget = record["memory_budget_mib"] * 1024 * 1024
        assert budget < 3 * GB
        assert "--logits_all" in engine.cmdline() and "--cache" not in engine.cmdline()

        with RssSampler(engine.pid) as rss:
            before = rss.now()
            started = time.monotonic()
            with ThreadPoolExecutor(max_workers=4) as pool:
                kinds = list(pool.map(lambda i: one_request(client, i), range(REQUESTS)))
            took = time.monotonic() - started
            time.sleep(1.0)  # a disconnected request may still be finishing
            after = rss.now()
        assert kinds.count("disconnect") == REQUESTS // 4
        figures = {
            "requests": REQUESTS,
            "seconds": round(took, 1),
            "budget_mib": record["memory_budget_mib"],
            "rss_before_mib": before >> 20,
            "rss_after_mib": after >> 20,
            "rss_peak_mib": rss.peak >> 20,
        }
        (test_output / "memory-e2e.json").write_text(json.dumps(figures, indent=2))
        assert rss.peak < budget and rss.peak < 3 * GB, figures
        # Still the same engine, ready: not killed for its budget on the way.
        assert engine.is_running()
        states = httpx.get(f"{info['admin_url']}/admin/v1/replicas", headers=admin).json()
        assert [r["state"] for r in states] == ["ready"], states
    finally:
        interrupt_up(proc)


def _engine_record(data_dir: Path) -> dict[str, Any]:
    engines = json.loads((data_dir / "agent" / "engines.json").read_text())["engines"]
    (record,) = engines.values()
    assert record["memory_budget_mib"], record
    return dict(record)


def _wait_for_cap(client: OpenAI) -> None:
    """Until the gateway applies the lowered cap (its routing table is pushed to it)."""
    time.sleep(2.0)
    reply = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Tell me a long story."}]
    )
    assert reply.usage is not None and reply.usage.completion_tokens <= UNLIMITED_CAP, reply.usage
