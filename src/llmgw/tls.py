"""TLS between llmgw's parts: the fleet's own CA, and how each client comes to trust it.

Every token llmgw hands out (node, gateway, admin, join, peer) and every
assignment (a model's ``env`` included) crosses the network; in plain HTTP a
machine on the path reads the tokens and rewrites the assignments. So
``llmgw serve`` listens with TLS, under a certificate issued by a CA of its
own that it makes on first start in its data dir (or under certificates an
operator gives it).

A client must trust that CA before its first call, or its first call (the
join token, the admin token) is exactly what a machine in the middle wants.
As kubeadm's ``discovery-token-ca-cert-hash`` does, the join token carries
the CA's fingerprint (``llmgw-join-....sha256:<hex>``: SHA-256 of the CA's
public key, so a CA certificate renewed on the same key keeps it): the agent
fetches the CA certificate from the control plane without checking (it is
public), keeps it only if its key has that fingerprint, stores it in its data
dir, and from then on verifies the control plane against it on every call,
the first registration included. Gateways and ``ctl`` take a CA file or the
fingerprint the same way; ``ctl`` on the control plane's machine reads the CA
path from ``up.json``.

Plain HTTP stays possible where it crosses no network (a loopback address)
or where an operator says so (``--insecure-http``): :func:`check_plain_url`
and :func:`check_plain_bind` are the one place that rule lives.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import re
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.errors import ConfigError

CA_CERT = "ca.pem"
CA_KEY = "ca.key"
SERVER_CERT = "server.pem"
SERVER_KEY = "server.key"
# Where the control plane (and a gateway that made its own CA) hands out the
# CA certificate: public, like any CA certificate; the fingerprint is what
# makes it trusted.
CA_PATH = "/tls/v1/ca.pem"
FINGERPRINT_PREFIX = "sha256:"
_FINGERPRINT = re.compile(r"^(?:sha256:)?([0-9a-fA-F]{64})$")
_PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]{1,40})-----")
# Long: renewing means every agent's CA changes; the fingerprint pins the key.
CA_DAYS = 3650
# A server certificate is reissued by serve itself on any start that needs it.
SERVER_DAYS = 825
INSECURE_FLAG = "--insecure-http"


# Marks a certificate the control plane issued to a node (llmgw.nodetls), in
# its extended key usage beside serverAuth. One CA signs the control plane's
# and the nodes' certificates, so without a mark a node's certificate for a
# name the control plane also answers on would pass for the control plane's;
# llmgw's clients of the control plane refuse a marked certificate
# (:func:`refuse_node_certificates`). A UUID-based OID (2.25), needing no
# registration.
NODE_CERTIFICATE_OID = x509.ObjectIdentifier("2.25.261437104931650463517207433049346734171")


class TrustError(ConfigError):
    """The server is not the one the client was told to trust (wrong CA, wrong fingerprint)."""


# -- fingerprints and join tokens ------------------------------------------------


def pinned_certificate(pem: bytes, what: str = "the CA") -> x509.Certificate:
    """The one certificate a pinned CA file holds; any other shape is refused.

    A fingerprint names one key. A bundle whose first certificate has it and
    whose others do not would pass a check of the first alone, and a client
    trusting the whole file would then trust certificates from the others: a
    machine on the path at the first contact serves the real CA followed by
    its own and receives the join token. So a pin is exactly one PEM block,
    a certificate, and trust is built from that certificate alone.
    """
    blocks = _PEM_BLOCK.findall(pem)
    if blocks != [b"CERTIFICATE"]:
        shape = ", ".join(b.decode("ascii", "replace") for b in blocks) or "no PEM block"
        raise TrustError(
            f"{what} must be exactly one PEM certificate, and holds {len(blocks)} PEM "
            f"block(s) ({shape}): a pinned CA is one certificate, whose key the fingerprint "
            "names; refusing it rather than trusting certificates the fingerprint does not name"
        )
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise ConfigError(f"{what} is not a PEM certificate: {exc}") from None


def certificate_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_fingerprint(cert: x509.Certificate) -> str:
    """``sha256:<hex>`` of the certificate's public key (SubjectPublicKeyInfo, DER)."""
    spki = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return FINGERPRINT_PREFIX + hashlib.sha256(spki).hexdigest()


def fingerprint(cert_pem: bytes) -> str:
    """``sha256:<hex>`` of the one certificate's public key; a bundle is refused."""
    return key_fingerprint(pinned_certificate(cert_pem))


def parse_fingerprint(text: str) -> str:
    """A fingerprint as given (``sha256:HEX`` or bare HEX), normalised."""
    match = _FINGERPRINT.match(text.strip())
    if match is None:
        raise ConfigError(
            f"CA fingerprint {text.strip()[:80]!r} is not sha256:<64 hex digits>"
        )
    return FINGERPRINT_PREFIX + match.group(1).lower()


def token_with_fingerprint(token: str, ca_fingerprint: str | None) -> str:
    """The join token as handed to an operator: ``<secret>.sha256:<hex>`` under TLS."""
    return f"{token}.{ca_fingerprint}" if ca_fingerprint else token


def split_join_token(token: str) -> tuple[str, str | None]:
    """(the secret the control plane checks, the CA fingerprint it carried, if any)."""
    secret, sep, tail = token.strip().rpartition("." + FINGERPRINT_PREFIX)
    if not sep:
        return token.strip(), None
    return secret, parse_fingerprint(tail)


# -- plain HTTP policy -------------------------------------------------------------


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_plain_url(url: str, *, allowed: bool, what: str) -> None:
    """Refuse ``http://`` to another machine unless ``--insecure-http`` said so."""
    parts = urlsplit(url)
    if parts.scheme == "http" and not allowed and not is_loopback(parts.hostname or ""):
        raise ConfigError(
            f"{what} {url} is plain HTTP: tokens and assignments would cross the network "
            f"in the clear; use https:// (see docs/security.md) or pass {INSECURE_FLAG}"
        )


def check_plain_urls(urls: Iterable[str], *, allowed: bool, what: str) -> None:
    for url in urls:
        check_plain_url(url, allowed=allowed, what=what)


def wants_tls(host: str, *, tls: bool | None, insecure_http: bool) -> bool:
    """Whether a server bound to ``host`` listens with TLS.

    ``--tls`` and ``--insecure-http`` decide when given; otherwise a loopback
    bind stays plain (nothing leaves the machine, and a browser on it needs no
    certificate warning) and any other bind uses TLS.
    """
    if tls and insecure_http:
        raise ConfigError(f"--tls and {INSECURE_FLAG} contradict each other")
    if tls is not None:
        return tls
    return not insecure_http and not is_loopback(host)


# -- the server's side ----------------------------------------------------------------


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
    """``GET /tls/v1/ca.pem`` in front of an ASGI app: the CA certificate, to anyone.

    A client that has only the fingerprint fetches it here (without checking
    the server, since it cannot yet) and keeps it only if the fingerprint
    matches. One string comparison per request on the hot path.
    """

    def __init__(self, app: Any, ca_pem: bytes) -> None:
        self.app = app
        self.ca_pem = ca_pem

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == CA_PATH:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"application/x-pem-file"),
                (b"content-length", str(len(self.ca_pem)).encode())]})
            await send({"type": "http.response.body", "body": self.ca_pem})
            return
        await self.app(scope, receive, send)


# -- the clients' side ------------------------------------------------------------------


def is_node_certificate(der: bytes) -> bool:
    """Whether a certificate (DER) is one the control plane issued to a node."""
    try:
        usage = x509.load_der_x509_certificate(der).extensions.get_extension_for_class(
            x509.ExtendedKeyUsage).value
    except (ValueError, x509.ExtensionNotFound):
        return False
    return NODE_CERTIFICATE_OID in usage


def _refuse_node_peer(der: bytes | None) -> None:
    if der is not None and is_node_certificate(der):
        raise ssl.SSLCertVerificationError(
            "the server presents a node's certificate (issued by the fleet's CA to an agent),"
            " not the control plane's or a gateway's: a node may be posing as one; refused")


class _NodeRefusingObject(ssl.SSLObject):
    """What asyncio's TLS (aiohttp, httpx async) runs: the chain check, then the role check."""

    def do_handshake(self) -> None:
        super().do_handshake()
        _refuse_node_peer(self.getpeercert(binary_form=True))


class _NodeRefusingSocket(ssl.SSLSocket):
    """The same for blocking sockets (httpx in ``ctl``)."""

    def do_handshake(self, block: bool = False) -> None:
        super().do_handshake(block)
        _refuse_node_peer(self.getpeercert(binary_form=True))


def refuse_node_certificates(context: ssl.SSLContext) -> ssl.SSLContext:
    """``context``, made to refuse a server whose certificate is a node's.

    For every client of the control plane and of gateways: the chain is
    verified as before, and once it holds, a certificate carrying
    :data:`NODE_CERTIFICATE_OID` fails the handshake, before any request
    (a token) is sent.
    """
    context.sslobject_class = _NodeRefusingObject
    context.sslsocket_class = _NodeRefusingSocket
    return context


def client_context(ca_file: Path) -> ssl.SSLContext:
    """Verifies servers against the CAs of an operator's file only (not the system's CAs)."""
    try:
        return refuse_node_certificates(ssl.create_default_context(cafile=str(ca_file)))
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"CA file {ca_file}: cannot use it: {exc}") from None


def pinned_context(cert: x509.Certificate) -> ssl.SSLContext:
    """Verifies servers against one pinned CA certificate and nothing else (nor a node)."""
    return refuse_node_certificates(
        ssl.create_default_context(cadata=certificate_pem(cert).decode("ascii")))


def check_ca_file(ca_file: Path, expected: str | None) -> bytes:
    """The CA file's PEM, refused if it does not have the fingerprint expected.

    With a fingerprint expected the file must be that one certificate
    (:func:`pinned_certificate`); without, it is the operator's own choice of
    CAs (a bundle, the system's) and is read as it is.
    """
    try:
        pem = ca_file.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read CA file {ca_file}: {exc.strerror or exc}") from None
    if expected is not None:
        got = key_fingerprint(pinned_certificate(pem, f"CA file {ca_file}"))
        if got != expected:
            raise TrustError(f"CA file {ca_file} has fingerprint {got}, not {expected}")
    return pem


async def fetch_ca(
    session: aiohttp.ClientSession, urls: Sequence[str], expected: str,
    *, timeout_s: float = 10.0,
) -> bytes:
    """The CA certificate from the first https URL that answers, if it has ``expected``.

    Raises :class:`TrustError` when a server hands out a CA with another
    fingerprint (someone in the path, or a join token of another fleet), and
    ConnectionError when none answered (the caller retries).
    """
    problems: list[str] = []
    for url in urls:
        if not url.startswith("https://"):
            continue
        try:
            async with session.get(url + CA_PATH, ssl=False, allow_redirects=False,
                                   timeout=aiohttp.ClientTimeout(total=timeout_s)) as answer:
                pem = await answer.read()
                status = answer.status
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            problems.append(f"{url}: {exc!r}")
            continue
        if status != 200:
            problems.append(f"{url}{CA_PATH}: HTTP {status}")
            continue
        try:
            got = key_fingerprint(pinned_certificate(pem, f"{url}{CA_PATH}"))
        except TrustError:
            raise
        except ConfigError:
            raise TrustError(f"{url} answered {CA_PATH} with something that is not a "
                             "certificate; is this an llmgw control plane?") from None
        if got != expected:
            raise TrustError(
                f"the control plane at {url} presents a CA with fingerprint {got}, not "
                f"{expected} as the join token (or --ca-hash) says: refusing to talk to it "
                "(a machine in the path, or a token of another fleet)"
            )
        return pem
    raise ConnectionError("cannot fetch the CA certificate: " + ("; ".join(problems)
                                                                  or "no https:// URL"))


@dataclass
class ClientTrust:
    """How a long-running client (agent, gateway) comes to trust the control plane.

    Given a CA file, that; else the CA kept in ``store`` by an earlier run;
    else fetched once with the fingerprint and kept in ``store``. Resolved on
    the first call (the control plane may not be up when the client starts).
    """

    ca_file: Path | None = None
    ca_fingerprint: str | None = None
    store: Path | None = None

    def __post_init__(self) -> None:
        self._context: ssl.SSLContext | None = None

    async def context(
        self, urls: Sequence[str], fetch: Callable[[Sequence[str], str], Awaitable[bytes]]
    ) -> ssl.SSLContext | None:
        """The SSL context for ``urls``; None when none is https (nothing to verify)."""
        if self._context is not None or not any(u.startswith("https://") for u in urls):
            return self._context
        if self.ca_file is not None:
            pem = check_ca_file(self.ca_file, self.ca_fingerprint)
            self._context = (client_context(self.ca_file) if self.ca_fingerprint is None
                             else pinned_context(pinned_certificate(pem)))
            return self._context
        kept = self._kept()
        if kept is not None:
            self._context = pinned_context(kept)
            return self._context
        if self.ca_fingerprint is None:
            raise TrustError(
                f"{urls[0]} uses TLS and this client has no CA to check it against: give a "
                "join token with the CA's fingerprint (llmgw-join-....sha256:...), --ca-hash, "
                "or --ca-file (for a certificate from a public CA: the system's bundle, e.g. "
                "/etc/ssl/certs/ca-certificates.crt)"
            )
        cert = pinned_certificate(await fetch(urls, self.ca_fingerprint))
        if self.store is not None:
            self.store.parent.mkdir(parents=True, exist_ok=True)
            self.store.write_bytes(certificate_pem(cert))
        self._context = pinned_context(cert)
        return self._context

    def _kept(self) -> x509.Certificate | None:
        """The CA an earlier run kept, if it is one certificate with the fingerprint.

        Anything else (another fingerprint, or a bundle an older llmgw kept
        whole) is fetched again under the pin when there is one.
        """
        if self.store is None or not self.store.exists():
            return None
        try:
            cert = pinned_certificate(self.store.read_bytes(), f"the kept CA {self.store}")
        except ConfigError:
            if self.ca_fingerprint is not None:
                return None
            raise
        if self.ca_fingerprint is not None and key_fingerprint(cert) != self.ca_fingerprint:
            return None
        return cert
