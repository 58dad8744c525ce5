"""A real OpenID Connect provider (node-oidc-provider) on loopback, for the SSO tests.

Installed by scripts/oidc-provider.sh (``make test`` runs it; so does the
first test that needs it, when it is missing). Each use runs the provider
with its own clients and accounts, and hands back the issuer URL.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.servers import free_port, stop_process

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "oidc-provider.sh"
AUDIENCE = "https://llmgw.test/admin"


@dataclass
class Account:
    password: str
    groups: list[str] = field(default_factory=list)
    email: str | None = None
    team: str | None = None

    def claims(self) -> dict[str, Any]:
        out: dict[str, Any] = {"password": self.password, "groups": self.groups}
        if self.email:
            out.update(email=self.email, email_verified=True)
        if self.team:
            out["team"] = self.team
        return out


@dataclass
class RunningProvider:
    issuer: str
    client_id: str
    client_secret: str

    async def service_token(self, client_id: str, secret: str) -> str:
        """A JWT access token for the admin API (client credentials; RFC 9068)."""
        async with httpx.AsyncClient(timeout=10) as http:
            answer = await http.post(f"{self.issuer}/token", auth=(client_id, secret),
                                     data={"grant_type": "client_credentials",
                                           "resource": AUDIENCE, "scope": "admin"})
        answer.raise_for_status()
        token: str = answer.json()["access_token"]
        return token


def installed_dir() -> Path:
    if shutil.which("node") is None:
        pytest.fail("node not found: apt-get install nodejs npm (scripts/setup.sh does it)")
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.fail(f"scripts/oidc-provider.sh failed: {done.stderr[-2000:]}")
    dir_ = subprocess.run(["bash", str(SCRIPT), "dir"], capture_output=True, text=True,
                          check=True).stdout.strip()
    return Path(dir_)


@asynccontextmanager
async def oidc_provider(
    redirect_uri: str, accounts: dict[str, Account],
    services: dict[str, tuple[str, list[str]]] | None = None,
) -> AsyncIterator[RunningProvider]:
    """The provider, with one confidential client for ``redirect_uri``, ``accounts``
    (login -> account), and service clients (id -> (secret, groups)) for client credentials."""
    where = installed_dir()
    # ESM resolves packages from the importing file's folder, not NODE_PATH.
    shutil.copyfile(Path(__file__).with_name("provider.mjs"), where / "provider.mjs")
    port = free_port()
    issuer = f"http://127.0.0.1:{port}"
    client = RunningProvider(issuer, "llmgw-console", "console-secret-for-tests")
    services = services or {}
    config = {
        "issuer": issuer, "port": port, "audience": AUDIENCE,
        "clients": [
            {"client_id": client.client_id, "client_secret": client.client_secret,
             "redirect_uris": [redirect_uri]},
            *({"client_id": cid, "client_secret": secret, "redirect_uris": [],
               "grant_types": ["client_credentials"], "response_types": []}
              for cid, (secret, _) in services.items()),
        ],
        "accounts": {login: a.claims() for login, a in accounts.items()},
        "service_groups": {cid: groups for cid, (_, groups) in services.items()},
    }
    env = {**os.environ, "OIDC_TEST_CONFIG": json.dumps(config), "NODE_ENV": "production"}
    proc = await asyncio.create_subprocess_exec(
        "node", str(where / "provider.mjs"), env=env, cwd=where,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    assert proc.stdout is not None
    try:
        output = []
        async with asyncio.timeout(30):
            while True:
                line = (await proc.stdout.readline()).decode()
                if not line:
                    pytest.fail("the OIDC provider exited:\n" + "".join(output))
                output.append(line)
                if line.strip() == "ready":
                    break
        drain = asyncio.create_task(_drain(proc.stdout))
        try:
            yield client
        finally:
            drain.cancel()
    finally:
        await stop_process(proc, signal.SIGTERM)


async def _drain(stream: asyncio.StreamReader) -> None:
    # The provider's log lines go nowhere; a full pipe would stall it.
    while await stream.readline():
        pass
