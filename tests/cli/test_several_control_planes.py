"""``llmgw ctl``, ``doctor`` and ``sim fleet`` given several control-plane instances.

Real servers on loopback: a leader and a standby on one PostgreSQL database
(tests/control/standby_kit.py), plus tiny stand-ins for what a real pair only
shows for a moment (standbys with no leader, a leader that just died). The
commands are synchronous; they run in a worker thread so that the servers on
this test's event loop keep answering.
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console
from tests.control.standby_kit import Instance, leader_and_standby
from tests.servers import free_port
from typer.testing import CliRunner, Result

from llmgw.agent.discovery.fake import FakeNvml
from llmgw.cli.ctl import app as ctl_app
from llmgw.cli.doctor import run_doctor
from llmgw.cli.doctor_control_plane import judge_leadership
from llmgw.cli.upjson import serve_admin_urls, write_up_json
from llmgw.control.plane import NewCredentials
from llmgw.errors import ConfigError
from llmgw.sim.fleet import apply_models, start_fleet
from llmgw.sim.fleetspec import parse_fleet_spec
from llmgw.wire import LEADER_HEADER, STANDBY_CODE, ModelSpec, NodeState

Pair = tuple[Instance, Instance, NewCredentials]


@pytest.fixture
async def pair(pg_database_url: str) -> AsyncIterator[Pair]:
    """(leader, standby, credentials), with node n1 registered at the leader."""
    async with leader_and_standby(pg_database_url) as (leader, standby, creds):
        async with httpx.AsyncClient(base_url=leader.url, timeout=10) as http:
            answer = await http.post("/agent/v1/register", json={"node": "n1"},
                                     headers={"Authorization": f"Bearer {creds.join_token}"})
            assert answer.status_code == 200, answer.text
        await standby.cp.load()  # what its 5-second refresh would do
        yield leader, standby, creds


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


async def ctl(urls: list[str], token: str, *args: str) -> Result:
    environment = {"COLUMNS": "200", "LLMGW_DATA_DIR": "/nonexistent-llmgw", "LLMGW_URL": None,
                   "LLMGW_ADMIN_TOKEN": None}
    argv = ["--url", ",".join(urls), "--token", token, *args]
    return await asyncio.to_thread(CliRunner().invoke, ctl_app, argv, env=environment)


def ok(result: Result) -> str:
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    return result.stdout


def one_line_error(result: Result) -> str:
    assert result.exit_code == 1, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("llmgw ctl: "), result.stderr
    return lines[0]


# -- llmgw ctl -------------------------------------------------------------------------


async def test_ctl_reads_from_the_first_that_answers_and_writes_at_the_leader(
    pair: Pair,
) -> None:
    leader, standby, creds = pair
    assert creds.admin_token
    token = creds.admin_token
    nodes = json.loads(ok(await ctl([standby.url, leader.url], token, "nodes", "--json")))
    assert [n["name"] for n in nodes] == ["n1"]
    # A standby serves reads: with no leader listed at all, past a dead instance.
    out = ok(await ctl([dead_url(), standby.url], token, "nodes"))
    assert "n1" in out

    # The standby refuses the write; it is sent on to the leader and lands there.
    # (n1 never reported, so its state reads "unreachable"; its admin state is the test.)
    assert ok(await ctl([standby.url, leader.url], token, "cordon", "n1")).startswith("node n1")
    assert leader.cp.state.nodes["n1"].admin_state == NodeState.CORDONED
    assert standby.cp.state.nodes["n1"].admin_state == NodeState.READY  # not reloaded yet
    # Given only the standby, the write does not follow the leader it names:
    # the admin token goes only where the operator sent it (docs/security.md).
    line = one_line_error(await ctl([standby.url], token, "uncordon", "n1"))
    assert f"leader: {leader.url}, not followed: not a configured instance" in line
    assert leader.cp.state.nodes["n1"].admin_state == NodeState.CORDONED
    assert ok(await ctl([standby.url, leader.url], token, "uncordon", "n1")).startswith("node n1")
    assert leader.cp.state.nodes["n1"].admin_state == NodeState.READY


async def test_ctl_finds_the_leader_from_the_up_json_serve_writes_with_peer_urls(
    pair: Pair, tmp_path: Path
) -> None:
    leader, _, creds = pair
    # What `llmgw serve --peer-url <leader>` wrote on a machine whose own
    # instance has since gone: ctl there still reaches the leader, no flags.
    write_up_json(tmp_path, {"admin_url": serve_admin_urls(dead_url(), [leader.url]),
                             "admin_token": creds.admin_token})
    environment = {"COLUMNS": "200", "LLMGW_DATA_DIR": str(tmp_path), "LLMGW_URL": None,
                   "LLMGW_ADMIN_TOKEN": None}
    result = await asyncio.to_thread(CliRunner().invoke, ctl_app, ["cordon", "n1"],
                                     env=environment)
    assert ok(result).startswith("node n1")
    assert leader.cp.state.nodes["n1"].admin_state == NodeState.CORDONED


async def test_ctl_names_every_instance_it_tried_in_one_line() -> None:
    first, second = dead_url(), dead_url()
    line = one_line_error(await ctl([first, second], "x", "status"))
    assert line.startswith(f"llmgw ctl: cannot reach the control plane at {first}: ")
    assert f"; {second}: " in line
    line = one_line_error(await ctl([first], "x", "cordon", "n1"))
    assert line.startswith(f"llmgw ctl: cannot reach the control plane at {first}: ")
    assert "Connection refused" in line or "connect" in line.lower()


@pytest.fixture
def standby_stand_in() -> Iterator[Any]:
    """``start(leader_hint) -> url``: a standby as a real one answers, naming ``leader_hint``."""
    servers: list[HTTPServer] = []

    def start(hint: str | None) -> str:
        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                if self.path == "/healthz":
                    body, status = b'{"status": "ok", "leader": false, "epoch": 0}', 200
                else:
                    body, status = json.dumps({"error": {
                        "message": "standby", "type": "standby_error", "code": STANDBY_CODE,
                        "leader": hint}}).encode(), 503
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                if hint and status == 503:
                    self.send_header(LEADER_HEADER, hint)
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: Any) -> None:
                pass

        server = HTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


async def test_a_write_whose_leader_is_gone_fails_naming_both(standby_stand_in: Any) -> None:
    gone = dead_url()
    standby = standby_stand_in(gone)
    line = one_line_error(await ctl([standby, gone], "x", "cordon", "n1"))
    assert line.startswith("llmgw ctl: no control-plane leader took POST /nodes/n1/cordon")
    assert f"{standby}: standby (leader: {gone}); {gone}: " in line
    # Two standbys that know no leader: each is asked once, no more.
    lost = [standby_stand_in(None), standby_stand_in(None)]
    line = one_line_error(await ctl(lost, "x", "drain", "n1"))
    assert line.count("standby") == 2 and all(url in line for url in lost)


# -- llmgw doctor ----------------------------------------------------------------------


async def doctor(tmp_path: Path, control_plane: str, json_out: bool = True) -> tuple[int, Any]:
    out = io.StringIO()
    code = await asyncio.to_thread(
        run_doctor, json_out, tmp_path / "data", control_plane,
        nvml=FakeNvml.absent(), nvidia_smi=str(tmp_path / "no-smi"),
        engines=lambda: {"vllm": None, "sglang": None, "llamacpp": "python module llama_cpp"},
        console=Console(file=out, width=200),
    )
    return code, json.loads(out.getvalue()) if json_out else out.getvalue()


async def test_doctor_shows_each_instance_role(pair: Pair, tmp_path: Path) -> None:
    leader, standby, _ = pair
    code, report = await doctor(tmp_path, f"{standby.url},{leader.url}")
    assert code == 0 and report["can_run"] is True, report["warnings"]
    cp = report["control_plane"]
    assert cp["leader"] == leader.url and cp["reachable"] is True
    assert [(i["url"], i["role"]) for i in cp["instances"]] == [
        (standby.url, "standby"), (leader.url, "leader")]
    assert cp["instances"][0]["leader_named"] == leader.url
    assert report["warnings"] == []
    code, text = await doctor(tmp_path, f"{standby.url},{leader.url}", json_out=False)
    assert f"Control plane {standby.url}: standby (leader: {leader.url})" in text
    assert f"Control plane {leader.url}: leader (epoch " in text

    # Only the standby given: agents still find the leader, and doctor says to list it.
    code, report = await doctor(tmp_path, standby.url)
    assert code == 0 and report["control_plane"]["leader"] is None
    assert any(f"the standbys name {leader.url}" in w for w in report["warnings"])


async def test_doctor_says_when_no_instance_leads(standby_stand_in: Any, tmp_path: Path) -> None:
    lost, gone = standby_stand_in(None), dead_url()
    code, report = await doctor(tmp_path, f"{lost},{gone}")
    assert code == 1 and report["can_run"] is False
    assert [i["role"] for i in report["control_plane"]["instances"]] == ["standby", None]
    warnings = "\n".join(report["warnings"])
    assert "no control-plane instance is the leader, and no standby knows one" in warnings
    assert f"control plane {gone} is unreachable" in warnings


def test_doctor_warns_of_two_leaders_and_keeps_quiet_without_roles() -> None:
    def node(url: str, role: str | None) -> dict[str, Any]:
        return {"url": url, "reachable": True, "role": role, "leader_named": None}

    warnings: list[str] = []
    assert judge_leadership([node("http://a", "leader"), node("http://b", "leader")],
                            warnings.append) is False
    assert warnings == ["2 control-plane instances say they lead (http://a, http://b): they do "
                        "not share one database, or one has just lost its lock"]
    warnings.clear()
    # Instances that answered without a role (not llmgw, or older) prove nothing either way.
    assert judge_leadership([node("http://a", None)], warnings.append) is False
    assert warnings == []


# -- llmgw sim fleet -------------------------------------------------------------------


async def test_sim_fleet_applies_models_and_registers_at_the_leader(
    pair: Pair, tmp_path: Path,
) -> None:
    leader, standby, creds = pair
    assert creds.admin_token
    urls = f"{standby.url},{leader.url}"
    result = await apply_models(urls, creds.admin_token, [ModelSpec(name="m", engine="sim")])
    assert result["added"] == ["m"] and "m" in leader.cp.state.models
    spec = parse_fleet_spec("nodes: [{count: 1, class: cpu, name: sim}]")
    fleet = await start_fleet(spec, urls, creds.join_token, tmp_path / "sim", apply=False)
    try:
        await fleet.wait_registered(timeout_s=10.0)
        assert len(leader.cp.state.nodes) == 2  # n1 and the simulated node
    finally:
        await fleet.shutdown(stop_engines=True)
    with pytest.raises(ConfigError, match="must start with http"):
        await start_fleet(spec, f"{leader.url},cp2:8080", creds.join_token, tmp_path / "x")
