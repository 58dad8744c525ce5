"""``llmgw serve --oidc-*``: the flags reach a running control plane, the secret from a file.

A whole sign-in, driven over HTTP the way the browser drives it (the
Chromium walk is tests/console/test_sso.py): serve sends the person to the
provider, the provider's form signs them in, and the callback on serve
redeems the code with the client secret read from the file, opening a
session with the roles of the person's groups. Bad flags stop serve with one
line.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from tests.oidc.provider import Account, oidc_provider
from tests.servers import free_port, stop_process
from tests.waiting import eventually

LLMGW = [sys.executable, "-m", "llmgw.cli.main"]


async def test_serve_signs_a_person_in_through_the_provider(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    callback = f"{base}/console/auth/callback"
    accounts = {"olga": Account("olga-pw", ["gpu-ops"], email="olga@example.test")}
    async with oidc_provider(callback, accounts) as provider:
        secret = tmp_path / "oidc-secret"
        secret.write_text(provider.client_secret + "\n")
        log = tmp_path / "serve.log"
        with log.open("wb") as out:
            serve = await asyncio.create_subprocess_exec(
                *LLMGW, "serve", "--host", "127.0.0.1", "--port", str(port),
                "--data-dir", str(tmp_path / "cp"), "--oidc-issuer", provider.issuer,
                "--oidc-client-id", provider.client_id, "--oidc-client-secret-file", str(secret),
                "--oidc-redirect-url", callback, "--oidc-role-map", "gpu-ops=operator",
                stdout=out, stderr=subprocess.STDOUT)
        try:
            await eventually(lambda: "Credentials" in log.read_text(), 30, what="serve to start")
            async with httpx.AsyncClient(base_url=base, timeout=10) as browser:
                assert (await browser.get("/console/auth/session")).json() == {
                    "sso": True, "signed_in": False}
                to_provider = await browser.get("/console/auth/login")
                assert to_provider.status_code == 302
                where = urlsplit(to_provider.headers["location"])
                query = parse_qs(where.query)
                assert f"{where.scheme}://{where.netloc}" == provider.issuer
                assert query["code_challenge_method"] == ["S256"]
                assert query["client_id"] == [provider.client_id]
                form = await browser.get(to_provider.headers["location"], follow_redirects=True)
                action = re.search(r'action="([^"]+)"', form.text)
                assert action is not None, form.text
                back = await browser.post(f"{provider.issuer}{action.group(1)}",
                                          data={"username": "olga", "password": "olga-pw"},
                                          follow_redirects=True)
                assert str(back.url) == f"{base}/console/", back.url
                who = await browser.get("/admin/v1/whoami")
                assert who.status_code == 200, who.text
                assert who.json()["roles"] == ["operator"]
                assert who.json()["name"] == "olga@example.test"
        finally:
            await stop_process(serve, signal.SIGTERM)
        # Who signed in is logged; the secret, the code and the cookie are not.
        text = log.read_text()
        assert "olga@example.test as operator" in text
        assert provider.client_secret not in text


@pytest.mark.parametrize(("flags", "message"), [
    (["--oidc-issuer", "http://idp.example.com", "--oidc-client-id", "c",
      "--oidc-redirect-url", "https://cp/cb", "--oidc-role-map", "a=admin"], "must be https"),
    (["--oidc-issuer", "https://idp.example.com"], "needs --oidc-client-id"),
    (["--oidc-issuer", "https://idp.example.com", "--oidc-client-id", "c",
      "--oidc-redirect-url", "https://cp/cb", "--oidc-role-map", "a=root"], "is not one of"),
])
def test_flags_that_cannot_work_stop_serve_with_one_line(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    done = subprocess.run([*LLMGW, "serve", "--data-dir", str(tmp_path), "--port", "0", *flags],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("llmgw: ") and message in lines[0], lines
