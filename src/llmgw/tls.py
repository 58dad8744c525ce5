"""TLS between llmgw's parts: how each client comes to trust the fleet's own CA.

Every token llmgw hands out (node, gateway, admin, join, peer) and every
assignment (a model's ``env`` included) crosses the network; in plain HTTP a
machine on the path reads the tokens and rewrites the assignments. So
``llmgw serve`` listens with TLS, under a certificate issued by a CA of its
own that it makes on first start in its data dir (or under certificates an
operator gives it): the server's side, llmgw.servertls.

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
and :func:`wants_tls` are the one place that rule lives.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import ssl
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from llmgw.errors import ConfigError

# The CA certificate's file name, in a server's TLS folder and in a client's data dir.
CA_CERT = "ca.pem"
# Where the control plane (and a gateway that made its own CA) hands out the
# CA certificate: public, like any CA certificate; the fingerprint is what
# makes it trusted.
CA_PATH = "/tls/v1/ca.pem"
FINGERPRINT_PREFIX = "sha256:"
_FINGERPRINT = re.compile(r"^(?:sha256:)?([0-9a-fA-F]{64})$")
_PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]{1,40})-----")
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
