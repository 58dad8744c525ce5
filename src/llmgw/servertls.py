"""How llmgw's servers listen with TLS: the fleet's own CA, made on first start, and
the server certificate it issues.

``llmgw serve`` (and a gateway that makes its own CA) keeps both in its data
dir: the CA once and for good, since its fingerprint is in every join token,
the server certificate issued again whenever it does not cover the names the
server answers on or is close to expiring. An operator may give certificates
instead (:func:`given_server_tls`). The CA certificate is handed to anyone
at ``/tls/v1/ca.pem`` (:class:`CaRoute`); what makes a client trust it is the
fingerprint, the clients' side (llmgw.tls).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.errors import ConfigError
from llmgw.http.contract import App, Receive, Reply, Scope
from llmgw.tls import CA_CERT, CA_PATH, fingerprint

CA_KEY = "ca.key"
SERVER_CERT = "server.pem"
SERVER_KEY = "server.key"
# Long: renewing means every agent's CA changes; the fingerprint pins the key.
CA_DAYS = 3650
# A server certificate is reissued by serve itself on any start that needs it.
SERVER_DAYS = 825


@dataclass(frozen=True)
class ServerTls:
    """The certificate a server listens with, and the CA its clients should trust."""

    cert_file: Path
    key_file: Path
    # None when the operator gave a certificate without its CA.
    ca_file: Path | None
    # The CA's private key, with which the control plane signs the nodes'
    # server certificates (llmgw.nodetls); None: it signs none.
    ca_key_file: Path | None = None

    def uvicorn_settings(self) -> dict[str, Any]:
        return {"ssl_certfile": str(self.cert_file), "ssl_keyfile": str(self.key_file)}

    def ca_pem(self) -> bytes | None:
        return self.ca_file.read_bytes() if self.ca_file is not None else None

    def ca_fingerprint(self) -> str | None:
        pem = self.ca_pem()
        return fingerprint(pem) if pem is not None else None


def given_server_tls(
    cert: Path, key: Path, ca: Path | None, ca_key: Path | None = None
) -> ServerTls:
    """An operator's certificate, checked now so that a typo fails before anything starts."""
    if ca_key is not None and ca is None:
        raise ConfigError("--tls-ca-key needs --tls-ca, the certificate of that key")
    for path, what in ((cert, "--tls-cert"), (key, "--tls-key"), (ca, "--tls-ca"),
                       (ca_key, "--tls-ca-key")):
        if path is not None and not path.is_file():
            raise ConfigError(f"{what} {path} is not a readable file")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(str(cert), str(key))
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"--tls-cert/--tls-key: cannot use them: {exc}") from None
    if ca is not None:
        fingerprint(ca.read_bytes())  # a readable PEM certificate, or a clear error
    if ca is not None and ca_key is not None:
        _check_ca_pair(ca.read_bytes(), ca_key.read_bytes(), "--tls-ca-key")
    return ServerTls(cert, key, ca, ca_key)


def server_names(host: str, advertise: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    """Names a generated server certificate covers: this machine's, the bind and advertise hosts."""
    names = ["localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()]
    if host not in ("0.0.0.0", "::", ""):
        names.append(host.strip("[]"))
    if advertise:
        names.append(urlsplit(advertise).hostname or "")
    names.extend(extra)
    return list(dict.fromkeys(name for name in names if name))


def ensure_server_tls(directory: Path, names: Sequence[str]) -> ServerTls:
    """The CA and server certificate in ``directory``, made on first use.

    The CA is made once and kept (its fingerprint is in every join token);
    the server certificate is issued again whenever it does not cover
    ``names`` (a new ``--advertise-url``) or is close to expiring.
    """
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    ca_cert_path, ca_key_path = directory / CA_CERT, directory / CA_KEY
    if not ca_cert_path.exists() or not ca_key_path.exists():
        write_ca(directory, *make_ca())
    ca_cert = x509.load_pem_x509_certificate(ca_cert_path.read_bytes())
    ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{ca_key_path}: expected the EC key llmgw makes")
    cert_path, key_path = directory / SERVER_CERT, directory / SERVER_KEY
    if not _covers(cert_path, names, ca_cert):
        _write_server_cert(cert_path, key_path, names, ca_cert, ca_key)
    return ServerTls(cert_path, key_path, ca_cert_path, ca_key_path)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_ca() -> tuple[bytes, bytes]:
    """A new fleet CA: (certificate PEM, private key PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                         f"llmgw fleet CA ({socket.gethostname()})")])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=False, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
            encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def write_ca(directory: Path, cert_pem: bytes, key_pem: bytes) -> None:
    """The CA into ``directory`` (its key owner-only), where ensure_server_tls looks."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    _check_ca_pair(cert_pem, key_pem, "the CA")
    _write_private(directory / CA_KEY, key_pem)
    (directory / CA_CERT).write_bytes(cert_pem)


def _check_ca_pair(cert_pem: bytes, key_pem: bytes, what: str) -> None:
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except ValueError as exc:
        raise ConfigError(f"{what}: cannot read it: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
        raise ConfigError(f"{what}: the key is not the CA certificate's EC key")


def _san(names: Sequence[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def certificate_names(cert_path: Path) -> list[str]:
    """The DNS names and IP addresses a server certificate covers (none if unreadable)."""
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, x509.ExtensionNotFound):
        return []
    return ([str(v) for v in san.get_values_for_type(x509.DNSName)]
            + [str(v) for v in san.get_values_for_type(x509.IPAddress)])


def _covers(cert_path: Path, names: Sequence[str], ca_cert: x509.Certificate) -> bool:
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, x509.ExtensionNotFound):
        return False
    have = {str(v) for v in san.get_values_for_type(x509.DNSName)}
    have |= {str(v) for v in san.get_values_for_type(x509.IPAddress)}
    wanted = {str(ipaddress.ip_address(n)) if _is_ip(n) else n for n in names}
    fresh = cert.not_valid_after_utc - _now() > datetime.timedelta(days=30)
    return wanted <= have and fresh and cert.issuer == ca_cert.subject


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _write_server_cert(cert_path: Path, key_path: Path, names: Sequence[str],
                       ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=SERVER_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_san(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write_private(key_path, _key_pem(key))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


class CaRoute:
    """``GET /tls/v1/ca.pem`` in front of an app: the CA certificate, to anyone.

    A client that has only the fingerprint fetches it here (without checking
    the server, since it cannot yet) and keeps it only if the fingerprint
    matches. The app's endpoints stay its own (llmgw.http.contract.App): the
    server runs them without this frame; other requests pay one string
    comparison.
    """

    def __init__(self, app: App, ca_pem: bytes) -> None:
        self.app = app
        self.endpoints = app.endpoints
        self.ca_pem = ca_pem

    async def __call__(self, scope: Scope, receive: Receive, send: Reply) -> None:
        if scope["type"] == "http" and scope["path"] == CA_PATH:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"application/x-pem-file"),
                (b"content-length", str(len(self.ca_pem)).encode())]})
            await send({"type": "http.response.body", "body": self.ca_pem})
            return
        await self.app(scope, receive, send)
