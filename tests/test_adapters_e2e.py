"""`llmgw up --sim` (the real command): LoRA adapters as models, and sleep instead of stop.

One process (control plane, gateway, agent, simulated engines as child
processes) serves both checks, through the official openai client:

* three adapters of one base whose engine has two adapter slots: each is
  listed by /v1/models with its ``parent``, is loaded on the base's replica
  when first asked for (the request waits for the load as for an on-demand
  start), answers under its own name, and the least recently used one is
  unloaded to make room for the third; usage and the admin summary name them;
  an API key limited to one adapter reaches that one only;
* an on-demand model whose engine can sleep: once idle it is put to sleep
  (not stopped), and the next request wakes it in a fraction of its cold start.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from tests.servers import llmgw_up
from tests.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")

COLD_START_S = 4.0
FLEET = f"""\
fabrics: [ib-a]
nodes:
  - {{count: 1, class: cpu, cpu_slots: 4, fabric: ib-a}}
models:
  - {{name: base, engine: sim, gpu_classes: [cpu], min_replicas: 1,
     sim: {{startup_s: 0.2, decode_ms_per_token: 1, max_loras: 2, lora_load_s: 0.5}}}}
  - {{name: ad-a, engine: sim, base: base, min_replicas: 0, idle_timeout_s: 600}}
  - {{name: ad-b, engine: sim, base: base, min_replicas: 0, idle_timeout_s: 600}}
  - {{name: ad-c, engine: sim, base: base, min_replicas: 0, idle_timeout_s: 600}}
  - {{name: sleepy, engine: sim, gpu_classes: [cpu], min_replicas: 0, max_replicas: 1,
     idle_timeout_s: 2,
     sim: {{startup_s: {COLD_START_S}, decode_ms_per_token: 1, sleep_s: 0.1, wake_s: 0.2}}}}
"""
CHAT: Any = [{"role": "user", "content": "hi"}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def up(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("adapters")
    (root / "fleet.yaml").write_text(FLEET)
    async with llmgw_up(root, "--sim", str(root / "fleet.yaml"), within_s=60) as running:
        yield running.info


def clients(info: dict[str, Any]) -> tuple[openai.AsyncOpenAI, httpx.AsyncClient]:
    api = openai.AsyncOpenAI(base_url=info["api_url"], api_key=info["api_key"],
                             max_retries=0, timeout=60)  # fmt: skip
    admin = httpx.AsyncClient(base_url=info["admin_url"], timeout=10,
                              headers={"Authorization": f"Bearer {info['admin_token']}"})
    return api, admin


async def loaded(admin: httpx.AsyncClient, model: str) -> list[str]:
    replicas = (await admin.get("/admin/v1/replicas")).json()
    return [name for r in replicas if r["model"] == model for name in r["adapters"]]


async def test_adapters_are_listed_loaded_on_demand_and_unloaded_lru(
    up: dict[str, Any],
) -> None:
    api, admin = clients(up)
    async with admin:

        async def base_ready() -> bool:
            replicas = (await admin.get("/admin/v1/replicas")).json()
            return any(r["model"] == "base" and r["state"] == "ready" for r in replicas)

        await eventually(base_ready, 30, what="the base model's replica ready")
        listed = {m.id: m for m in (await api.models.list()).data}
        assert getattr(listed["ad-a"], "parent", None) == "base"
        assert getattr(listed["base"], "parent", None) is None

        answers = {}
        for name in ("ad-a", "ad-b"):
            began = time.monotonic()
            answer = await api.chat.completions.create(model=name, messages=CHAT, max_tokens=3)
            answers[name] = time.monotonic() - began
            assert answer.model == name
        # Each waited for its load (lora_load_s 0.5) behind the gateway's hold.
        assert all(took >= 0.5 for took in answers.values()), answers
        assert sorted(await loaded(admin, "base")) == ["ad-a", "ad-b"]
        again = time.monotonic()
        await api.chat.completions.create(model="ad-b", messages=CHAT, max_tokens=3)
        assert time.monotonic() - again < 0.5  # loaded: no wait

        # A third adapter: two slots, so ad-a (least recently used) makes room.
        answer = await api.chat.completions.create(model="ad-c", messages=CHAT, max_tokens=3)
        assert answer.model == "ad-c"

        seen: list[Any] = []

        async def lru_out() -> bool:
            seen[:] = [await loaded(admin, "base"), (await admin.get("/admin/v1/replicas")).json()]
            return sorted(seen[0]) == ["ad-b", "ad-c"]

        await eventually(lru_out, 10, what="ad-a unloaded, ad-b and ad-c loaded",
                         note=lambda: seen)
        summary = (await admin.get("/admin/v1/summary")).json()
        (base,) = summary["adapters"]
        assert base["base"] == "base" and base["adapters"] == 3
        assert base["slots_per_replica"] == 2
        assert sorted(n for names in base["loaded"].values() for n in names) == ["ad-b", "ad-c"]
        plan = (await admin.get("/admin/v1/plan")).json()
        assert plan["adapters"][0]["base"] == "base"

        # Back to ad-a: loaded again (ad-b is now the least recently used).
        answer = await api.chat.completions.create(model="ad-a", messages=CHAT, max_tokens=3)
        assert answer.model == "ad-a"

        async def usage_names_them() -> bool:
            groups = (await admin.get("/admin/v1/usage")).json()["by_key_model"]
            return {"ad-a", "ad-b", "ad-c"} <= {g["model"] for g in groups if g["requests"]}

        await eventually(usage_names_them, 15, what="usage per adapter")
    await api.close()


async def test_a_key_limited_to_an_adapter_reaches_it_and_nothing_else(
    up: dict[str, Any],
) -> None:
    _, admin = clients(up)
    async with admin:
        created = (await admin.post("/admin/v1/keys", json={"name": "sql-team",
                                                             "models": ["ad-a"]})).json()
        api = openai.AsyncOpenAI(base_url=up["api_url"], api_key=created["secret"],
                                 max_retries=0, timeout=60)  # fmt: skip

        async def served() -> bool:  # the new key reaches the gateway with the next config
            try:
                await api.chat.completions.create(model="ad-a", messages=CHAT, max_tokens=2)
            except openai.AuthenticationError:
                return False
            return True

        await eventually(served, 15, what="the adapter answered with the limited key")
        assert [m.id for m in (await api.models.list()).data] == ["ad-a"]
        for other in ("ad-b", "base"):
            with pytest.raises(openai.NotFoundError):
                await api.chat.completions.create(model=other, messages=CHAT, max_tokens=2)
    await api.close()


async def test_an_idle_model_sleeps_instead_of_stopping_and_wakes_fast(
    up: dict[str, Any],
) -> None:
    api, admin = clients(up)
    async with admin:
        began = time.monotonic()
        await api.chat.completions.create(model="sleepy", messages=CHAT, max_tokens=2)
        cold = time.monotonic() - began
        assert cold >= COLD_START_S

        async def asleep() -> list[dict[str, Any]] | None:
            replicas = [r for r in (await admin.get("/admin/v1/replicas")).json()
                        if r["model"] == "sleepy"]  # fmt: skip
            return replicas if replicas and all(r["asleep"] for r in replicas) else None

        (sleeping,) = await eventually(asleep, 30, what="the idle replica asleep")
        assert sleeping["state"] == "ready"  # kept, not stopped
        began = time.monotonic()
        await api.chat.completions.create(model="sleepy", messages=CHAT, max_tokens=2)
        woke = time.monotonic() - began
        replicas = [r for r in (await admin.get("/admin/v1/replicas")).json()
                    if r["model"] == "sleepy"]  # fmt: skip
        assert [r["id"] for r in replicas] == [sleeping["id"]]  # the same engine, woken
        assert woke < cold / 2, (woke, cold)
    await api.close()
