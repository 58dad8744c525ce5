"""Tokens stay off stdout and command lines; the gateway's /metrics can need a token (issue 13)."""

from __future__ import annotations

import asyncio
import contextlib
from asyncio.subprocess import Process
from pathlib import Path

import httpx
import pytest
from tests.cli.test_ctl import ok, run, served  # noqa: F401 (fixture)
from tests.control.adminapi.fleetkit import Served
from tests.gateway.conftest import GATEWAY_COMMAND, GATEWAY_LISTENING, make_config
from tests.gateway.fake_control_plane import TOKEN, FakeControlPlane
from tests.servers import child_process, logged_port, terminates_cleanly
from tests.waiting import eventually

from llmgw.cli.secretfile import pick_secret, read_secret_file
from llmgw.cli.upjson import print_banner
from llmgw.control.plane import NewCredentials
from llmgw.errors import ConfigError


def test_the_banner_names_the_file_not_the_secrets(capsys: pytest.CaptureFixture[str]) -> None:
    creds = NewCredentials(admin_token="llmgw-admin-SECRET1", join_token="llmgw-join-SECRET2",
                           api_key="sk-llmgw-SECRET3", api_key_id="k")
    info = {"api_url": "http://h:1/v1", "admin_url": "http://h:1", "console_url": "http://h:1/c",
            "up_json": "/data/up.json", "api_key": creds.api_key}
    for up in (True, False):
        print_banner(info, creds, up=up)
        out = capsys.readouterr().out
        assert "SECRET" not in out
        assert "/data/up.json" in out and "admin token, API key, join token" in out
        assert "curl http://h:1/v1/chat/completions" in out


def test_secret_files(tmp_path: Path) -> None:
    path = tmp_path / "t"
    path.write_text("  llmgw-join-abc\n")
    assert read_secret_file(path, "join token") == "llmgw-join-abc"
    assert pick_secret(None, path, "join token", "--join-token") == "llmgw-join-abc"
    assert pick_secret("x", None, "join token", "--join-token") == "x"
    with pytest.raises(ConfigError, match="not both"):
        pick_secret("x", path, "join token", "--join-token")
    path.write_text("\n")
    with pytest.raises(ConfigError, match="alone, on one line"):
        read_secret_file(path, "join token")
    with pytest.raises(ConfigError, match="cannot read"):
        read_secret_file(tmp_path / "missing", "join token")


def test_ctl_takes_the_admin_token_from_a_file(served: Served, tmp_path: Path) -> None:  # noqa: F811
    path = tmp_path / "admin-token"
    path.write_text(served.admin_token + "\n")
    result = run(None, "--url", served.url, "--token-file", str(path), "nodes")
    assert "gpu-1" in ok(result)
    env_result = run(None, "--url", served.url, "nodes",
                     env={"LLMGW_ADMIN_TOKEN_FILE": str(path)})
    assert "gpu-1" in ok(env_result)


async def test_standalone_gateway_reads_its_tokens_from_files(tmp_path: Path) -> None:
    plane = await FakeControlPlane(make_config(1, [])).start()
    token_file, metrics_file = tmp_path / "gw", tmp_path / "metrics"
    token_file.write_text(TOKEN)
    metrics_file.write_text("m-secret")
    try:
        async with child_process(
            *GATEWAY_COMMAND, "--control-plane", plane.url,
            "--token-file", str(token_file), "--metrics-token-file", str(metrics_file),
            "--host", "127.0.0.1", "--port", "0", stderr=asyncio.subprocess.PIPE,
        ) as process:  # fmt: skip
            await _serves_with_token_files(process)
    finally:
        await plane.stop()


async def _serves_with_token_files(process: Process) -> None:
    port = await logged_port(process, GATEWAY_LISTENING)
    async with httpx.AsyncClient() as client:
        metrics = f"http://127.0.0.1:{port}/metrics"

        async def first_answer() -> httpx.Response | None:
            with contextlib.suppress(httpx.ConnectError):
                return await client.get(metrics)
            return None

        # "listening" is logged just before uvicorn listens.
        first = await eventually(first_answer, 5, what="the gateway's /metrics")
        assert first.status_code == 401
        assert (await client.get(metrics, headers={"Authorization": "Bearer m-secret"})
                ).status_code == 200
    # The standalone gateway runs with llmgw's server limits (llmgw.http.server).
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000
                 + b"\r\n\r\n")
    with contextlib.suppress(ConnectionError):
        head = await asyncio.wait_for(reader.read(100), 5)
        assert head.startswith(b"HTTP/1.1 400") or head == b"", head
    writer.close()
    await terminates_cleanly(process)
