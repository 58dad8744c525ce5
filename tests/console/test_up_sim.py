"""The console on `llmgw up --sim`: the real command, a simulated fleet, real placements.

The fleet has cards in MIG mode, two fabrics and an unhealthy GPU on every
A100 node; the catalog has a model on MIG instances (placed by the real
reconciler and started by the real agents' sim engines), one that can never
fit and one that fails every start. Parking after five failures and a replica
idle for ten minutes take minutes of backoff and idleness that `llmgw up`
does not let a test shorten; test_pages.py covers those on a control plane
whose state the test writes directly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from playwright.async_api import Locator, expect
from tests.console.conftest import Plane, Watched, sign_in
from tests.servers import llmgw_up
from tests.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")

FLEET = """\
fabrics: [ib-a, ib-b]
nodes:
  - {count: 2, class: a100-80g, gpus: 4, fabric: ib-a, unhealthy: 1,
     mig: {cards: 1, profile: 3g.40gb, instances: 2}}
  - {count: 2, class: h100-80g, gpus: 2, fabric: ib-b}
"""
CATALOG = """\
models:
  - {name: sim-chat, engine: sim, gpu_classes: [a100-80g-mig-3g.40gb],
     min_replicas: 2, max_replicas: 2}
  - {name: sim-huge, engine: sim, gpu_classes: [h100-80g], gpus: 4, tp: 4}
  - {name: sim-broken, engine: sim, gpu_classes: [h100-80g], sim: {fault: fail_at_start}}
"""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def up(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Plane]:
    root = tmp_path_factory.mktemp("upsim")
    (root / "fleet.yaml").write_text(FLEET)
    async with llmgw_up(root, "--sim", str(root / "fleet.yaml"), within_s=30) as running:
        url, token = running.info["admin_url"], running.info["admin_token"]
        headers = {"Authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=10) as api:
            plane = Plane(url=url, admin_token=token, api=api)

            # Polled: the state is in another process, with nothing to wait on.
            async def registered() -> bool:
                return bool((await plane.get("/summary"))["nodes"]["ready"] == 4)

            await eventually(registered, 30, what="4 ready nodes")
            answer = await api.post("/admin/v1/apply", json={"document": CATALOG})
            assert answer.status_code == 200, answer.text

            async def chat_ready() -> bool:
                replicas = await plane.get("/replicas", model="sim-chat", state="ready")
                return len(replicas) == 2

            await eventually(chat_ready, 30, what="2 ready sim-chat replicas")
            yield plane


async def test_console_on_llmgw_up_sim(up: Plane, watched: Watched, shots: Path) -> None:
    page = watched.page
    await sign_in(up, page)
    await expect(page.locator("#gpu-bars .bar-row").first).to_be_visible()
    summary = await up.get("/summary")
    assert [g["class"] for g in summary["gpus"]] == [
        "a100-80g", "a100-80g-mig-3g.40gb", "h100-80g"]
    for g in summary["gpus"]:
        row = page.locator(f'#gpu-bars .bar-row[data-class="{g["class"]}"]')
        await expect(row.locator(".bar-figures")).to_have_text(
            f"{g['used']} used · {g['unhealthy']} unhealthy · {g['free']} free · of {g['total']}"
        )
    mig = next(g for g in summary["gpus"] if g["class"] == "a100-80g-mig-3g.40gb")
    assert mig["used"] == 2  # both sim-chat replicas, one instance each
    assert next(g for g in summary["gpus"] if g["class"] == "a100-80g")["unhealthy"] == 2
    for f in summary["fabrics"]:
        cells = await page.locator(f'#fabrics tr[data-fabric="{f["fabric"]}"] td').all_inner_texts()
        assert cells[1:] == [str(f[k]) for k in (
            "nodes", "nodes_with_weights", "models_present", "largest_free_block")]
    await expect(page.locator('#unplaceable li[data-model="sim-huge"]')).to_be_visible()
    await page.screenshot(path=shots / "up-sim-overview.png", full_page=True)

    await page.get_by_role("link", name="Nodes", exact=True).click()
    await expect(page.locator("article.node")).to_have_count(4)
    for name in [n["name"] for n in await up.get("/nodes")]:
        card = page.locator(f'article[data-node="{name}"]')
        # The fleet may still be placing (a replica lands between the page's
        # refresh and this read): compare until both have seen the same fleet.
        async def agreeing(name: str = name, card: Locator = card) -> Any:
            node = await up.get(f"/nodes/{name}")
            boxes = await card.locator("li.dev").evaluate_all(
                "els => els.map(e => [e.dataset.device, e.dataset.status, e.innerText])"
            )
            shown = sorted(b[:2] for b in boxes)
            agree = shown == sorted([d["label"], d["status"]] for d in node["devices"])
            return (node, boxes) if agree else None

        node, boxes = await eventually(
            agreeing, 20, what=f"the page and the API agreeing on {name}", every_s=0.5
        )
        for d in node["devices"]:
            if d["status"] == "used":
                text = next(b[2] for b in boxes if b[0] == d["label"])
                assert d["used_by"] in text
            if d["status"] == "unhealthy":
                await expect(card.locator(".reasons")).to_contain_text(d["unhealthy_reasons"][0])
    await page.screenshot(path=shots / "up-sim-nodes.png", full_page=True)

    card = page.locator('article[data-node="h100-80g-000"]')
    await card.get_by_role("button", name="Cordon h100-80g-000").click()
    await expect(card.locator(".badge").first).to_have_text("cordoned")
    assert (await up.get("/nodes/h100-80g-000"))["state"] == "cordoned"
    await card.get_by_role("button", name="Uncordon h100-80g-000").click()
    await expect(card.locator(".badge").first).to_have_text("ready")
    assert (await up.get("/nodes/h100-80g-000"))["state"] == "ready"

    await page.get_by_role("link", name="Models", exact=True).click()
    chat = page.locator('#model-list tr[data-model="sim-chat"]')
    await expect(chat.locator("td").nth(5)).to_have_text("2")
    await page.get_by_role("link", name="Plan", exact=True).click()
    huge = page.locator('#plan-models tr[data-model="sim-huge"]')
    await expect(huge.locator(".badge")).to_have_text("can never fit")
    plan = await up.get("/plan")
    reason = next(m["reason"] for m in plan["models"] if m["name"] == "sim-huge")
    await expect(huge).to_contain_text(reason)
    await page.screenshot(path=shots / "up-sim-plan.png", full_page=True)
