"""`llmgw up --sim ... --traffic RATE` (the real command): a demo fleet in use, newer routes.

One process serves both checks:

* the demo traffic reaches the usage the console shows within seconds:
  several demo keys, several models, an on-demand model started by it;
* /v1/responses and /v1/audio/transcriptions with the official openai
  client, /v1/rerank and /v1/score with httpx, through the whole path: the
  sim adapter declares the routes its engine serves, the agent reports
  them, the control plane puts them in the routing table and the gateway
  answers 404 for the model whose engine serves none of them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from tests.servers import llmgw_up
from tests.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")

FLEET = """\
fabrics: [ib-a]
nodes:
  - {count: 1, class: cpu, cpu_slots: 4, fabric: ib-a}
models:
  - {name: sim-a, engine: sim, gpu_classes: [cpu], min_replicas: 1,
     sim: {startup_s: 0.2, decode_ms_per_token: 1}}
  - {name: sim-chat-only, engine: sim, gpu_classes: [cpu], min_replicas: 1,
     sim: {startup_s: 0.2, decode_ms_per_token: 1, routes: []}}
  - {name: sim-lazy, engine: sim, gpu_classes: [cpu], min_replicas: 0, max_replicas: 1,
     idle_timeout_s: 30, sim: {startup_s: 0.2, decode_ms_per_token: 1}}
"""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def up(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Any, Path]]:
    root = tmp_path_factory.mktemp("updemo")
    (root / "fleet.yaml").write_text(FLEET)
    async with llmgw_up(root, "--sim", str(root / "fleet.yaml"), "--traffic", "10") as running:
        yield running.info, running.data


async def test_demo_traffic_shows_in_usage_within_seconds(
    up: tuple[dict[str, Any], Path],
) -> None:
    info, data = up
    admin = {"Authorization": f"Bearer {info['admin_token']}"}
    seen: list[Any] = []
    async with httpx.AsyncClient(base_url=info["admin_url"], timeout=10) as client:

        async def usage() -> Any:
            seen[:] = [(await client.get("/admin/v1/usage", headers=admin)).json()]
            groups = seen[0]["by_key_model"]
            keys = {g["key_id"] for g in groups if g["requests"]}
            models = {g["model"] for g in groups if g["requests"]}
            return len(keys) >= 2 and {"sim-a", "sim-chat-only"} <= models

        await eventually(usage, 30, what="demo requests of two keys on two models in the usage",
                         note=lambda: seen)  # fmt: skip
        demo = json.loads((data / "traffic-keys.json").read_text())
        assert oct((data / "traffic-keys.json").stat().st_mode & 0o777) == "0o600"
        demo_ids = {entry["key_id"] for entry in demo.values()}
        used = {g["key_id"] for g in seen[0]["by_key_model"]}
        assert len(used & demo_ids) >= 2  # the demo's own keys, by name in the console

        async def lazy_served() -> bool:
            groups = (await client.get("/admin/v1/usage", headers=admin)).json()["by_key_model"]
            return any(g["model"] == "sim-lazy" and g["requests"] > g["errors"] for g in groups)

        # The on-demand model is started by the traffic's first burst.
        await eventually(lazy_served, 40, what="the on-demand model served")


async def test_newer_openai_routes_end_to_end(up: tuple[dict[str, Any], Path]) -> None:
    info, _ = up
    client = openai.AsyncOpenAI(base_url=info["api_url"], api_key=info["api_key"],
                                max_retries=0, timeout=30)  # fmt: skip
    try:
        answer = await client.responses.create(model="sim-a", input="Hello there.",
                                               max_output_tokens=4)  # fmt: skip
        assert answer.usage is not None and answer.usage.output_tokens == 4
        assert len(answer.output_text.split()) == 4
        events = [e.type async for e in await client.responses.create(
            model="sim-a", input="Hello.", max_output_tokens=2, stream=True)]  # fmt: skip
        assert events[-1] == "response.completed"
        heard = await client.audio.transcriptions.create(
            model="sim-a", file=("hello.wav", b"RIFF" + bytes(40_000), "audio/wav"))
        assert heard.text
        with pytest.raises(openai.NotFoundError, match="does not serve /v1/responses"):
            await client.responses.create(model="sim-chat-only", input="Hello.")
    finally:
        await client.close()
    headers = {"Authorization": f"Bearer {info['api_key']}"}
    async with httpx.AsyncClient(base_url=info["api_url"], headers=headers, timeout=30) as http:
        ranked = await http.post("/rerank", json={"model": "sim-a", "query": "q",
                                                  "documents": ["a", "b"]})  # fmt: skip
        assert ranked.status_code == 200 and len(ranked.json()["results"]) == 2
        scored = await http.post("/score", json={"model": "sim-a", "text_1": "q",
                                                 "text_2": ["a", "b"]})  # fmt: skip
        assert scored.status_code == 200 and len(scored.json()["data"]) == 2
        refused = await http.post("/rerank", json={"model": "sim-chat-only", "query": "q",
                                                   "documents": ["a"]})  # fmt: skip
        assert refused.status_code == 404
        assert refused.json()["error"]["code"] == "model_not_found"
