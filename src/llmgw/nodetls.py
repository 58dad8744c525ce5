"""Certificates for the nodes' own servers, issued by the fleet's CA.

Each agent runs a server of its own (peer weights, the control plane's
nudges, /metrics), and peers send it the peer token. In plain HTTP a machine
on the node network reads that token and the weights, and can pose as a peer.
So where the fleet runs TLS, every agent gets a certificate for its address
from the control plane, signed by the CA the agent already trusts (llmgw.tls),
and its server listens with it; peers and the control plane verify it
against that CA and that address.

The agent makes its key and never sends it: it asks with a CSR in a report
(the node token proves who asks), and the control plane signs the CSR's
public key under names it chooses itself (the node's name, the address the
node reports), not the names in the CSR. A certificate lasts ``NODE_DAYS``
and is asked for again once a third of that is left, or when the node's
address changes; renewal rides on the ordinary reports, so a node that
reports keeps a valid certificate without anyone acting.

This module is the crypto both sides share; who may get what is decided by
the control plane (control/reports.py), when to ask by the agent
(agent/nodecert.py).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.errors import ConfigError
from llmgw.tls import NODE_CERTIFICATE_OID, is_node_certificate

# Short, since renewal costs nothing (it rides on reports) and a certificate
# of a node that was deleted, or moved to another address, should not be
# good for years.
NODE_DAYS = 90
# Asked for again when this much of its life is left.
RENEW_FRACTION = 1 / 3
# A PEM CSR for one EC key is well under 1 KiB; the cap keeps reports small.
MAX_CSR_CHARS = 4096


class CertificateRefused(ValueError):
    """A CSR the control plane will not sign (bad signature, not an EC key, too large)."""


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def normal_address(address: str) -> str:
    """One spelling of a node's address: what its certificate names and claims bind.

    Host names are compared without regard to case (DNS) and a trailing dot,
    and one IPv6 address has many spellings (zeros, case, an IPv4-mapped
    form): without one spelling, a second node could claim a peer's address
    under another.
    """
    host = address.strip().strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host.lower().rstrip(".")
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def _name_of(address: str) -> x509.GeneralName:
    address = normal_address(address)
    try:
        return x509.IPAddress(ipaddress.ip_address(address))
    except ValueError:
        return x509.DNSName(address)


# -- the agent's side -------------------------------------------------------------------


def load_or_make_key(path: Path) -> ec.EllipticCurvePrivateKey:
    """The node's private key, made (owner-only) on first use; it never leaves the node."""
    if path.exists():
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if isinstance(key, ec.EllipticCurvePrivateKey):
            return key
        raise ConfigError(f"{path}: not the EC key llmgw makes; delete it to make a new one")
    key = ec.generate_private_key(ec.SECP256R1())
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(key.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    return key


def make_csr(key: ec.EllipticCurvePrivateKey, node: str, address: str) -> str:
    """A PEM CSR naming ``node`` and ``address`` (the control plane decides the names anyway)."""
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node)]))
        .add_extension(x509.SubjectAlternativeName([_name_of(address)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM).decode("ascii")


@dataclass(frozen=True)
class CertificateState:
    """Whether a node's certificate still serves, and why not when it does not."""

    usable: bool
    renew: bool
    reason: str


def check_certificate(
    cert_pem: bytes | None, key: ec.EllipticCurvePrivateKey, address: str, ca_pem: bytes | None
) -> CertificateState:
    """Is ``cert_pem`` this key's, for ``address``, from ``ca_pem``, and fresh enough?"""
    if cert_pem is None or ca_pem is None:
        return CertificateState(False, True, "no certificate yet")
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        ca = x509.load_pem_x509_certificate(ca_pem)
    except ValueError:
        return CertificateState(False, True, "the stored certificate cannot be read")
    if cert.public_key() != key.public_key():
        return CertificateState(False, True, "the certificate is for another key")
    if cert.issuer != ca.subject:
        return CertificateState(False, True, "the certificate is from another CA")
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return CertificateState(False, True, "the certificate names no address")
    if _name_of(address) not in list(san):
        return CertificateState(False, True, f"the certificate is not for address {address}")
    now = _now()
    if now >= cert.not_valid_after_utc:
        return CertificateState(False, True, "the certificate expired")
    if not is_node_certificate(cert.public_bytes(serialization.Encoding.DER)):
        # Issued before node certificates were marked: serves until the new
        # one arrives with the next report.
        return CertificateState(True, True, "issued without the node mark")
    life = cert.not_valid_after_utc - cert.not_valid_before_utc
    renew = cert.not_valid_after_utc - now < life * RENEW_FRACTION
    return CertificateState(True, renew, "due for renewal" if renew else "valid")


def server_context(cert_file: Path, key_file: Path) -> ssl.SSLContext:
    """The agent server's context; :meth:`ssl.SSLContext.load_cert_chain` again renews it live."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(cert_file), str(key_file))
    return context


def peer_context(ca_pem: bytes) -> ssl.SSLContext:
    """Verifies another node's server against the fleet's CA (and its address)."""
    return ssl.create_default_context(cadata=ca_pem.decode("ascii"))


# -- the control plane's side ------------------------------------------------------------


class NodeIssuer:
    """Signs node certificates with the fleet's CA (the control plane holds its key)."""

    def __init__(self, ca_cert_pem: bytes, ca_key_pem: bytes) -> None:
        self.ca_pem = ca_cert_pem
        self._ca = x509.load_pem_x509_certificate(ca_cert_pem)
        key = serialization.load_pem_private_key(ca_key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ConfigError("the CA key is not an EC key; node certificates need llmgw's CA")
        if key.public_key() != self._ca.public_key():
            raise ConfigError("the CA key does not belong to the CA certificate")
        self._key = key

    @classmethod
    def from_files(cls, ca_cert: Path, ca_key: Path) -> NodeIssuer:
        try:
            return cls(ca_cert.read_bytes(), ca_key.read_bytes())
        except OSError as exc:
            raise ConfigError(f"cannot read the CA for node certificates: {exc}") from None
        except ValueError as exc:
            raise ConfigError(f"the CA for node certificates cannot be used: {exc}") from None

    def issue(self, csr_pem: str, node: str, address: str) -> str:
        """A certificate for the CSR's key, naming ``node`` and valid for ``address`` only."""
        if len(csr_pem) > MAX_CSR_CHARS:
            raise CertificateRefused(f"the CSR is over {MAX_CSR_CHARS} characters")
        try:
            csr = x509.load_pem_x509_csr(csr_pem.encode("ascii"))
        except (ValueError, UnicodeEncodeError):
            raise CertificateRefused("the CSR is not a PEM certificate request") from None
        try:
            valid = csr.is_signature_valid
        except InvalidSignature:  # pragma: no cover - older cryptography raised
            valid = False
        if not valid:
            raise CertificateRefused("the CSR's signature does not match its key")
        public_key = csr.public_key()
        if not isinstance(public_key, ec.EllipticCurvePublicKey):
            raise CertificateRefused("the CSR's key is not an EC key")
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node)]))
            .issuer_name(self._ca.subject).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=NODE_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([_name_of(address)]), critical=False)
            # Marked as a node's, so that llmgw's clients of the control plane
            # refuse it whatever name it carries (llmgw.tls).
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  NODE_CERTIFICATE_OID]), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM).decode("ascii")
