"""Which nodes the control plane gives a server certificate, and how others reach them.

The control plane signs (llmgw.nodetls) only where the fleet runs TLS and it
holds the CA's key: then every agent's server is https://, and the URLs the
control plane hands out for it (weight peers) and calls (nudges) say so.

A certificate names the address the node itself reports, so who gets one is
a question of trust, as for weights and fabrics. It names only what the
control plane can vouch for:

* a node held for approval (``serve --approve-nodes``) gets none until an
  operator accepts it: it serves no one's weights meanwhile anyway;
* the address in one spelling (:func:`llmgw.nodetls.normal_address`: host
  names in lower case, IPv6 in its canonical form), so that "GPU-1" and
  "gpu-1", or two spellings of one IPv6 address, are one address;
* never one of the control plane's own names (those its own certificate
  covers): a node's certificate for them would pass for the control plane's
  with any client that does not look for the node mark (llmgw.tls);
* an address belongs to the first node given a certificate for it, durably
  (the store's ``address_claims``), until an admin frees it (``llmgw ctl
  nodes free-address``) or deletes that node: a rogue node with a join token
  must not get a certificate for a peer's address, whether it reports it
  first, at the same time or after the peer went quiet. Loopback addresses
  are exempt (several agents on one machine share 127.0.0.1, and no other
  machine can be on that path).

A refusal reaches the agent (``certificate_refused``) and the events, once
per node and reason.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterable
from dataclasses import dataclass

from llmgw.control.state import FleetState, NodeRecord
from llmgw.control.store.repo import Store
from llmgw.control.writes import FencedWrites
from llmgw.nodetls import CertificateRefused, NodeIssuer, normal_address, peer_context
from llmgw.tls import is_loopback
from llmgw.wire import host_in_url


@dataclass(frozen=True)
class Issued:
    certificate: str | None = None
    refused: str | None = None


FREE_COMMAND = "llmgw ctl nodes free-address"


class NodeCertificates:
    def __init__(self, issuer: NodeIssuer | None = None, reserved: Iterable[str] = ()) -> None:
        self.issuer = issuer
        # The control plane's own names, which no node's certificate may carry.
        self.reserved = {normal_address(n) for n in reserved if not is_loopback(n)}
        # address -> node it is bound to: the store's, as far as this instance
        # has read or written it (:meth:`load_claims`, :meth:`claim`).
        self.claims: dict[str, str] = {}
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

    async def load_claims(self, store: Store) -> None:
        self.claims = {row["address"]: row["node"] for row in await store.list_address_claims()}

    async def claim(self, writes: FencedWrites, node: NodeRecord, at: float) -> None:
        """Bind the node's address to it in the store, unless it is bound already."""
        if self.issuer is None or is_loopback(node.address):
            return
        address = normal_address(node.address)
        if address in self.claims or address in self.reserved or node.pending_approval:
            return
        self.claims[address] = await writes.claim_address(address, node.name, at)

    def issue(self, state: FleetState, node: NodeRecord, csr: str) -> Issued:
        """Sign ``csr`` for ``node`` at its reported address, or say why not."""
        if self.issuer is None:
            return Issued(refused="this control plane issues no node certificates")
        if node.pending_approval:
            return Issued(refused=f"node {node.name} is waiting for approval")
        address = normal_address(node.address)
        if not is_loopback(address):
            refused = self._refusal(state, node, address)
            if refused is not None:
                return Issued(refused=refused)
        try:
            return Issued(certificate=self.issuer.issue(csr, node.name, address))
        except CertificateRefused as exc:
            return Issued(refused=str(exc))

    def _refusal(self, state: FleetState, node: NodeRecord, address: str) -> str | None:
        if address in self.reserved:
            return (f"address {address} is one of the control plane's own names: a"
                    " certificate for it would pass for the control plane's; give the node"
                    " an address of its own (agent --address)")
        for other in state.nodes.values():
            if other.name != node.name and normal_address(other.address) == address:
                return f"address {address} is node {other.name}'s"
        owner = self.claims.get(address)
        if owner is not None and owner != node.name:
            return (f"address {address} is bound to node {owner}; if it is this node's now,"
                    f" an admin frees it with `{FREE_COMMAND} {address}`")
        return None
