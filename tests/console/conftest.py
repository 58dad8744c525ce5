"""Console test harness: a real control plane on loopback and Debian's chromium.

One control plane and one browser per test module (starting chromium costs
about a second on two cores); each test gets a fresh browser context, so no
sessionStorage or page state leaks between tests. Every page's console
errors and uncaught exceptions are collected and fail the test unless the
test names the exact message it expects (a refused token is logged by the
browser itself as a failed 401 load).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from playwright.async_api import Browser, ConsoleMessage, Page, async_playwright
from starlette.applications import Starlette
from starlette.requests import Request as StarletteRequest
from starlette.responses import JSONResponse
from starlette.routing import Route
from tests.console.fleet import Fleet, build, keep_reporting
from tests.control.planekit import opened_plane
from tests.servers import serve_asgi

from llmgw.control.app import create_app

CHROMIUM = os.environ.get("LLMGW_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]


@dataclass
class Plane:
    """A control plane the browser is pointed at, and an admin API client for it."""

    url: str
    admin_token: str
    api: httpx.AsyncClient

    async def get(self, path: str, **params: Any) -> Any:
        answer = await self.api.get(f"/admin/v1{path}", params=params)
        answer.raise_for_status()
        return answer.json()


@dataclass
class Console(Plane):
    """An in-process control plane with the fleet of tests/console/fleet.py."""

    fleet: Fleet


@dataclass
class Watched:
    """A page with its console errors and uncaught exceptions collected."""

    page: Page
    errors: list[str] = field(default_factory=list)
    allowed: list[re.Pattern[str]] = field(default_factory=list)

    def allow(self, pattern: str) -> None:
        self.allowed.append(re.compile(pattern))

    def unexpected(self) -> list[str]:
        return [e for e in self.errors if not any(p.search(e) for p in self.allowed)]


# A replicated store as Patroni 4 describes it (lag in bytes, "unknown", or
# absent on the leader), for the overview's store section.
PATRONI_CLUSTER = {
    "scope": "llmgw",
    "members": [
        {"name": "pg-1", "role": "leader", "state": "running", "host": "127.0.0.11",
         "port": 5432, "timeline": 4},
        {"name": "pg-2", "role": "sync_standby", "state": "streaming", "host": "127.0.0.12",
         "port": 5432, "timeline": 4, "lag": 0},
        {"name": "pg-3", "role": "replica", "state": "streaming", "host": "127.0.0.13",
         "port": 5432, "timeline": 4, "lag": 1048576},
    ],
}


def fake_patroni() -> Starlette:
    async def cluster(_: StarletteRequest) -> JSONResponse:
        return JSONResponse(PATRONI_CLUSTER)

    return Starlette(routes=[Route("/cluster", cluster)])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def console(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Console]:
    async with opened_plane(tmp_path_factory.mktemp("console")) as (cp, creds):
        assert creds.admin_token and creds.join_token
        fleet = await build(cp, creds.join_token)
        async with serve_asgi(fake_patroni()) as patroni:
            with pytest.MonkeyPatch.context() as env:
                env.setenv("LLMGW_PATRONI_URL", patroni)
                app = create_app(cp)
            async with serve_asgi(app) as url, keep_reporting(cp, fleet.node_tokens):
                headers = {"Authorization": f"Bearer {creds.admin_token}"}
                async with httpx.AsyncClient(base_url=url, headers=headers, timeout=10) as api:
                    yield Console(url=url, admin_token=creds.admin_token, fleet=fleet, api=api)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def browser() -> AsyncIterator[Browser]:
    if not shutil.which(CHROMIUM):
        pytest.fail(f"chromium not found at {CHROMIUM}: apt-get install chromium "
                    "(scripts/setup.sh does it)")
    async with async_playwright() as pw:
        launched = await pw.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield launched
        finally:
            await launched.close()


@pytest_asyncio.fixture(loop_scope="module")
async def watched(browser: Browser) -> AsyncIterator[Watched]:
    context = await browser.new_context(viewport={"width": 1440, "height": 1000})
    page = await context.new_page()
    page.set_default_timeout(10_000)
    w = Watched(page)

    def on_console(msg: ConsoleMessage) -> None:
        if msg.type in ("error", "assert"):
            w.errors.append(f"console {msg.type}: {msg.text} ({msg.location.get('url', '')})")

    page.on("console", on_console)
    page.on("pageerror", lambda exc: w.errors.append(f"uncaught: {exc}"))
    try:
        yield w
    finally:
        await context.close()
    assert not w.unexpected(), "browser console errors:\n" + "\n".join(w.unexpected())


@pytest.fixture
def shots(test_output: Path) -> Path:
    path = test_output / "console"
    path.mkdir(parents=True, exist_ok=True)
    return path


async def sign_in(console: Plane, page: Page, hash_: str = "#/overview") -> None:
    await page.goto(f"{console.url}/console/{hash_}")
    await page.get_by_label("Admin token").fill(console.admin_token)
    await page.get_by_role("button", name="Sign in").click()
    await page.locator("#nav").wait_for(state="visible")
