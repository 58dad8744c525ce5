"""Whether this node's server and engines listen with TLS, as the control plane says.

Where the control plane is https://, the fleet runs TLS: this node's server
listens only with a certificate from the fleet's CA (agent.nodecert), asked
for with a CSR in each report until an answer brings one. The control plane
says in each answer whether it issues node certificates at all; where it does
not, the server listens in plain HTTP, as the URLs the control plane hands out
for it say, if the fleet runs plain; on a TLS fleet whose serve holds no CA
key, only on loopback or with --insecure-http, since it carries the peer token.
"""

from __future__ import annotations

import asyncio
import logging

from llmgw.agent.engines.base import EngineTls
from llmgw.agent.nodecert import NodeCertificate
from llmgw.agent.server import WeightsServer
from llmgw.tls import INSECURE_FLAG
from llmgw.wire import AgentReportAnswer

log = logging.getLogger("llmgw.agent")


class TlsMode:
    def __init__(
        self, node_cert: NodeCertificate, *, fleet_tls: bool, address: str, plain_allowed: bool
    ) -> None:
        self.node_cert = node_cert
        self.fleet_tls = fleet_tls
        self.address = address  # the one the certificate names
        self.plain_allowed = plain_allowed
        # What the last answer said: the control plane issues node
        # certificates (True), does not (False), or no answer yet (None).
        self.node_tls: bool | None = None
        self._note: str | None = None  # said once, not per report

    async def open(self, server: WeightsServer) -> None:
        """Start the server before the first answer: plain on a plain fleet, else with a
        certificate kept from before; without one it starts once an answer brings one
        (``take``): never in plain HTTP on a TLS fleet unasked."""
        if not self.fleet_tls:
            await server.start()
        elif await asyncio.to_thread(self.node_cert.usable, self.address):
            await server.start(self.node_cert.server_context())

    async def take(self, answer: AgentReportAnswer, server: WeightsServer | None) -> bool:
        """Keep a certificate the answer brought; start (or switch) the server to match.

        True when the server started or stopped: the next report should say so.
        """
        self.node_tls = answer.node_tls
        if answer.certificate is not None and answer.certificate_ca is not None:
            await asyncio.to_thread(self.node_cert.accept, answer.certificate,
                                    answer.certificate_ca, self.address)
        note = answer.certificate_refused
        if note is None and not answer.node_tls and self.fleet_tls:
            note = ("the control plane signs no node certificates (serve was given --tls-cert"
                    " without --tls-ca-key); " + (
                        "this node's server is plain HTTP: keep its port on the node network"
                        if self.plain_allowed else "this node's server stays down (no peer"
                        " copies from it, no nudges, no /metrics) unless the agent runs with"
                        f" {INSECURE_FLAG}"))
        if note is not None and note != self._note:
            log.warning("server certificate: %s", note)
        self._note = note
        if server is None:
            return False
        if not answer.node_tls and not self.plain_allowed:
            if server.running:
                await server.stop()
                return True  # the next report carries no port
        elif answer.node_tls:
            usable = await asyncio.to_thread(self.node_cert.usable, self.address)
            if usable and not (server.running and server.tls):
                await server.stop()
                await server.start(self.node_cert.server_context())
                return True  # the next report carries its port
        elif not server.running or server.tls:
            await server.stop()
            await server.start()
            return True
        return False

    def engine_tls(self) -> EngineTls | None:
        """The node's certificate for an engine to listen with, where the fleet issues them.

        The same certificate as the agent's server: it names the address the
        gateways reach the engine at. An engine started before the node has
        one (or on a fleet that issues none) stays plain http, as its report
        says, until it is restarted.
        """
        if not self.fleet_tls or self.node_tls is not True:
            return None
        files = self.node_cert.engine_files(self.address)
        return EngineTls(str(files[0]), str(files[1])) if files is not None else None

    def csr(self) -> str | None:
        """The certificate request a report carries, while the node may get a certificate."""
        if self.fleet_tls and self.node_tls is not False:
            return self.node_cert.request(self.address)
        return None
