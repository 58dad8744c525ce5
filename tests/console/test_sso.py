"""Single sign-on against a real OpenID Connect provider, in Chromium (issue 33, item 5).

The provider is panva's node-oidc-provider (tests/oidc/), with people in
groups that the control plane's role map turns into roles. Each person signs
in through the provider's own form; the console then acts with their role,
and the admin API refuses what the role does not allow with 403. Provider
access tokens (client credentials) are held to the same table.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import jwt
import pytest
import pytest_asyncio
from playwright.async_api import BrowserContext, Page, Route, expect
from tests.console.conftest import Watched
from tests.control.planekit import opened_plane
from tests.oidc.provider import AUDIENCE, Account, RunningProvider, oidc_provider
from tests.servers import free_port, serve_asgi

from llmgw.control.access.settings import oidc_settings
from llmgw.control.app import create_app

ROLE_MAP = ("llmgw-admins=admin,llmgw-operators=operator,llmgw-viewers=viewer,"
            "team-leads=team_admin")
ACCOUNTS = {
    "alice": Account("alice-pw", ["llmgw-admins"], email="alice@example.test"),
    "olga": Account("olga-pw", ["llmgw-operators"], email="olga@example.test"),
    "victor": Account("victor-pw", ["llmgw-viewers", "unrelated"], email="victor@example.test"),
    "tara": Account("tara-pw", ["team-leads"], email="tara@example.test", team="team-a"),
    "nora": Account("nora-pw", ["somewhere-else"], email="nora@example.test"),
}
SERVICES = {
    "ops-bot": ("ops-bot-secret", ["llmgw-operators"]),
    "view-bot": ("view-bot-secret", ["llmgw-viewers"]),
    "no-role-bot": ("no-role-bot-secret", []),
}
pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "name: sso-model\nengine: sim\ngpu_classes: [a100-80g]\nmin_replicas: 0\n"


@dataclass
class SsoPlane:
    url: str
    admin_token: str
    provider: RunningProvider


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sso(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SsoPlane]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    async with oidc_provider(f"{base}/console/auth/callback", ACCOUNTS, SERVICES) as provider:
        settings = oidc_settings(
            issuer=provider.issuer, client_id=provider.client_id,
            redirect_url=f"{base}/console/auth/callback", role_map=ROLE_MAP,
            team_claim="team", audience=AUDIENCE,
        )
        assert settings is not None
        settings = dataclasses.replace(settings, client_secret=provider.client_secret)
        async with opened_plane(tmp_path_factory.mktemp("sso")) as (cp, creds):
            assert creds.admin_token
            app = create_app(cp, sso=settings)
            try:
                async with serve_asgi(app, port=port) as url:
                    yield SsoPlane(url, creds.admin_token, provider)
            finally:
                await app.state.door.aclose()


async def loopback_only(context: BrowserContext) -> None:
    """Nothing the browser does may leave the machine."""

    async def guard(route: Route) -> None:
        host = re.match(r"^[a-z]+://([^/:]+)", route.request.url)
        if host and host.group(1) in ("127.0.0.1", "localhost"):
            await route.continue_()
        else:
            await route.abort()

    await context.route("**/*", guard)


async def sso_sign_in(sso: SsoPlane, page: Page, login: str, password: str) -> None:
    await loopback_only(page.context)
    await page.goto(f"{sso.url}/console/")
    await page.get_by_role("link", name="Sign in with single sign-on").click()
    await expect(page).to_have_url(re.compile(re.escape(sso.provider.issuer) + "/interaction/"))
    await page.get_by_label("Username").fill(login)
    await page.get_by_label("Password").fill(password)
    await page.get_by_role("button", name="Sign in").click()


async def fetch(page: Page, method: str, path: str, csrf: bool = True,
                body: str | None = None) -> dict[str, object]:
    """The admin API called from the page, with the browser's own cookies."""
    result: dict[str, object] = await page.evaluate(
        """async ([method, path, csrf, body]) => {
            const headers = csrf ? {"X-Llmgw-Csrf": "1"} : {};
            if (body) headers["Content-Type"] = "application/json";
            const r = await fetch(path, {method, headers, body: body || undefined});
            return {status: r.status, body: await r.json().catch(() => null)};
        }""",
        [method, path, csrf, body],
    )
    return result


async def test_viewer_signs_in_through_the_provider_and_reads_but_cannot_change(
    sso: SsoPlane, watched: Watched, shots: Path
) -> None:
    page = watched.page
    await sso_sign_in(sso, page, "victor", "victor-pw")
    await expect(page.locator("#nav")).to_be_visible()
    await expect(page.locator("#whoami")).to_have_text("victor@example.test (viewer)")
    await expect(page.locator("#status")).to_contain_text("Updated")
    await page.screenshot(path=shots / "sso-viewer.png", full_page=True)
    for name in ("Nodes", "Replicas", "Plan", "Usage", "Events", "Overview"):
        await page.get_by_role("link", name=name, exact=True).click()
        await expect(page.get_by_role("heading", level=1)).to_have_text(
            "Fleet overview" if name == "Overview" else name)
        await expect(page.locator("#status")).to_contain_text("Updated")

    # The session is an HttpOnly, SameSite=Strict cookie the page's scripts cannot read.
    cookies = {c["name"]: c for c in await page.context.cookies(sso.url)}
    session = cookies["llmgw_session"]
    assert session.get("httpOnly") and session.get("sameSite") == "Strict"
    assert "llmgw_login" not in cookies  # the login's state is used once, then gone
    assert await page.evaluate("document.cookie") == ""

    who = await fetch(page, "GET", "/admin/v1/whoami")
    assert who["status"] == 200
    assert isinstance(who["body"], dict) and who["body"]["roles"] == ["viewer"]
    assert (await fetch(page, "GET", "/admin/v1/summary"))["status"] == 200

    # The models page's Apply is refused with the role's reason, shown on the page.
    watched.allow(r"403 \(Forbidden\)")
    await page.get_by_role("link", name="Models", exact=True).click()
    await page.get_by_label("Entry (YAML").fill(MODEL)
    await page.get_by_role("button", name="Dry run").click()
    await expect(page.locator("#apply-result")).to_contain_text("fleet.operate")
    refused = await fetch(page, "POST", "/admin/v1/nodes/any/cordon")
    assert refused["status"] == 403
    error = refused["body"]["error"]  # type: ignore[index]
    assert error["code"] == "forbidden" and "admin, operator" in error["message"]
    assert (await fetch(page, "POST", "/admin/v1/keys", body='{"name": "x"}'))["status"] == 403
    assert (await fetch(page, "POST", "/admin/v1/admin-token/rotate"))["status"] == 403

    # Signing out ends the session on the server: the old cookie opens nothing.
    await page.get_by_role("button", name="Sign out").click()
    await expect(page.locator("#signin")).to_be_visible()
    async with httpx.AsyncClient(base_url=sso.url) as api:
        answer = await api.get("/admin/v1/summary",
                               headers={"Cookie": f"llmgw_session={session['value']}"})
    assert answer.status_code == 401
    assert "session has ended" in answer.json()["error"]["message"]


async def test_operator_applies_a_model_from_the_console_but_may_not_make_keys(
    sso: SsoPlane, watched: Watched
) -> None:
    page = watched.page
    watched.allow(r"403 \(Forbidden\)")
    await sso_sign_in(sso, page, "olga", "olga-pw")
    await expect(page.locator("#whoami")).to_have_text("olga@example.test (operator)")
    await page.get_by_role("link", name="Models", exact=True).click()
    await page.get_by_label("Entry (YAML").fill(MODEL)
    await page.get_by_role("button", name="Dry run").click()
    await page.get_by_role("button", name="Apply", exact=True).click()
    await expect(page.locator("#apply-result")).to_contain_text("Applied")
    await expect(page.locator('#model-list tr[data-model="sso-model"]')).to_be_visible()

    # A session's write without the CSRF header is refused even for a role that may write.
    no_csrf = await fetch(page, "DELETE", "/admin/v1/models/sso-model", csrf=False)
    assert no_csrf["status"] == 403
    assert "x-llmgw-csrf" in no_csrf["body"]["error"]["message"]  # type: ignore[index]
    assert (await fetch(page, "GET", "/admin/v1/keys"))["status"] == 200
    assert (await fetch(page, "POST", "/admin/v1/keys", body='{"name": "x"}'))["status"] == 403
    assert (await fetch(page, "GET", "/admin/v1/join-tokens"))["status"] == 403
    assert (await fetch(page, "DELETE", "/admin/v1/models/sso-model"))["status"] == 200


async def test_admin_may_do_everything(sso: SsoPlane, watched: Watched) -> None:
    page = watched.page
    await sso_sign_in(sso, page, "alice", "alice-pw")
    await expect(page.locator("#whoami")).to_have_text("alice@example.test (admin)")
    made = await fetch(page, "POST", "/admin/v1/keys", body='{"name": "sso-made"}')
    assert made["status"] == 201
    assert (await fetch(page, "GET", "/admin/v1/join-tokens"))["status"] == 200


async def test_team_admin_manages_its_own_teams_keys_and_sees_its_usage_only(
    sso: SsoPlane, watched: Watched, shots: Path
) -> None:
    admin = {"Authorization": f"Bearer {sso.admin_token}"}
    async with httpx.AsyncClient(base_url=f"{sso.url}/admin/v1", headers=admin) as api:
        teams = {}
        for name in ("team-a", "team-b"):
            made = await api.post("/teams", json={"name": name})
            assert made.status_code == 201, made.text
            teams[name] = made.json()["team_id"]
        theirs = (await api.post("/keys", json={"name": "b-key", "team": "team-b"})).json()
        operators = (await api.post("/keys", json={"name": "no-team-key"})).json()
    page = watched.page
    watched.allow(r"403 \(Forbidden\)")
    await sso_sign_in(sso, page, "tara", "tara-pw")
    await expect(page.locator("#whoami")).to_have_text("tara@example.test (team_admin)")
    # No fleet pages for a team admin: the console opens on what it may read, and its usage
    # page reads its own team's.
    await expect(page.get_by_role("link", name="Nodes", exact=True)).to_be_hidden()
    await expect(page.get_by_role("heading", level=1)).to_have_text("Models")
    await page.get_by_role("link", name="Usage", exact=True).click()
    await expect(page.get_by_role("heading", level=1)).to_have_text("Usage")
    await expect(page.locator("#status")).to_contain_text("Updated")
    await page.screenshot(path=shots / "sso-team-admin-usage.png", full_page=True)
    who = await fetch(page, "GET", "/admin/v1/whoami")
    assert who["body"]["teams"] == ["team-a"]  # type: ignore[index]
    assert (await fetch(page, "GET", "/admin/v1/summary"))["status"] == 403

    # Its own team's keys: made, listed, revoked; its own team listed.
    made = await fetch(page, "POST", "/admin/v1/keys",
                       body='{"name": "a-key", "team": "team-a"}')
    assert made["status"] == 201
    mine = made["body"]["key"]  # type: ignore[index]
    assert mine["team_id"] == teams["team-a"]
    listed = await fetch(page, "GET", "/admin/v1/keys")
    assert [k["name"] for k in listed["body"]] == ["a-key"]  # type: ignore[union-attr]
    listed_teams = await fetch(page, "GET", "/admin/v1/teams")
    assert [t["name"] for t in listed_teams["body"]] == ["team-a"]  # type: ignore[union-attr]

    # Nothing of another team, nor the operator's own keys.
    refused = await fetch(page, "POST", "/admin/v1/keys",
                          body='{"name": "x", "team": "team-b"}')
    assert refused["status"] == 403
    assert "tara@example.test is team admin of team-a only" in \
        refused["body"]["error"]["message"]  # type: ignore[index]
    for key in (theirs["key"], operators["key"]):
        assert (await fetch(page, "DELETE", f"/admin/v1/keys/{key['key_id']}"))["status"] == 403
    moved = await fetch(page, "PATCH", f"/admin/v1/keys/{mine['key_id']}",
                        body='{"team": "team-b"}')
    assert moved["status"] == 403
    for path in ("/usage?team=team-b", "/usage/report?team=team-b", "/teams/team-b",
                 "/nodes", "/join-tokens"):
        assert (await fetch(page, "GET", f"/admin/v1{path}"))["status"] == 403, path
    for path in ("/usage?team=team-a", "/usage/report?team=team-a&by=key", "/teams/team-a",
                 "/keys?team=team-a"):
        assert (await fetch(page, "GET", f"/admin/v1{path}"))["status"] == 200, path
    revoked = await fetch(page, "DELETE", f"/admin/v1/keys/{mine['key_id']}")
    assert revoked["status"] == 200


async def test_a_person_without_a_role_or_with_a_wrong_password_gets_no_session(
    sso: SsoPlane, watched: Watched, shots: Path
) -> None:
    page = watched.page
    await sso_sign_in(sso, page, "nora", "wrong")
    await expect(page.get_by_role("alert")).to_have_text("Wrong username or password.")
    await page.get_by_label("Username").fill("nora")
    await page.get_by_label("Password").fill("nora-pw")
    await page.get_by_role("button", name="Sign in").click()
    await expect(page.locator("#signin-error")).to_contain_text(
        "nora@example.test has no llmgw role")
    await page.screenshot(path=shots / "sso-no-role.png")
    assert "signin_error" not in page.url
    assert not [c for c in await page.context.cookies(sso.url) if c["name"] == "llmgw_session"]


async def test_a_callback_without_its_login_state_is_refused(sso: SsoPlane) -> None:
    async with httpx.AsyncClient(base_url=sso.url) as api:
        answer = await api.get("/console/auth/callback", params={"code": "x", "state": "y"})
    assert answer.status_code == 303
    assert "signin_error=this+sign-in+expired" in answer.headers["location"]


async def test_provider_access_tokens_are_held_to_their_role(sso: SsoPlane) -> None:
    ops = await sso.provider.service_token("ops-bot", "ops-bot-secret")
    view = await sso.provider.service_token("view-bot", "view-bot-secret")
    nobody = await sso.provider.service_token("no-role-bot", "no-role-bot-secret")
    async with httpx.AsyncClient(base_url=f"{sso.url}/admin/v1") as api:
        def as_(token: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {token}"}

        model = {"name": "bot-model", "engine": "sim", "gpu_classes": ["a100-80g"],
                 "min_replicas": 0}
        assert (await api.get("/summary", headers=as_(view))).status_code == 200
        refused = await api.put("/models/bot-model", json=model, headers=as_(view))
        assert refused.status_code == 403
        assert "view-bot has role viewer" in refused.json()["error"]["message"]
        assert (await api.put("/models/bot-model", json=model, headers=as_(ops))).status_code \
            == 200
        assert (await api.post("/keys", json={"name": "k"}, headers=as_(ops))).status_code \
            == 403
        assert (await api.get("/summary", headers=as_(nobody))).status_code == 403
        # The admin token still acts as admin, for automation.
        assert (await api.delete("/models/bot-model",
                                 headers=as_(sso.admin_token))).status_code == 200

        # A token whose signature does not verify, or one signed by someone else, is no one.
        header, payload, signature = ops.split(".")
        forged = f"{header}.{payload}.{signature[:-4]}AAAA"
        answer = await api.get("/summary", headers=as_(forged))
        assert answer.status_code == 401
        claims = jwt.decode(ops, options={"verify_signature": False})
        claims["groups"] = ["llmgw-admins"]
        own = jwt.encode(claims, "a-shared-secret-an-attacker-picks", algorithm="HS256")
        answer = await api.get("/summary", headers=as_(own))
        assert answer.status_code == 401 and "HS256" in answer.json()["error"]["message"]
