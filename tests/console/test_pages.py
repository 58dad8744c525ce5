"""Every console page against a real control plane, in Debian's chromium.

Each test reads a page, then the admin API, and compares: the console must
show exactly the numbers the API gives. Actions (unpark, cordon, apply) are
clicked on the page and checked through the API afterwards. A screenshot of
each page is saved under $LLMGW_TEST_OUTPUT/console/.
"""

from __future__ import annotations

import csv
import io
import re
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx
import pytest
from playwright.async_api import Page, Request, expect
from tests.console.conftest import Console, Plane, Watched, sign_in
from tests.console.fleet import (
    ECC_REASON,
    MIG_CLASS,
    NOT_CARVED,
    PARK_ERROR,
    UNPLACEABLE_REASON,
)
from tests.servers import free_port, serve_asgi

from llmgw.control.app import create_app
from llmgw.control.plane import ControlPlane
from llmgw.control.state import NodeFailure
from llmgw.control.store.repo import Store
from llmgw.wire import NodeState

pytestmark = pytest.mark.asyncio(loop_scope="module")


def read(path: Path | str) -> bytes:
    return Path(path).read_bytes()


async def texts(page: Page, selector: str) -> list[str]:
    return [t.strip() for t in await page.locator(selector).all_inner_texts()]


async def test_sign_in_refuses_a_wrong_token_and_401_returns_to_the_form(
    console: Console, watched: Watched
) -> None:
    page = watched.page
    # The browser itself logs a failed 401 load: expected exactly here.
    watched.allow(r"401 \(Unauthorized\)")
    await page.goto(f"{console.url}/console/")
    await expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    await expect(page.locator("#nav")).to_be_hidden()

    await page.get_by_label("Admin token").fill("llmgw-admin-not-the-token")
    await page.get_by_role("button", name="Sign in").click()
    await expect(page.locator("#signin-error")).to_contain_text("refused the admin token")
    assert await page.evaluate("sessionStorage.length") == 0

    await page.get_by_label("Admin token").fill(console.admin_token)
    await page.get_by_role("button", name="Sign in").click()
    await expect(page.get_by_role("heading", name="Fleet overview")).to_be_visible()
    # The token survives a reload of the tab (sessionStorage) ...
    await page.reload()
    await expect(page.get_by_role("heading", name="Fleet overview")).to_be_visible()
    # ... and a token the control plane stops accepting (rotated) sends the
    # next poll back to the form with the reason.
    await page.evaluate("sessionStorage.setItem('llmgw.adminToken', 'llmgw-admin-rotated')")
    await expect(page.get_by_role("heading", name="Sign in")).to_be_visible(timeout=8000)
    await expect(page.locator("#signin-error")).to_contain_text("Sign in again")
    assert await page.evaluate("sessionStorage.getItem('llmgw.adminToken')") is None


async def test_every_request_is_local_and_api_calls_carry_the_token(
    console: Console, watched: Watched
) -> None:
    page = watched.page
    urls: list[str] = []
    tokens: list[str | None] = []

    def on_request(req: Request) -> None:
        urls.append(req.url)
        if "/admin/v1/" in req.url:
            tokens.append(req.headers.get("authorization"))

    page.on("request", on_request)
    await sign_in(console, page)
    await expect(page.locator("#node-totals")).to_be_visible()
    for name in ("Nodes", "Models", "Replicas", "Plan", "Usage", "Events"):
        await page.get_by_role("link", name=name, exact=True).click()
        await expect(page.get_by_role("heading", level=1)).to_have_text(name)
        await expect(page.locator("#status")).to_contain_text("Updated")
    # Air-gapped: everything the console loads comes from the control plane.
    assert urls and all(u.startswith(console.url + "/") for u in urls), urls
    assert any(u.endswith("/console/static/favicon.svg") for u in urls)
    assert tokens and set(tokens) == {f"Bearer {console.admin_token}"}


async def test_overview_shows_the_summary(console: Console, watched: Watched, shots: Path) -> None:
    page = watched.page
    await sign_in(console, page)
    await expect(page.locator("#gpu-bars .bar-row").first).to_be_visible()
    summary = await console.get("/summary")
    models = {m["name"]: m for m in await console.get("/models")}

    totals = await texts(page, "#node-totals .stat")
    for state in ("total", "ready", "cordoned", "draining", "unreachable"):
        assert f"{summary['nodes'][state]}\n{state}" in totals
    assert summary["nodes"]["unreachable"] >= 1  # gpu-c1 never reported
    # Every replica in one of the totals: the one on gpu-c1 as unreachable.
    totals = await texts(page, "#replica-totals .stat")
    for state in ("ready", "starting", "draining", "failed", "unreachable"):
        assert f"{summary['replicas'][state]}\n{state}" in totals
    assert summary["replicas"]["unreachable"] == 1

    classes = [g["class"] for g in summary["gpus"]]
    assert MIG_CLASS in classes and "a100-80g" in classes and "h100-80g" in classes
    for g in summary["gpus"]:
        row = page.locator(f'#gpu-bars .bar-row[data-class="{g["class"]}"]')
        await expect(row.locator(".f-used")).to_have_text(f"{g['used']} used")
        await expect(row.locator(".f-unhealthy")).to_have_text(f"{g['unhealthy']} unhealthy")
        await expect(row.locator(".f-free")).to_have_text(f"{g['free']} free")
        await expect(row.locator(".f-total")).to_have_text(str(g["total"]))
    a100 = next(g for g in summary["gpus"] if g["class"] == "a100-80g")
    assert a100["unhealthy"] >= 1  # the card with ECC errors is not free

    assert [f["fabric"] for f in summary["fabrics"]] == ["ib-a", "ib-b"]
    for f in summary["fabrics"]:
        cells = await texts(page, f'#fabrics tr[data-fabric="{f["fabric"]}"] td')
        assert cells == [
            f["fabric"], str(f["nodes"]), str(f["nodes_with_weights"]),
            str(f["models_present"]), str(f["largest_free_block"]),
        ]

    assert summary["unplaceable"] == ["big-model"]
    unplaceable = page.locator('#unplaceable li[data-model="big-model"]')
    await expect(unplaceable).to_contain_text(models["big-model"]["unplaceable_reason"])
    assert models["big-model"]["unplaceable_reason"] == UNPLACEABLE_REASON

    assert [p["model"] for p in summary["parked"]] == ["broken"]
    parked = page.locator('#parked tr[data-model="broken"]')
    await expect(parked).to_contain_text(PARK_ERROR)
    await expect(parked.locator("td").nth(1)).to_have_text(str(summary["parked"][0]["failures"]))
    await expect(parked.get_by_role("button", name="Unpark broken")).to_be_visible()

    assert [i["id"] for i in summary["idle_replicas"]] == ["r-chat-1"]
    idle = page.locator('#idle tr[data-replica="r-chat-1"] td')
    assert (await idle.all_inner_texts())[1:] == [
        "chat-small", f"{summary['idle_replicas'][0]['idle_seconds'] // 60} min",
        str(summary["idle_replicas"][0]["gpus"]),
    ]
    # The store's members, as Patroni reported them through the summary.
    assert [m["name"] for m in summary["store"]] == ["pg-1", "pg-2", "pg-3"]
    assert summary["store_error"] is None
    store_rows = await page.locator("#store tbody tr").evaluate_all(
        "rows => rows.map(r => [...r.cells].map(c => c.innerText.trim()))"
    )
    assert store_rows == [
        [m["name"], m["host"], m["role"], m["state"],
         "unknown" if m["lag"] < 0 else f"{m['lag']:,}"]
        for m in summary["store"]
    ]
    await page.screenshot(path=shots / "overview.png", full_page=True)


async def test_unpark_from_the_overview(console: Console, watched: Watched) -> None:
    page = watched.page
    await sign_in(console, page)
    await page.get_by_role("button", name="Unpark broken").click()
    await expect(page.locator("#parked")).to_contain_text("No parked models.")
    broken = await console.get("/models/broken")
    assert broken["parked"] is False
    assert broken["failures"] == 0
    assert (await console.get("/summary"))["parked"] == []
    # Parked again for the other tests, through the service as the reconciler would.
    cp = console.fleet.cp
    model = cp.state.models["broken"]
    model.parked, model.failures, model.last_error = True, 5, PARK_ERROR


async def test_nodes_page_maps_devices_like_the_api(
    console: Console, watched: Watched, shots: Path
) -> None:
    page = watched.page
    await sign_in(console, page, "#/nodes")
    await expect(page.locator('article[data-node="gpu-a1"]')).to_be_visible()
    nodes = {n["name"]: n for n in await console.get("/nodes")}
    shown = await page.locator("article.node").evaluate_all("els => els.map(e => e.dataset.node)")
    assert sorted(shown) == sorted(nodes)
    for name, node in nodes.items():
        card = page.locator(f'article[data-node="{name}"]')
        await expect(card.locator(".badge").first).to_have_text(node["state"])
        boxes = await card.locator("li.dev").evaluate_all(
            "els => els.map(e => [e.dataset.device, e.dataset.status])"
        )
        # Every device once, with the API's status (the page orders them by card).
        assert sorted(boxes) == sorted([d["label"], d["status"]] for d in node["devices"])

    a1 = page.locator('article[data-node="gpu-a1"]')
    # MIG instances labelled card/migN, with the replica that holds one.
    await expect(a1.locator('li[data-device="0/mig0"]')).to_contain_text("used by r-chat-1")
    mig1 = await a1.locator('li[data-device="0/mig1"]').inner_text()
    assert mig1.split("\n") == ["0/mig1", "3g.40gb", "free"]
    # A whole card carries its own temperature and power.
    card1 = await a1.locator('li[data-device="1"]').inner_text()
    assert card1.split("\n") == ["1", "a100-80g", "used by r-embed-1", "47 °C · 180 W"]
    await expect(a1.locator('li[data-device="2"]')).to_have_attribute("data-status", "unhealthy")
    await expect(a1.locator(".reasons")).to_contain_text(f"2 unhealthy: {ECC_REASON}")
    await expect(a1.locator('[data-card="card 0"]')).to_contain_text("51 °C · 210 W")
    b1 = page.locator('article[data-node="gpu-b1"]')
    await expect(b1.locator('li[data-device="1"]')).to_have_attribute("data-status", "unplaceable")
    await expect(b1.locator(".reasons")).to_contain_text(f"1 out of placement: {NOT_CARVED}")
    await page.screenshot(path=shots / "nodes.png", full_page=True)

    # Filters: by state, by class, by name; the address keeps them.
    await page.get_by_label("State").select_option("unreachable")
    await expect(page.locator("article.node")).to_have_count(1)
    await expect(page.locator('article[data-node="gpu-c1"]')).to_be_visible()
    await page.get_by_label("State").select_option("")
    await page.get_by_label("Device class").select_option(MIG_CLASS)
    await expect(page.locator("article.node")).to_have_count(1)
    await expect(page).to_have_url(re.compile(r"#/nodes\?class=a100-80g-mig-3g\.40gb$"))
    await page.get_by_label("Device class").select_option("")
    await page.get_by_label("Name").fill("gpu-b")
    await expect(page.locator("article.node")).to_have_count(2)
    await expect(page.locator("#node-count")).to_contain_text("of 2 nodes (5 in all)")


async def test_cordon_uncordon_drain_from_the_nodes_page(
    console: Console, watched: Watched
) -> None:
    page = watched.page
    await sign_in(console, page, "#/nodes?q=gpu-a2")
    card = page.locator('article[data-node="gpu-a2"]')
    await card.get_by_role("button", name="Cordon gpu-a2").click()
    await expect(card.locator(".badge").first).to_have_text("cordoned")
    assert (await console.get("/nodes/gpu-a2"))["state"] == "cordoned"
    assert (await console.get("/summary"))["nodes"]["cordoned"] == 1

    await card.get_by_role("button", name="Uncordon gpu-a2").click()
    await expect(card.locator(".badge").first).to_have_text("ready")
    assert (await console.get("/nodes/gpu-a2"))["state"] == "ready"

    # Drain asks for a second click before it moves replicas away.
    await card.get_by_role("button", name="Drain gpu-a2").click()
    assert (await console.get("/nodes/gpu-a2"))["state"] == "ready"
    await card.get_by_role("button", name="Confirm drain of gpu-a2").click()
    await expect(card.locator(".badge").first).to_have_text("draining")
    assert (await console.get("/nodes/gpu-a2"))["state"] == "draining"
    await card.get_by_role("button", name="Uncordon gpu-a2").click()
    await expect(card.locator(".badge").first).to_have_text("ready")


async def listed(console: Console, page: Page, path: str, table: str) -> list[dict[str, Any]]:
    """What the admin API lists at ``path``, once ``table`` on the page has a row for each."""
    items: list[dict[str, Any]] = await console.get(path)
    await expect(page.locator(f"{table} tbody tr")).to_have_count(len(items))
    return items


async def test_models_page_and_apply_with_inline_errors(
    console: Console, watched: Watched, shots: Path
) -> None:
    page = watched.page
    await sign_in(console, page, "#/models")
    models = await listed(console, page, "/models", "#model-list")
    for m in models:
        row = page.locator(f'#model-list tr[data-model="{m["name"]}"]')
        cells = await row.locator("td").all_inner_texts()
        assert cells[4:7] == [str(m["desired"]), str(m["ready"]), str(m["starting"])]
    chat = page.locator('#model-list tr[data-model="chat-small"]')
    await expect(chat).to_contain_text("r-chat-1")
    await expect(chat).to_contain_text("gpu-a1:0/mig0")
    await expect(page.locator('#model-list tr[data-model="broken"]')).to_contain_text(PARK_ERROR)
    await page.screenshot(path=shots / "models.png", full_page=True)

    # A MIG class with tp 2 is refused, inline, naming the field.
    watched.allow(r"422 \(Unprocessable")
    editor = page.get_by_label("Entry (YAML")
    await editor.fill(
        f"name: wide-mig\nengine: sim\ngpu_classes: [{MIG_CLASS}]\ngpus: 2\ntp: 2\n"
    )
    await page.get_by_role("button", name="Dry run").click()
    errors = page.locator("#apply-errors")
    await expect(errors).to_contain_text("wide-mig")
    await expect(errors).to_contain_text("tp")
    await expect(page.get_by_role("button", name="Apply", exact=True)).to_be_disabled()
    await page.screenshot(path=shots / "models-invalid.png", full_page=True)

    await editor.fill("name: new-model\nengine: sim\ngpu_classes: [a100-80g]\nmin_replicas: 0\n")
    await page.get_by_role("button", name="Dry run").click()
    await expect(page.locator("#apply-result")).to_contain_text("new-model")
    assert "new-model" not in {m["name"] for m in await console.get("/models")}
    await page.get_by_role("button", name="Apply", exact=True).click()
    await expect(page.locator("#apply-result")).to_contain_text("Applied")
    await expect(page.locator('#model-list tr[data-model="new-model"]')).to_be_visible()
    assert "new-model" in {m["name"] for m in await console.get("/models")}
    await console.fleet.cp.catalog.delete("new-model")


async def test_replicas_page(console: Console, watched: Watched, shots: Path) -> None:
    page = watched.page
    await sign_in(console, page, "#/replicas")
    replicas = await listed(console, page, "/replicas", "#replica-list")
    for r in replicas:
        row = page.locator(f'#replica-list tr[data-replica="{r["id"]}"]')
        await expect(row.locator(".badge").first).to_have_text(r["state"])
        for s in r["shards"]:
            await expect(row).to_contain_text(f"{s['node']}: {', '.join(s['devices'])}")
    llama = page.locator('#replica-list tr[data-replica="r-llama-1"]')
    await expect(llama).to_contain_text("weights 34.0 GB of 100.0 GB (34 %)")
    await expect(llama).to_contain_text("waiting for weights 34 %")
    await llama.get_by_text("Engine log").click()
    await expect(llama.locator("pre.log")).to_contain_text("model-00002-of-00004")
    # The open log stays open across a refresh.
    await page.wait_for_timeout(4500)
    await expect(llama.locator("pre.log")).to_be_visible()
    await page.screenshot(path=shots / "replicas.png", full_page=True)
    await page.get_by_label("State").select_option("starting")
    await expect(page.locator("#replica-list tbody tr")).to_have_count(
        sum(1 for r in replicas if r["state"] == "starting")
    )


async def test_usage_page(console: Console, watched: Watched, shots: Path) -> None:
    page = watched.page
    await sign_in(console, page, "#/usage")
    await expect(page.locator("#usage-by-model tbody tr").first).to_be_visible()
    since = int(time.time()) // 60 * 60 - 3600
    answer = await console.get("/usage", since=since)
    per_model: dict[str, list[int]] = {}
    for r in answer["by_key_model"]:
        t = per_model.setdefault(r["model"], [0, 0, 0])
        t[0] += r["requests"]
        t[1] += r["prompt_tokens"]
        t[2] += r["completion_tokens"]
    assert set(per_model) == {"embed", "chat-small"}
    for model, (requests, prompt, completion) in per_model.items():
        cells = await page.locator(f'#usage-by-model tr[data-name="{model}"] td').all_inner_texts()
        assert cells[1:4] == [f"{requests:,}", f"{prompt:,}", f"{completion:,}"]
    await expect(page.locator("#usage-by-key tbody tr")).to_have_count(2)
    # Neither key is in a team: all of it is the operator's.
    await expect(page.locator("#usage-by-team tbody tr")).to_have_count(1)
    operator = page.locator('#usage-by-team tr[data-name="(operator)"] td')
    team_cells = await operator.all_inner_texts()
    total = sum(t[0] for t in per_model.values())
    assert team_cells[1] == f"{total:,}"
    # Four charts, each with one line per model or key.
    await expect(page.locator("#usage-charts figure")).to_have_count(4)
    await expect(page.locator("#usage-charts figure").first.locator("path.series")).to_have_count(2)
    await page.screenshot(path=shots / "usage.png", full_page=True)


async def test_download_csv_of_the_range_by_model_and_by_day(
    console: Console, watched: Watched, shots: Path
) -> None:
    page = watched.page
    asked: list[Request] = []
    page.on("request", lambda r: asked.append(r) if "/usage/report" in r.url else None)
    await sign_in(console, page, "#/usage")
    await expect(page.locator("#usage-by-model tbody tr").first).to_be_visible()
    await page.get_by_label("CSV by").select_option("model")
    async with page.expect_download() as info:
        await page.get_by_role("button", name="Download CSV").click()
    download = await info.value
    saved = read(await download.path())

    # It went with the admin token, for the range the page shows (last hour).
    assert len(asked) == 1
    assert asked[0].headers["authorization"] == f"Bearer {console.admin_token}"
    query = {k: v[0] for k, v in parse_qs(urlparse(asked[0].url).query).items()}
    assert query["by"] == "model" and query["format"] == "csv"
    assert int(query["until"]) - int(query["since"]) in range(3600, 3660)
    # The control plane's CSV for that window, byte for byte, under its name.
    answer = await console.api.get("/admin/v1/usage/report", params=query)
    assert saved == answer.content
    assert download.suggested_filename.startswith("llmgw-usage-")
    assert download.suggested_filename.endswith("-by-model.csv")
    rows = {r["model"]: r for r in csv.DictReader(io.StringIO(saved.decode()))}
    # The same totals as the page's table of the same hour.
    for model in ("embed", "chat-small"):
        cells = await page.locator(f'#usage-by-model tr[data-name="{model}"] td').all_inner_texts()
        assert f"{int(rows[model]['requests']):,}" == cells[1]
        assert f"{int(rows[model]['prompt_tokens']):,}" == cells[2]

    await page.get_by_label("CSV by").select_option("day,key,model")
    async with page.expect_download() as info:
        await page.get_by_role("button", name="Download CSV").click()
    by_all = list(csv.DictReader(io.StringIO(read(await (await info.value).path()).decode())))
    assert by_all and set(by_all[0]) == {"day", "key_id", "key_name", "model", "requests",
                                         "prompt_tokens", "completion_tokens", "cached_tokens",
                                         "errors", "spend_usd"}
    assert sum(int(r["requests"]) for r in by_all) == sum(int(r["requests"])
                                                          for r in rows.values())
    await expect(page.locator("#usage-csv-error")).to_be_empty()
    await page.screenshot(path=shots / "usage-download.png", full_page=True)


async def test_events_page(console: Console, watched: Watched, shots: Path) -> None:
    page = watched.page
    await sign_in(console, page, "#/events")
    await expect(page.locator("#event-list tbody tr").first).to_be_visible()
    events = await console.get("/events", limit=500)
    await expect(page.locator("#event-list tbody tr")).to_have_count(len(events))
    await page.screenshot(path=shots / "events.png", full_page=True)
    await page.get_by_label("Kind").select_option("parked")
    await expect(page.locator("#event-list tbody tr")).to_have_count(
        sum(1 for e in events if e["kind"] == "parked")
    )
    await expect(page.locator("#event-list tbody tr").first).to_contain_text("broken")
    await expect(page).to_have_url(re.compile(r"#/events\?kind=parked$"))


async def test_plan_page_and_what_if(console: Console, watched: Watched, shots: Path) -> None:
    page = watched.page
    await sign_in(console, page, "#/plan")
    await expect(page.locator("#plan-models tbody tr").first).to_be_visible()
    plan = await console.get("/plan")
    await expect(page.locator("#plan-models tbody tr")).to_have_count(len(plan["models"]))
    for m in plan["models"]:
        row = page.locator(f'#plan-models tr[data-model="{m["name"]}"]')
        await expect(row.locator(".badge")).to_have_text(m["status"])
        if m["reason"]:
            await expect(row).to_contain_text(m["reason"])
    for d in plan["devices"]:
        row = page.locator(f'#plan-devices tr[data-class="{d["gpu_class"]}"] td')
        cells = await row.all_inner_texts()
        assert cells == [d["gpu_class"], *(f"{d[k]:,}" for k in (
            "total", "used", "unhealthy", "out_of_placement", "free", "free_ready", "free_after"))]
    await page.screenshot(path=shots / "plan.png", full_page=True)

    await page.get_by_label("Model entry to try").fill(
        "name: try-mig\nengine: sim\ngpu_classes: [a100-80g-mig-3g.40gb]\n"
    )
    await page.get_by_role("button", name="What if").click()
    result = page.locator('#whatif-result tr[data-model="try-mig"]')
    await expect(result).to_be_visible()
    answer = await console.api.post("/admin/v1/plan", json={
        "document": "name: try-mig\nengine: sim\ngpu_classes: [a100-80g-mig-3g.40gb]\n"})
    expected = next(m for m in answer.json()["models"] if m["name"] == "try-mig")
    await expect(result.locator(".badge")).to_have_text(expected["status"])
    for r in expected["replicas"]:
        await expect(result).to_contain_text(" ".join(r["devices"]))
    assert "try-mig" not in {m["name"] for m in await console.get("/models")}
    await page.screenshot(path=shots / "plan-what-if.png", full_page=True)


def _any_spans(text: str) -> re.Pattern[str]:
    """``text`` as a pattern in which every time span ("40 s", "3 min") matches any span."""
    escaped = re.escape(text)
    return re.compile("^" + re.sub(r"\d+\\ (s|min|h)\b", r"\\d+\\ (s|min|h)", escaped) + "$")


async def test_plan_page_shows_the_nodes_a_model_avoids_after_failures(
    console: Console, watched: Watched, shots: Path
) -> None:
    page = watched.page
    embed = console.fleet.cp.state.models["embed"]
    # Memory only, as the last pass left it; no reconciler runs here to change it.
    embed.node_failures = {"gpu-b2": NodeFailure(failures=2, last_at=time.time() - 40)}
    try:
        plan = await console.get("/plan")
        avoided = next(m for m in plan["models"] if m["name"] == "embed")["avoided"]
        assert len(avoided) == 1 and avoided[0].startswith("gpu-b2: model embed failed there 2")
        await sign_in(console, page, "#/plan")
        lines = page.locator('#plan-models tr[data-model="embed"] .avoided li')
        # The page fetches the plan itself, a few seconds after this test did: the
        # "last N s ago" and "avoided for N min" spans have moved on by then.
        await expect(lines).to_have_text([_any_spans(a) for a in avoided])
        await expect(page.locator('#plan-models tr[data-model="embed"] .avoided')).to_contain_text(
            "Nodes avoided after failures:")
        # Models with nothing avoided show no such list.
        await expect(page.locator("#plan-models .avoided")).to_have_count(1)
        await page.screenshot(path=shots / "plan-avoided.png", full_page=True)
    finally:
        embed.node_failures = {}


async def test_pages_update_live_and_pause_while_hidden(
    console: Console, watched: Watched
) -> None:
    page = watched.page
    calls: list[float] = []
    page.on("request", lambda req: calls.append(time.monotonic())
            if "/admin/v1/summary" in req.url else None)
    await sign_in(console, page)
    cordoned = page.locator("#node-totals .stat").filter(has_text="cordoned").locator(".stat-value")
    await expect(cordoned).to_have_text("0")
    # A change made elsewhere (ctl, another console) shows up without a reload.
    await console.fleet.cp.nodes.set_state("gpu-b2", NodeState.CORDONED)
    try:
        await expect(cordoned).to_have_text("1", timeout=8000)
    finally:
        await console.fleet.cp.nodes.set_state("gpu-b2", NodeState.READY)

    # Hidden tab: no polling at all.
    await page.evaluate(
        """() => {
            Object.defineProperty(document, 'hidden', {configurable: true, get: () => true});
            Object.defineProperty(document, 'visibilityState',
                                  {configurable: true, get: () => 'hidden'});
            document.dispatchEvent(new Event('visibilitychange'));
        }"""
    )
    await page.wait_for_timeout(500)  # a refresh already on the wire may land
    hidden_at = time.monotonic()
    await page.wait_for_timeout(6000)  # one and a half poll intervals
    assert [t for t in calls if t > hidden_at] == []
    # Visible again: it refreshes at once, showing the state as it is now.
    await page.evaluate(
        """() => {
            delete document.hidden;
            delete document.visibilityState;
            document.dispatchEvent(new Event('visibilitychange'));
        }"""
    )
    await expect(cordoned).to_have_text("0", timeout=2000)
    assert [t for t in calls if t > hidden_at]


async def test_an_empty_fleet_and_an_unreadable_store(
    tmp_path: Path, watched: Watched, shots: Path
) -> None:
    """A first start: no nodes, no models, no usage; Patroni down. Every page still loads."""
    store = await Store.open("sqlite:///" + str(tmp_path / "empty.db"))
    try:
        cp = ControlPlane(store)
        await cp.load()
        creds = await cp.ensure_credentials(first_api_key=False)
        assert creds.admin_token
        with pytest.MonkeyPatch.context() as env:
            env.setenv("LLMGW_PATRONI_URL", f"http://127.0.0.1:{free_port()}")
            app = create_app(cp)
        async with serve_asgi(app) as url, httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {creds.admin_token}"}
        ) as api:
            empty = Plane(url=url, admin_token=creds.admin_token, api=api)
            page = watched.page
            await sign_in(empty, page)
            summary = await empty.get("/summary")
            assert summary["store_error"]
            await expect(page.locator("#store-error")).to_contain_text(summary["store_error"])
            await expect(page.locator("#gpu-bars")).to_contain_text("No devices reported yet.")
            await page.screenshot(path=shots / "overview-empty.png", full_page=True)
            for name, text in (("Nodes", "No node has registered yet."),
                               ("Models", "The catalog is empty"),
                               ("Replicas", "0 of 0 replicas"),
                               ("Plan", "No models in the catalog."),
                               ("Usage", "No requests in this range."),
                               ("Events", "events")):
                await page.get_by_role("link", name=name, exact=True).click()
                await expect(page.locator("#page")).to_contain_text(text)
                await expect(page.locator("#status")).to_contain_text("Updated")
    finally:
        await store.close()


async def test_models_page_shows_an_external_models_urls_and_their_health(
    console: Console, watched: Watched, shots: Path
) -> None:
    from llmgw.control.external import endpoint_id
    from llmgw.wire import GatewayLoadReport, ModelSpec, ReplicaLoad

    cp = console.fleet.cp
    urls = ["http://10.0.0.5:8000", "https://api.example.com/openai"]
    spec = ModelSpec.model_validate(
        {"name": "team-vllm", "external": {"urls": urls, "model": "meta/llama-x",
                                           "api_key_env": "TEAM_VLLM_KEY"}}
    )  # fmt: skip
    await cp.catalog.put([spec])
    loads = [ReplicaLoad(replica_id=endpoint_id("team-vllm", urls[0]), up=True),
             ReplicaLoad(replica_id=endpoint_id("team-vllm", urls[1]), up=False,
                         reason="connect to api.example.com:443: refused")]  # fmt: skip
    await cp.gateways.record_load(GatewayLoadReport(gateway_id="g1", replicas=loads))
    try:
        page = watched.page
        await sign_in(console, page, "#/models")
        row = page.locator('#model-list tr[data-model="team-vllm"]')
        # all_inner_texts does not wait: the row is there once the page's first fetch has drawn.
        await expect(row.locator("td").nth(1)).to_have_text("external")
        (view,) = [m for m in await console.get("/models") if m["name"] == "team-vllm"]
        cells = await row.locator("td").all_inner_texts()
        assert cells[1] == "external" and "meta/llama-x" in cells[2]
        assert cells[4:7] == [str(view["desired"]), str(view["ready"]), str(view["starting"])]
        assert cells[4:7] == ["2", "1", "0"]
        await expect(row.locator(".badge").first).to_have_text("degraded")
        await expect(row).to_contain_text(f"{urls[0]} up")
        await expect(row).to_contain_text(f"{urls[1]} down")
        await expect(row).to_contain_text("refused")
        await row.screenshot(path=shots / "models-external.png")
    finally:
        await cp.catalog.delete("team-vllm")


async def test_models_page_shows_adapters_under_their_base(
    console: Console, watched: Watched, shots: Path
) -> None:
    from llmgw.wire import ModelSpec

    cp = console.fleet.cp
    base = ModelSpec.model_validate({"name": "zz-base", "engine": "sim", "min_replicas": 0,
                                     "sim": {"max_loras": 2}})  # fmt: skip
    adapters = [ModelSpec.model_validate({"name": f"aa-{n}", "engine": "sim", "base": "zz-base",
                                          "min_replicas": 0, "adapter": {"rank": 8}})
                for n in ("sql", "chat")]  # fmt: skip
    await cp.catalog.put([base, *adapters])
    try:
        page = watched.page
        await sign_in(console, page, "#/models")
        adapter_row = page.locator('#model-list tr[data-model="aa-sql"]')
        await expect(adapter_row.locator("td").nth(2)).to_have_text(
            "LoRA rank 8 of zz-base (no devices of its own)"
        )
        order = await page.locator("#model-list tr[data-model]").evaluate_all(
            "rows => rows.map(r => r.dataset.model)"
        )
        # Listed by name the adapters (aa-...) would come first; they follow their base.
        at = order.index("zz-base")
        assert order[at : at + 3] == ["zz-base", "aa-chat", "aa-sql"]
        assert await adapter_row.get_attribute("data-base") == "zz-base"
        await expect(adapter_row.locator("td").first).to_contain_text("└ aa-sql")
        await expect(adapter_row.locator(".badge").first).to_have_text("idle")
        await expect(adapter_row).to_contain_text("loaded nowhere")
        await page.locator("#model-list").screenshot(path=shots / "models-adapters.png")
    finally:
        for spec in adapters:
            await cp.catalog.delete(spec.name)
        await cp.catalog.delete("zz-base")
