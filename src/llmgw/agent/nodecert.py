"""This node's server certificate: the key made here, the certificate from the control plane.

Where the fleet runs TLS, the agent's server (peer weights, nudges, /metrics)
listens only with a certificate from the fleet's CA for the node's address
(llmgw.nodetls). The agent asks for one with a CSR in its report whenever it
has none that serves (none yet, another address, another CA, a third of its
life left) and keeps what the answer brings in ``tls/`` in its data dir: the
key (owner-only; it never leaves the node), the certificate, and the CA that
signed it, against which it checks the peers it copies weights from.

The two SSL contexts are made once and loaded again in place: a renewed
certificate or a new CA applies to the next connection without restarting
the server or the peers' session.
"""

from __future__ import annotations

import logging
import os
import ssl
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import ec

from llmgw.nodetls import check_certificate, load_or_make_key, make_csr

log = logging.getLogger(__name__)

KEY_FILE = "node.key"
CERT_FILE = "node.pem"
CA_FILE = "node-ca.pem"


class NodeCertificate:
    def __init__(self, directory: Path, node: str) -> None:
        self.directory = directory
        self.node = node
        self._key: ec.EllipticCurvePrivateKey | None = None
        self._cert: bytes | None = None
        self._ca: bytes | None = None
        self._server: ssl.SSLContext | None = None
        # Verifies peers against the CA that signs node certificates only
        # (not the system's CAs): with none known yet it trusts no one.
        self.peer_context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        # Verifies this node's own engines, which listen with its certificate,
        # when the agent probes them. The chain is checked, the name is not:
        # a probe goes to the engine's bind address on this machine (127.0.0.1
        # for one bound to every interface), which the certificate does not
        # name, and no other machine is on that path.
        self.engine_probe_context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        self.engine_probe_context.check_hostname = False

    @property
    def cert_file(self) -> Path:
        return self.directory / CERT_FILE

    @property
    def key_file(self) -> Path:
        return self.directory / KEY_FILE

    def _load(self) -> ec.EllipticCurvePrivateKey:
        """The key (made on first use) and whatever an earlier run kept."""
        if self._key is not None:
            return self._key
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        self._key = key = load_or_make_key(self.key_file)
        self._cert = _read(self.cert_file)
        self._ca = _read(self.directory / CA_FILE)
        if self._ca is not None:
            self._trust(self._ca.decode("ascii"))
        return key

    def usable(self, address: str) -> bool:
        """A certificate from the fleet's CA for ``address``, not expired."""
        key = self._load()
        return check_certificate(self._cert, key, address, self._ca).usable

    def request(self, address: str) -> str | None:
        """The CSR for the next report, or None while the certificate serves and is fresh."""
        key = self._load()
        state = check_certificate(self._cert, key, address, self._ca)
        return make_csr(key, self.node, address) if state.renew else None

    def accept(self, cert_pem: str, ca_pem: str, address: str) -> bool:
        """Keep the certificate an answer brought, if it is ours and for ``address``."""
        key = self._load()
        cert, ca = cert_pem.encode("ascii"), ca_pem.encode("ascii")
        state = check_certificate(cert, key, address, ca)
        if not state.usable:
            log.warning("the control plane's certificate for this node is unusable: %s",
                        state.reason)
            return False
        _write(self.directory / CA_FILE, ca)
        _write(self.cert_file, cert)
        if ca != self._ca:
            self._trust(ca_pem)
        self._cert, self._ca = cert, ca
        if self._server is not None:
            self._server.load_cert_chain(str(self.cert_file), str(self.key_file))
        log.info("server certificate for %s kept (%s)", address, self.cert_file)
        return True

    def _trust(self, ca_pem: str) -> None:
        self.peer_context.load_verify_locations(cadata=ca_pem)
        self.engine_probe_context.load_verify_locations(cadata=ca_pem)

    def engine_files(self, address: str) -> tuple[Path, Path] | None:
        """Certificate and key files for engines to listen with; None while unusable."""
        return (self.cert_file, self.key_file) if self.usable(address) else None

    def server_context(self) -> ssl.SSLContext:
        """The server's context (once usable); renewed certificates load into it in place."""
        if self._server is None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(str(self.cert_file), str(self.key_file))
            self._server = context
        return self._server


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
