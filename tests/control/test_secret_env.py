"""Secrets in catalog ``env`` never come back from a read; API docs are off (issue 13)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from tests.control.planekit import Plane

from llmgw.control.plane import ControlPlane
from llmgw.control.reports import assignments_for
from llmgw.control.secretenv import REDACTED, is_secret_value, redacted
from llmgw.control.state import ReplicaRecord
from llmgw.wire import ModelSpec, ShardAssignment

Admin = tuple[ControlPlane, httpx.AsyncClient]
ENTRY: dict[str, Any] = {
    "name": "m", "engine": "sim",
    "env": {"HF_TOKEN": "hf_real_secret", "HF_HOME": "lic-1234", "TZ": "UTC"},
    "secret_env": ["HF_HOME"],
}


@pytest.fixture
async def admin(plane: Plane) -> AsyncIterator[Admin]:
    async with httpx.AsyncClient(base_url=f"{plane.url}/admin/v1", headers=plane.admin) as client:
        yield plane.cp, client


async def test_secret_env_values_are_redacted_in_every_read(admin: Admin) -> None:
    cp, client = admin
    put = await client.put("/models/m", json=ENTRY)
    assert put.status_code == 200, put.text
    reads = [put.text, (await client.get("/models")).text, (await client.get("/models/m")).text,
             (await client.get("/events")).text, (await client.get("/plan")).text,
             (await client.post("/apply", json={"models": [ENTRY], "dry_run": True})).text]
    for text in reads:
        assert "hf_real_secret" not in text and "lic-1234" not in text
    env = (await client.get("/models/m")).json()["spec"]["env"]
    assert env == {"HF_TOKEN": REDACTED, "HF_HOME": REDACTED, "TZ": "UTC"}
    # The agent that starts the engine gets the real values.
    cp.state.replicas["r1"] = ReplicaRecord(id="r1", model="m", created_at=0.0,
                                            shards=[ShardAssignment(node="n1")])
    (assignment,) = assignments_for(cp.state, "n1")
    assert assignment.model.env["HF_TOKEN"] == "hf_real_secret"
    assert assignment.model.env["HF_HOME"] == "lic-1234"


async def test_writing_back_what_was_read_keeps_the_secrets(admin: Admin) -> None:
    cp, client = admin
    await client.put("/models/m", json=ENTRY)
    read = (await client.get("/models/m")).json()["spec"]
    read["env"]["TZ"] = "Europe/Paris"
    again = await client.put("/models/m", json=read)
    assert again.status_code == 200, again.text
    env = cp.state.models["m"].spec.env
    assert env == {"HF_TOKEN": "hf_real_secret", "HF_HOME": "lic-1234", "TZ": "Europe/Paris"}
    applied = await client.post("/apply", json={"models": [read]})
    assert applied.status_code == 200, applied.text
    assert cp.state.models["m"].spec.env["HF_TOKEN"] == "hf_real_secret"


async def test_bad_secret_env_is_refused(admin: Admin) -> None:
    _, client = admin
    typo = {**ENTRY, "secret_env": ["LICENSE"]}
    answer = await client.put("/models/m", json=typo)
    assert answer.status_code == 422 and "LICENSE" in answer.json()["error"]["message"]
    marker = {**ENTRY, "name": "new", "env": {"HF_TOKEN": REDACTED}, "secret_env": []}
    answer = await client.put("/models/new", json=marker)
    assert answer.status_code == 422 and "no stored value" in answer.json()["error"]["message"]


async def test_no_api_docs_pages(admin: Admin) -> None:
    _, client = admin
    base = str(client.base_url).rstrip("/").removesuffix("/admin/v1")
    async with httpx.AsyncClient() as anonymous:
        for page in ("/admin/docs", "/redoc", "/docs", "/admin/docs/oauth2-redirect"):
            assert (await anonymous.get(base + page)).status_code == 404
        schema = await anonymous.get(base + "/admin/v1/openapi.json")
    assert schema.status_code == 200 and "/admin/v1/models" in schema.json()["paths"]


async def test_secrets_are_redacted_by_their_shape_whatever_their_name(admin: Admin) -> None:
    cp, client = admin
    # Names the engine allow-list lets a catalog give, with values whose
    # names say nothing of what they are.
    env = {"HF_HOME": "https://bot:hunter22@models.example/cache",
           "HF_HUB_CACHE": "sk-abcdefghijklmnopqrstuvwx", "TZ": "llmgw-admin-0123456789abcdefXYZ",
           "NCCL_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "4"}
    entry = {"name": "shapes", "engine": "sim", "env": env}
    put = await client.put("/models/shapes", json=entry)
    assert put.status_code == 200, put.text
    shown = (await client.get("/models/shapes")).json()["spec"]["env"]
    secret = ("HF_HOME", "HF_HUB_CACHE", "TZ")
    assert shown == {k: REDACTED if k in secret else v for k, v in env.items()}
    # Written back as read, every redacted value keeps what was stored.
    again = await client.put("/models/shapes", json={**entry, "env": shown})
    assert again.status_code == 200, again.text
    assert cp.state.models["shapes"].spec.env == env
    spec = ModelSpec(name="m", engine="sim", env={"OPENAI_APIKEY": "plain", "LEVEL": "x"})
    assert redacted(spec).env == {"OPENAI_APIKEY": REDACTED, "LEVEL": "x"}
    assert not is_secret_value("sk-short") and not is_secret_value("mask-over-the-top-of-it")
