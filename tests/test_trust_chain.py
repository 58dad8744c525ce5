"""The trust chain against a machine on the path and a rogue node (issue 29).

A join token pins one CA by its key's fingerprint. A server on the path at
an agent's first contact that hands out the real CA followed by its own must
get nothing: not the registration, not the join token. Real agent process,
real TLS on loopback; the server in the path is a small ASGI app that
records what reaches it.
"""

from __future__ import annotations

import asyncio
import datetime
import sys
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from tests.control.planekit import inventory, signing_plane
from tests.servers import read_body, serve_asgi

from llmgw.agent.app import Agent, AgentConfig
from llmgw.http.server import Plain
from llmgw.nodetls import NodeIssuer, load_or_make_key, make_csr
from llmgw.servertls import CaRoute, ServerTls, ensure_server_tls, write_ca
from llmgw.tls import TrustError, fingerprint

LLMGW = [sys.executable, "-m", "llmgw.cli.main"]


def attackers_server(directory: Path) -> ServerTls:
    """A CA of the attacker's own (a name of its own too) and a server certificate from it."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "not the fleet's CA")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))
    write_ca(directory, cert.public_bytes(serialization.Encoding.PEM), key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return ensure_server_tls(directory, ["127.0.0.1"])


async def output_until(process: asyncio.subprocess.Process, text: str, seconds: float) -> str:
    """What ``process`` printed until a line with ``text`` (or ``seconds``); then it is stopped."""
    assert process.stdout is not None
    lines: list[str] = []
    try:
        async with asyncio.timeout(seconds):
            while line := (await process.stdout.readline()).decode():
                lines.append(line)
                if text in line:
                    break
    except TimeoutError:
        pass
    process.kill()
    await process.wait()
    return "".join(lines)


class Recorder:
    """An ASGI app that keeps every request that reaches it (and answers 503)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, bytes]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = await read_body(receive)
        self.seen.append((scope["method"], scope["path"], body))
        await send({"type": "http.response.start", "status": 503, "headers": []})
        await send({"type": "http.response.body", "body": b""})


async def test_a_bundle_behind_the_pinned_ca_gets_no_registration(tmp_path: Path) -> None:
    real = ensure_server_tls(tmp_path / "real", ["127.0.0.1"])
    attacker = attackers_server(tmp_path / "attacker")
    assert real.ca_file and attacker.ca_file
    bundle = real.ca_file.read_bytes() + attacker.ca_file.read_bytes()
    pin = fingerprint(real.ca_file.read_bytes())
    recorder = Recorder()
    async with serve_asgi(CaRoute(Plain(recorder), bundle), tls=attacker) as url:
        agent = await asyncio.create_subprocess_exec(
            *LLMGW, "agent", "--control-plane", url, "--join-token", f"llmgw-join-secret.{pin}",
            "--name", "victim", "--data-dir", str(tmp_path / "victim"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            output, _ = await asyncio.wait_for(agent.communicate(), 20)
        except TimeoutError:
            agent.kill()
            output, _ = await agent.communicate()
        assert recorder.seen == [], recorder.seen  # the join token never left the agent
        assert agent.returncode == 2, output.decode()
        assert "must be exactly one PEM certificate, and holds 2" in output.decode()
        assert not (tmp_path / "victim" / "ca.pem").exists()
    # The same shape is refused wherever a pin is computed.
    with pytest.raises(TrustError, match="holds 2 PEM block"):
        fingerprint(bundle)
    assert fingerprint(real.ca_file.read_bytes()) == pin


# -- a node's certificate does not pass for the control plane's ------------------------


async def test_a_node_certificate_does_not_pass_for_the_control_plane(tmp_path: Path) -> None:
    # A node of the fleet holds a certificate from the fleet's CA for an
    # address the control plane also answers on (here 127.0.0.1, which
    # several nodes share): posing as the control plane with it gets nothing.
    real = ensure_server_tls(tmp_path / "real", ["127.0.0.1"])
    assert real.ca_file and real.ca_key_file
    key = load_or_make_key(tmp_path / "node.key")
    issued = NodeIssuer.from_files(real.ca_file, real.ca_key_file).issue(
        make_csr(key, "rogue", "127.0.0.1"), "rogue", "127.0.0.1")
    (tmp_path / "node.pem").write_text(issued)
    rogue_tls = ServerTls(tmp_path / "node.pem", tmp_path / "node.key", None)
    pin = fingerprint(real.ca_file.read_bytes())
    recorder = Recorder()
    served = CaRoute(Plain(recorder), real.ca_file.read_bytes())
    async with serve_asgi(served, tls=rogue_tls) as url:
        agent = await asyncio.create_subprocess_exec(
            *LLMGW, "agent", "--control-plane", url, "--join-token", f"llmgw-join-secret.{pin}",
            "--name", "victim", "--data-dir", str(tmp_path / "victim"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        ctl = await asyncio.create_subprocess_exec(
            *LLMGW, "ctl", "--url", url, "--token", "llmgw-admin-secret", "--ca-file",
            str(real.ca_file), "nodes",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        ctl_said, _ = await asyncio.wait_for(ctl.communicate(), 60)
        # The agent keeps trying, as with a control plane that is down.
        agent_said = await output_until(agent, "register", 60)
    # Only the CA itself was fetched (it is public); no token reached the server.
    assert recorder.seen == [], recorder.seen
    assert ctl.returncode == 1 and "node's certificate" in ctl_said.decode(), ctl_said.decode()
    assert "node's certificate" in agent_said, agent_said[-2000:]


# -- an address is one node's -----------------------------------------------------------


async def test_an_address_stays_one_nodes_until_an_admin_frees_it(tmp_path: Path) -> None:
    async with signing_plane(tmp_path) as (plane, tls):
        def agent(name: str, address: str) -> Agent:
            return Agent(AgentConfig(
                control_plane=plane.url, data_dir=tmp_path / name, name=name,
                join_token=plane.join, memory_guard="off", ca_file=tls.ca_file,
                address=address, bind_host="127.0.0.1"),
                inventory_provider=lambda: inventory(name), adapters={})

        first, second = agent("first", "gpu-1.example"), agent("second", "GPU-1.example")
        try:
            assert (await first.report_once()).certificate is not None
            # The first node moves on (or goes quiet); its address stays its own.
            plane.cp.state.nodes["first"].address = "gpu-9.example"
            refused = (await second.report_once()).certificate_refused or ""
            assert "bound to node first" in refused and "free-address gpu-1.example" in refused
            claims = await plane.cp.store.list_address_claims()
            assert [(c["address"], c["node"]) for c in claims] == [("gpu-1.example", "first")]
            freed = await asyncio.create_subprocess_exec(
                *LLMGW, "ctl", "--url", plane.url, "--token", plane.creds.admin_token or "",
                "--ca-file", str(tls.ca_file), "nodes", "free-address", "GPU-1.example",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            said, _ = await asyncio.wait_for(freed.communicate(), 30)
            assert freed.returncode == 0, said.decode()
            assert "freed (was node first's)" in said.decode()
            assert (await second.report_once()).certificate is not None
        finally:
            await first.shutdown()
            await second.shutdown()


# -- the agent's client follows no redirect ---------------------------------------------


class Redirector:
    """Answers every request with a 307 to ``target`` (which keeps the method and body)."""

    def __init__(self, target: str) -> None:
        self.target = target

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 307,
                    "headers": [(b"location", f"{self.target}/steal".encode())]})
        await send({"type": "http.response.body", "body": b""})


async def test_a_redirect_does_not_carry_the_join_token_away(tmp_path: Path) -> None:
    elsewhere = Recorder()
    async with serve_asgi(elsewhere) as target, serve_asgi(Redirector(target)) as url:
        agent = await asyncio.create_subprocess_exec(
            *LLMGW, "agent", "--control-plane", url, "--join-token", "llmgw-join-secret",
            "--name", "victim", "--data-dir", str(tmp_path / "victim"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        said = await output_until(agent, "register", 60)
    assert elsewhere.seen == [], elsewhere.seen
    assert "HTTP 307" in said, said[-2000:]
