"""Rotating the admin and gateway tokens: ``llmgw ctl admin-token|gateway-token --rotate``.

The old token stops working at once on the leader and, after its refresh, on
a standby (another control plane loading the same store); ctl on the control
plane's machine follows the new admin token in up.json.
"""

from __future__ import annotations

import json
import stat
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.control.adminapi.fleetkit import Served, served_control_plane
from typer.testing import CliRunner, Result

from llmgw.cli.ctl import app
from llmgw.control.plane import ControlPlane


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    with served_control_plane(tmp_path) as s:
        yield s


def ctl(*args: str, data_dir: Path | str = "/nonexistent-llmgw") -> Result:
    env: dict[str, str | None] = {"LLMGW_DATA_DIR": str(data_dir), "LLMGW_URL": None,
                                  "LLMGW_ADMIN_TOKEN": None}
    return CliRunner().invoke(app, list(args), env=env)


def status(url: str, path: str, token: str) -> int:
    return httpx.get(url + path, headers={"Authorization": f"Bearer {token}"}).status_code


def standby_accepts(served: Served, admin: str, gateway: str) -> tuple[bool, bool]:
    """What a second instance on the same store accepts after its (standby) load."""
    async def load() -> tuple[bool, bool]:
        standby = ControlPlane(served.cp.store)
        await standby.load()
        return standby.credentials.is_admin(admin), standby.credentials.is_gateway(gateway)

    return served.call(load)


def test_admin_token_rotation_follows_in_up_json(served: Served, tmp_path: Path) -> None:
    old = served.admin_token
    data = tmp_path / "data"
    data.mkdir()
    (data / "up.json").write_text(json.dumps({"admin_url": served.url, "admin_token": old}))
    result = ctl("admin-token", "--rotate", data_dir=data)
    assert result.exit_code == 0, result.stderr
    new = result.stdout.strip()
    assert new.startswith("llmgw-admin-") and new != old
    assert status(served.url, "/admin/v1/summary", old) == 401
    assert status(served.url, "/admin/v1/summary", new) == 200
    up = json.loads((data / "up.json").read_text())
    assert up == {"admin_url": served.url, "admin_token": new}
    assert stat.S_IMODE((data / "up.json").stat().st_mode) == 0o600
    assert standby_accepts(served, old, served.gateway_token) == (False, True)
    assert standby_accepts(served, new, served.gateway_token) == (True, True)
    # Without --rotate nothing changes and the reason is one line.
    shown = ctl("admin-token", data_dir=data)
    assert shown.exit_code == 1 and "--rotate" in shown.stderr


def test_gateway_token_rotation(served: Served) -> None:
    old = served.gateway_token
    result = ctl("--url", served.url, "--token", served.admin_token, "gateway-token", "--rotate")
    assert result.exit_code == 0, result.stderr
    new = result.stdout.strip()
    assert new.startswith("llmgw-gw-") and new != old
    assert status(served.url, "/gateway/v1/config", old) == 401
    assert status(served.url, "/gateway/v1/config", new) == 200
    assert standby_accepts(served, served.admin_token, old) == (True, False)
    assert standby_accepts(served, served.admin_token, new) == (True, True)
    events = httpx.get(served.url + "/admin/v1/events",
                       headers={"Authorization": f"Bearer {served.admin_token}"}).json()
    assert any(e["message"] == "gateway token rotated" for e in events)
