"""`llmgw up --gateway-workers 2`: the API from two gateway processes next to `up`.

The workers follow up's own control plane with a token that lives only in
up's memory; up.json's api_url names their port; they count as gateways;
SIGTERM to up stops them with it.
"""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import openai
import psutil
from tests.servers import free_port, spawn_up, stop_group, wait_up_json
from tests.waiting import eventually_sync

FLEET = """\
nodes:
  - {count: 1, class: a100-80g, gpus: 1}
models:
  - {name: sim-chat, engine: sim, gpu_classes: [a100-80g], min_replicas: 1, max_replicas: 1,
     sim: {startup_s: 0.2}}
"""


def test_up_serves_the_api_from_gateway_workers_and_stops_them(tmp_path: Path) -> None:
    (tmp_path / "fleet.yaml").write_text(FLEET)
    port, workers_port = free_port(), free_port()
    log = tmp_path / "up.log"
    up = spawn_up(tmp_path / "data", port, log, "--sim", str(tmp_path / "fleet.yaml"),
                  "--gateway-workers", "2", "--gateway-port", str(workers_port))
    try:
        info = wait_up_json(up, tmp_path / "data", log, within_s=90)
        assert info["api_url"] == f"http://127.0.0.1:{workers_port}/v1"
        workers = [p for p in psutil.Process(up.pid).children()
                   if "--listen-fd" in " ".join(p.cmdline())]
        assert len(workers) == 2
        client = openai.OpenAI(base_url=info["api_url"], api_key=info["api_key"],
                               max_retries=0, timeout=10)

        def chat() -> bool:
            try:
                answer = client.chat.completions.create(
                    model="sim-chat", messages=[{"role": "user", "content": "hi"}])
            except (openai.APIStatusError, openai.APIConnectionError):
                return False  # the workers or the replica are not ready yet
            return bool(answer.choices[0].message.content)

        eventually_sync(chat, 90, "a chat through the workers",
                        note=lambda: log.read_text()[-2000:])
        # Each worker reports as a gateway of its own, besides up's own.
        admin = {"Authorization": f"Bearer {info['admin_token']}"}

        def gateways() -> int:
            answer = httpx.get(f"http://127.0.0.1:{port}/admin/v1/gateways", headers=admin)
            return len(answer.json()["gateways"])

        eventually_sync(lambda: gateways() == 3, 30, "up's gateway and 2 workers to report")
        stop_group(up, signal.SIGTERM, grace_s=30)
        assert up.returncode == 0, log.read_text()[-2000:]
        assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
    finally:
        stop_group(up, signal.SIGKILL)
