"""One error path (control/httperrors.py): the admin API and the agent and gateway APIs
answer the same failure with the same status, body, code and headers.

They used to translate errors apart, and had drifted: a store error carried
Retry-After on one side only, a 401 WWW-Authenticate on the other only.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from tests.control.planekit import Api, bearer

from llmgw.errors import StoreError
from llmgw.wire import ErrorBody


def _error(answer: httpx.Response) -> tuple[int, str | None, str | int | None]:
    body = ErrorBody.parse(answer.content)
    assert body is not None, answer.text
    return answer.status_code, body.error.type, body.error.code


def _away(*_: Any, **__: Any) -> Any:
    raise StoreError("the database is away")


async def test_a_store_error_is_503_with_retry_after_on_every_api(
    api: Api,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client, cp, creds = api
    assert creds.admin_token and creds.gateway_token
    monkeypatch.setattr(cp.store, "list_events", _away)
    monkeypatch.setattr(cp.store, "add_usage", _away)
    admin = await client.get("/admin/v1/events", headers=bearer(creds.admin_token))
    gateway = await client.post("/gateway/v1/usage", json=[],
                                headers=bearer(creds.gateway_token))
    for answer in (admin, gateway):
        assert _error(answer) == (503, "store_error", "store_unavailable")
        assert answer.headers["retry-after"] == "2"


async def test_a_refused_credential_is_401_naming_bearer_on_every_api(
    api: Api,
) -> None:
    client, _, _ = api
    wrong = bearer("llmgw-admin-wrong")
    for answer in (await client.get("/admin/v1/nodes", headers=wrong),
                   await client.get("/gateway/v1/config", headers=wrong),
                   await client.post("/agent/v1/report", json={}, headers=wrong)):
        assert _error(answer) == (401, "authentication_error", "invalid_token")
        assert answer.headers["www-authenticate"] == "Bearer"


async def test_an_invalid_body_is_422_naming_the_problem_on_every_api(
    api: Api,
) -> None:
    client, _, creds = api
    assert creds.admin_token
    admin = await client.post("/admin/v1/keys", json={"rpm": 0},
                              headers=bearer(creds.admin_token))
    assert creds.join_token
    agent = await client.post("/agent/v1/register", content=b"{not json",
                              headers=bearer(creds.join_token))
    for answer in (admin, agent):
        assert _error(answer) == (422, "invalid_request_error", "invalid_request")
