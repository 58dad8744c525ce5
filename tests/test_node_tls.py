"""The nodes' own servers over TLS: certificates from the fleet's CA (issue 13).

A control plane over TLS that holds its CA's key signs each agent's CSR for
the address the agent reports; the agent's server (peer weights, nudges,
/metrics) then listens only with that certificate. Peers copy weights over
https:// checked against the fleet's CA, the control plane's nudges are
verified the same way, plain HTTP to the agent's port gets nowhere, and a
client trusting another CA is refused. Real servers on loopback, real agents.
"""

from __future__ import annotations

import asyncio
import datetime
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from tests.agent.test_weights import PAYLOAD, plant, spec_of
from tests.control.planekit import fleet_ca, get_status, inventory, served_plane, signing_plane
from tests.servers import serve_asgi

from llmgw import nodetls
from llmgw.agent.app import Agent, AgentConfig
from llmgw.agent.fetchers import from_peer
from llmgw.agent.manifest import Progress
from llmgw.control.app import create_app
from llmgw.control.nodecerts import NodeCertificates
from llmgw.control.nudge import Nudger
from llmgw.control.plane import ControlPlane
from llmgw.control.state import FleetState, NodeRecord
from llmgw.nodetls import load_or_make_key, make_csr
from llmgw.servertls import ServerTls, ensure_server_tls
from llmgw.wire import AgentReport, WeightsSource


@dataclass
class Fleet:
    cp: ControlPlane
    url: str
    ca: ServerTls
    tmp: Path
    join_token: str

    def agent(self, name: str, **config: object) -> Agent:
        return Agent(
            AgentConfig(control_plane=self.url, data_dir=self.tmp / name, name=name,
                        join_token=self.join_token, memory_guard="off",
                        ca_file=self.ca.ca_file, **config),  # type: ignore[arg-type]
            inventory_provider=lambda: inventory(name), adapters={})


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    async with signing_plane(tmp_path) as (plane, tls):
        yield Fleet(plane.cp, plane.url, tls, tmp_path, plane.join)


async def test_agents_serve_peers_and_nudges_only_over_tls_from_the_fleet_ca(
    fleet: Fleet,
) -> None:
    a, b = fleet.agent("n1"), fleet.agent("n2")
    try:
        for agent in (a, b):
            await agent.report_once()  # registers; the answer brings the certificate
            assert agent.server is not None and agent.server.running and agent.server.tls
            await agent.report_once()  # now with the port it listens on
        node = fleet.cp.state.nodes["n1"]
        assert a.server is not None and node.agent_port == a.server.port
        base = fleet.cp.node_certs.url(node)
        assert base == f"https://127.0.0.1:{a.server.port}"
        assert (fleet.tmp / "n1" / "tls" / "node.key").stat().st_mode & 0o777 == 0o600

        fleet_ca = ssl.create_default_context(cafile=str(fleet.ca.ca_file))
        assert await get_status(f"{base}/metrics", fleet_ca) == 200
        assert await get_status(f"{base}/agent/v1/weights/manifest?model=x", fleet_ca) == 401
        with pytest.raises(aiohttp.ClientError):  # plain HTTP to the TLS port
            await get_status(f"http://127.0.0.1:{a.server.port}/metrics", False)
        other = ensure_server_tls(fleet.tmp / "other", ["127.0.0.1"])
        other_ca = ssl.create_default_context(cafile=str(other.ca_file))
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await get_status(f"{base}/metrics", other_ca)

        # A peer copy: n2 reads n1's weights over https://, checked against the fleet's CA.
        spec = spec_of(WeightsSource(kind="package", package="tiny-pkg"))
        plant(a.weights, spec, PAYLOAD)
        session = b._peer_session
        assert session is not None
        staging = fleet.tmp / "staging"
        staging.mkdir()
        entry = await from_peer(spec, staging, base, fleet.cp.peer_token, session, Progress())
        assert (staging / entry.entry).read_bytes() == PAYLOAD
        # ...and the same peer session refuses a server of another CA.
        async with serve_asgi(create_app(fleet.cp), tls=other) as impostor:
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                async with session.get(impostor + "/healthz"):
                    pass

        # The control plane's nudge reaches the agent over TLS, verified.
        a._changed.clear()
        nudger = Nudger(fleet.cp.peer_token, fleet.cp.node_certs.url,
                        fleet.cp.node_certs.client_context)
        nudger.nudge([node])
        async with asyncio.timeout(5):
            await a._changed.wait()
        await nudger.close()
    finally:
        for agent in (a, b):
            await agent.shutdown()


async def test_a_restarted_agent_listens_with_its_kept_certificate_at_once(
    fleet: Fleet,
) -> None:
    first = fleet.agent("n1")
    await first.report_once()
    assert first.server is not None
    port = first.server.port
    await first.shutdown()
    again = fleet.agent("n1", server_port=port)
    try:
        await again.start()  # before any report: the certificate on disk serves
        assert again.server is not None and again.server.running and again.server.tls
        report = again.build_report(inventory("n1"))
        assert report.csr is None and report.agent_port == port
    finally:
        await again.shutdown()


async def test_without_the_ca_key_the_server_is_plain_only_where_allowed(
    fleet: Fleet, caplog: pytest.LogCaptureFixture,
) -> None:
    fleet.cp.node_certs = NodeCertificates()  # serve given --tls-cert without --tls-ca-key
    local, wide = fleet.agent("n1"), fleet.agent("n2", bind_host="0.0.0.0")
    try:
        # On loopback nothing crosses a network: plain, said once.
        answer = await local.report_once()
        assert not answer.node_tls and answer.certificate is None
        assert local.server is not None and local.server.running and not local.server.tls
        assert local.build_report(inventory("n1")).csr is None  # asks no more
        # On every interface, a TLS fleet's agent keeps its server down without the flag.
        for _ in range(2):
            await wide.report_once()
        assert wide.server is not None and not wide.server.running
        assert wide.build_report(inventory("n2")).agent_port is None
        said = [r.getMessage() for r in caplog.records if "stays down" in r.getMessage()]
        assert len(said) == 1 and "--insecure-http" in said[0]
    finally:
        for agent in (local, wide):
            await agent.shutdown()


async def test_a_plain_fleet_asks_for_nothing(tmp_path: Path) -> None:
    async with served_plane(tmp_path) as plane:
        agent = Agent(AgentConfig(control_plane=plane.url, data_dir=tmp_path / "n1", name="n1",
                                  join_token=plane.join, memory_guard="off"),
                      inventory_provider=lambda: inventory("n1"), adapters={})
        try:
            await agent.start()
            assert agent.server is not None and agent.server.running and not agent.server.tls
            assert agent.build_report(inventory("n1")).csr is None
            assert not (await agent.report_once()).node_tls
            assert not (tmp_path / "n1" / "tls").exists()
        finally:
            await agent.shutdown()


# -- who gets a certificate --------------------------------------------------------------


def _issuer(tmp_path: Path) -> NodeCertificates:
    return fleet_ca(tmp_path / "ca")[1]


def _csr(tmp_path: Path, name: str, address: str) -> str:
    return make_csr(load_or_make_key(tmp_path / f"{name}.key"), name, address)


def test_the_certificate_names_the_reported_address_not_the_csr(tmp_path: Path) -> None:
    certs = _issuer(tmp_path)
    state = FleetState()
    node = state.nodes["n1"] = NodeRecord(name="n1", registered_at=0, address="10.0.0.1")
    # The CSR asks for another node's address; the certificate is for n1's own.
    issued = certs.issue(state, node, _csr(tmp_path, "n1", "10.0.0.9"))
    assert issued.certificate is not None
    key = load_or_make_key(tmp_path / "n1.key")
    ca = certs.issuer.ca_pem if certs.issuer else None
    cert = issued.certificate.encode()
    assert nodetls.check_certificate(cert, key, "10.0.0.1", ca).usable
    assert not nodetls.check_certificate(cert, key, "10.0.0.9", ca).usable


def test_no_certificate_for_a_held_node_or_another_nodes_address(tmp_path: Path) -> None:
    certs = _issuer(tmp_path)
    state = FleetState()
    state.nodes["n1"] = NodeRecord(name="n1", registered_at=0, address="10.0.0.1")
    rogue = state.nodes["n2"] = NodeRecord(name="n2", registered_at=0, address="10.0.0.1")
    refused = certs.issue(state, rogue, _csr(tmp_path, "n2", "10.0.0.1"))
    assert refused.certificate is None and refused.refused == "address 10.0.0.1 is node n1's"
    held = state.nodes["n3"] = NodeRecord(name="n3", registered_at=0, address="10.0.0.3",
                                          pending_approval=True)
    assert certs.issue(state, held, _csr(tmp_path, "n3", "10.0.0.3")).refused == (
        "node n3 is waiting for approval")
    # Several agents of one machine share loopback: no one else is on that path.
    for name in ("n4", "n5"):
        node = state.nodes[name] = NodeRecord(name=name, registered_at=0, address="127.0.0.1")
        assert certs.issue(state, node, _csr(tmp_path, name, "127.0.0.1")).certificate
    assert "not a PEM" in (certs.issue(state, node, "junk").refused or "")


def test_a_certificate_is_asked_for_again_when_a_third_of_its_life_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    certs = _issuer(tmp_path)
    state = FleetState()
    node = state.nodes["n1"] = NodeRecord(name="n1", registered_at=0, address="127.0.0.1")
    issued = certs.issue(state, node, _csr(tmp_path, "n1", "127.0.0.1")).certificate
    assert issued is not None and certs.issuer is not None
    key = load_or_make_key(tmp_path / "n1.key")
    check = nodetls.check_certificate(issued.encode(), key, "127.0.0.1", certs.issuer.ca_pem)
    assert check.usable and not check.renew
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=nodetls.NODE_DAYS - 29)
    monkeypatch.setattr(nodetls, "_now", lambda: later)
    check = nodetls.check_certificate(issued.encode(), key, "127.0.0.1", certs.issuer.ca_pem)
    assert check.usable and check.renew


async def test_a_refusal_is_one_event_and_reaches_the_agent(fleet: Fleet) -> None:
    rogue = fleet.agent("n2", address="10.9.9.9")
    fleet.cp.state.nodes.setdefault("n1", NodeRecord(name="n1", registered_at=0,
                                                     address="10.9.9.9"))
    try:
        for _ in range(3):
            answer = await rogue.report_once()
            assert answer.certificate is None
            assert answer.certificate_refused == "address 10.9.9.9 is node n1's"
        assert rogue.server is not None and not rogue.server.running  # never plain
        report = rogue.build_report(inventory("n2"))
        assert report.agent_port is None and report.csr is not None
        events = await fleet.cp.store.list_events(limit=50)
        said = [e for e in events if "gets no server certificate" in e["message"]]
        assert len(said) == 1, said
    finally:
        await rogue.shutdown()


def test_a_report_carries_at_most_a_small_csr() -> None:
    with pytest.raises(ValueError):
        AgentReport(node="n1", inventory=inventory("n1"), csr="x" * 5000)


def test_an_operators_ca_signs_node_certificates_only_with_its_key(tmp_path: Path) -> None:
    from llmgw.cli.combined import TlsOptions, sign_node_certificates
    from llmgw.errors import ConfigError

    pki = ensure_server_tls(tmp_path / "pki", ["127.0.0.1"])  # stands in for the operator's
    other = ensure_server_tls(tmp_path / "other", ["127.0.0.1"])
    assert pki.ca_file and pki.ca_key_file and other.ca_key_file

    def given(ca: Path | None, ca_key: Path | None) -> ServerTls | None:
        return TlsOptions(tls=True, cert=pki.cert_file, key=pki.key_file, ca=ca,
                          ca_key=ca_key).resolve(tmp_path, "127.0.0.1", None)

    cp = ControlPlane.__new__(ControlPlane)  # only node_certs is looked at
    cp.node_certs = NodeCertificates()
    sign_node_certificates(cp, given(pki.ca_file, None))
    assert not cp.node_certs.enabled  # --tls-cert alone: nothing to sign with
    sign_node_certificates(cp, given(pki.ca_file, pki.ca_key_file))
    assert cp.node_certs.enabled and cp.node_certs.issuer is not None
    assert cp.node_certs.issuer.ca_pem == pki.ca_file.read_bytes()
    with pytest.raises(ConfigError, match="not the CA certificate's EC key"):
        given(pki.ca_file, other.ca_key_file)
    with pytest.raises(ConfigError, match="needs --tls-ca"):
        given(None, pki.ca_key_file)
