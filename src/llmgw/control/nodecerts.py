"""Which nodes the control plane gives a server certificate, and how others reach them.

The control plane signs (llmgw.nodetls) only where the fleet runs TLS and it
holds the CA's key: then every agent's server is https://, and the URLs the
control plane hands out for it (weight peers) and calls (nudges) say so.

A certificate names the address the node itself reports, so who gets one is
a question of trust, as for weights and fabrics:

* a node held for approval (``serve --approve-nodes``) gets none until an
  operator accepts it: it serves no one's weights meanwhile anyway;
* an address another node already reports is refused: a rogue node with a
  join token must not get a certificate for a peer's address and pose as it
  to the nodes that copy weights from that peer. Loopback addresses are
  exempt (several agents on one machine share 127.0.0.1, and no other
  machine can be on that path).

A refusal reaches the agent (``certificate_refused``) and the events, once
per node and reason.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from llmgw.control.state import FleetState, NodeRecord
from llmgw.nodetls import CertificateRefused, NodeIssuer, peer_context
from llmgw.tls import is_loopback
from llmgw.wire import host_in_url


@dataclass(frozen=True)
class Issued:
    certificate: str | None = None
    refused: str | None = None


class NodeCertificates:
    def __init__(self, issuer: NodeIssuer | None = None) -> None:
        self.issuer = issuer
        self._client_context: ssl.SSLContext | None = None

    @property
    def enabled(self) -> bool:
        return self.issuer is not None

    @property
    def scheme(self) -> str:
        return "https" if self.issuer is not None else "http"

    def url(self, node: NodeRecord) -> str | None:
        """Base URL of the node's own server; None when it runs none."""
        if node.agent_port is None:
            return None
        return f"{self.scheme}://{host_in_url(node.address)}:{node.agent_port}"

    def client_context(self) -> ssl.SSLContext | None:
        """How the control plane verifies agents' servers (nudges); None in plain fleets."""
        if self.issuer is None:
            return None
        if self._client_context is None:
            self._client_context = peer_context(self.issuer.ca_pem)
        return self._client_context

    def issue(self, state: FleetState, node: NodeRecord, csr: str) -> Issued:
        """Sign ``csr`` for ``node`` at its reported address, or say why not."""
        if self.issuer is None:
            return Issued(refused="this control plane issues no node certificates")
        if node.pending_approval:
            return Issued(refused=f"node {node.name} is waiting for approval")
        if not is_loopback(node.address):
            for other in state.nodes.values():
                if other.name != node.name and other.address == node.address:
                    return Issued(refused=f"address {node.address} is node {other.name}'s")
        try:
            return Issued(certificate=self.issuer.issue(csr, node.name, node.address))
        except CertificateRefused as exc:
            return Issued(refused=str(exc))
