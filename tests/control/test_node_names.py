"""A node's certificate names only what the control plane can vouch for (issue 29).

Its address in one spelling, never one of the control plane's own names,
never another node's.
"""

from __future__ import annotations

from pathlib import Path

from cryptography import x509
from tests.control.planekit import fleet_ca

from llmgw.control.nodecerts import Issued, NodeCertificates
from llmgw.control.state import FleetState, NodeRecord
from llmgw.nodetls import load_or_make_key, make_csr, normal_address
from llmgw.servertls import ensure_server_tls


def test_one_spelling_per_address_and_none_of_the_control_planes_names(tmp_path: Path) -> None:
    _, certs = fleet_ca(tmp_path / "ca")
    certs.reserved = {normal_address(n) for n in ("cp.example.net", "10.0.0.100")}
    state = FleetState()

    def issue(name: str, address: str) -> Issued:
        node = state.nodes[name] = NodeRecord(name=name, registered_at=0, address=address)
        return certs.issue(state, node, make_csr(load_or_make_key(tmp_path / name), name,
                                                  address))

    first = issue("n1", "GPU-1.Example.")
    assert first.certificate is not None
    named = x509.load_pem_x509_certificate(first.certificate.encode()).extensions
    san = named.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["gpu-1.example"]
    assert issue("n2", "gpu-1.example").refused == "address gpu-1.example is node n1's"
    assert issue("n3", "2001:db8::1").certificate is not None
    assert issue("n4", "2001:DB8:0:0:0:0:0:1").refused == "address 2001:db8::1 is node n3's"
    assert issue("n5", "::ffff:10.0.0.7").certificate is not None
    assert issue("n6", "10.0.0.7").refused == "address 10.0.0.7 is node n5's"
    for own in ("CP.example.net", "10.0.0.100"):
        assert "control plane's own names" in (issue("n7", own).refused or "")


def test_the_control_planes_names_are_those_its_certificate_and_its_instances_have(
    tmp_path: Path,
) -> None:
    from llmgw.cli.combined import sign_node_certificates
    from llmgw.control.plane import ControlPlane

    tls = ensure_server_tls(tmp_path / "cp", ["127.0.0.1", "CP.example.net", "10.0.0.100"])
    cp = ControlPlane.__new__(ControlPlane)  # only node_certs is looked at
    cp.node_certs = NodeCertificates()
    sign_node_certificates(cp, tls, ["https://CP2.example.net:8080", "https://[2001:db8::2]:8080"])
    assert {"cp.example.net", "10.0.0.100", "cp2.example.net", "2001:db8::2"} <= (
        cp.node_certs.reserved)
    assert "127.0.0.1" not in cp.node_certs.reserved  # loopback: shared by a machine's agents
