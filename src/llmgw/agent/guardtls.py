"""The engine guard's TLS: the node's certificate as a server context, renewed in place.

The guard (agent.engineguard) terminates TLS for every engine it stands in
front of, so an engine is https where the fleet runs TLS whether or not it
has TLS flags of its own. The agent renews the node's certificate on disk;
the guard's listening server keeps one context, which takes the renewed
certificate up for the next handshake. Standard library only, as the
guard's process is.
"""

from __future__ import annotations

import logging
import os
import ssl
import time
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("llmgw.agent.engineguard")

# How often a new connection may look whether the certificate was renewed.
TLS_RELOAD_EVERY_S = 30.0


class TlsFiles(Protocol):
    """The node's certificate and key files (agent.engines.base.EngineTls)."""

    @property
    def cert_file(self) -> str: ...

    @property
    def key_file(self) -> str: ...


@dataclass(frozen=True)
class CertFiles:
    cert_file: str
    key_file: str


class ServerTls:
    """The node certificate as a server context, reloaded when its file changes."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._mtime = self._stat()
        self.context.load_cert_chain(files.cert_file, files.key_file)
        self._checked = time.monotonic()

    def _stat(self) -> float:
        try:
            return os.stat(self.files.cert_file).st_mtime
        except OSError:
            return 0.0

    def maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < TLS_RELOAD_EVERY_S:
            return
        self._checked = now
        mtime = self._stat()
        if mtime == self._mtime:
            return
        try:
            # The same context: the listening server keeps it, and the next
            # handshake uses the renewed certificate.
            self.context.load_cert_chain(self.files.cert_file, self.files.key_file)
            self._mtime = mtime
        except (OSError, ssl.SSLError) as exc:
            log.warning("engine guard: cannot load the renewed certificate: %s", exc)
