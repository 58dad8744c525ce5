"""What ``serve`` and ``up`` share: the control plane and the gateway in one process, on one port.

Both open the store the same way, listen the same way (TLS decided by
:class:`TlsOptions`) and stop their parts in the same order; ``up`` adds its
agents around that (llmgw.cli.up), ``serve`` its leadership (llmgw.cli.serve).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import uvicorn

from llmgw.cli.secretfile import metrics_token_from
from llmgw.config import sqlite_url
from llmgw.control.access.settings import OidcSettings
from llmgw.control.app import ControlApp, create_app
from llmgw.control.gateway_link import InProcessLink
from llmgw.control.jointokens import DEFAULT_TTL_S as DEFAULT_JOIN_TTL_S
from llmgw.control.metrics import ControlCollector
from llmgw.control.nodecerts import NodeCertificates
from llmgw.control.plane import ControlPlane, NewCredentials
from llmgw.control.runtime import ControlPlaneRuntime
from llmgw.control.store.db import normalise_url
from llmgw.control.store.repo import Store
from llmgw.errors import ConfigError
from llmgw.http.contract import App, Endpoint, Receive, Reply, Scope
from llmgw.http.server import server_config
from llmgw.nodetls import NodeIssuer
from llmgw.servertls import (
    CaRoute,
    ServerTls,
    certificate_names,
    ensure_server_tls,
    given_server_tls,
    server_names,
)
from llmgw.serving import ServerNotStarted, start_server
from llmgw.tls import wants_tls

if TYPE_CHECKING:
    from llmgw.gateway.app import Gateway


@dataclass
class TlsOptions:
    """How ``serve``/``up`` listen (llmgw.servertls): given certificates, or the data dir's own CA.

    ``tls`` None decides by the bind address: a loopback bind stays plain
    (nothing leaves the machine), any other bind uses TLS unless
    ``insecure_http`` says otherwise.
    """

    tls: bool | None = None
    insecure_http: bool = False
    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    ca_key: Path | None = None
    # More names for a generated certificate (a load balancer's, a DNS alias).
    names: list[str] = field(default_factory=list)

    def wanted(self, host: str) -> bool:
        if self.cert is not None and self.insecure_http:
            raise ConfigError("--tls-cert and --insecure-http contradict each other")
        return self.cert is not None or wants_tls(host, tls=self.tls,
                                                  insecure_http=self.insecure_http)

    def resolve(self, data_dir: Path, host: str, advertise: str | None) -> ServerTls | None:
        """The certificate to listen with (made in ``data_dir/tls`` if needed), or None."""
        if (self.cert is None) != (self.key is None):
            raise ConfigError("--tls-cert and --tls-key go together")
        if not self.wanted(host):
            return None
        if self.cert is not None and self.key is not None:
            return given_server_tls(self.cert, self.key, self.ca, self.ca_key)
        if self.ca_key is not None:
            raise ConfigError("--tls-ca-key goes with --tls-cert and --tls-ca")
        return ensure_server_tls(data_dir / "tls", server_names(host, advertise, self.names))

    def generated(self, host: str) -> bool:
        """TLS under the data dir's own CA (no certificates given)."""
        return self.cert is None and self.wanted(host)


@dataclass
class ProcessOptions:
    """Where a ``serve`` or ``up`` process keeps its state and listens."""

    data_dir: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    database_url: str | None = None
    tls: TlsOptions = field(default_factory=lambda: TlsOptions())
    # Variables external models' api_key_env may name besides LLMGW_EXTERNAL_*.
    allow_key_env: frozenset[str] = frozenset()
    # /metrics without a token (--open-metrics); otherwise it wants the admin
    # token or the metrics token.
    open_metrics: bool = False
    # Single sign-on for the console and admin API (--oidc-*); None: the admin token alone.
    sso: OidcSettings | None = None


def resolve_store_url(data_dir: Path, database_url: str | None) -> str:
    return normalise_url(database_url) if database_url else sqlite_url(data_dir)


def public_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


async def open_control_plane(
    url: str, join_token_ttl_s: float | None = DEFAULT_JOIN_TTL_S
) -> tuple[Store, ControlPlane, NewCredentials]:
    store = await Store.open(url)
    cp = ControlPlane(store)
    cp.credentials.join_token_ttl_s = join_token_ttl_s
    await cp.load()
    creds = await cp.ensure_credentials()
    return store, cp, creds


def sign_node_certificates(
    cp: ControlPlane, tls: ServerTls | None, instances: Sequence[str] = ()
) -> None:
    """Give the control plane the CA's key, where it listens with TLS and holds one.

    The agents' servers then listen with certificates from the fleet's CA
    (control.nodecerts); without the key (an operator's certificate without
    --tls-ca-key) they stay plain, and their agents say so.
    """
    if tls is None or tls.ca_file is None or tls.ca_key_file is None:
        return
    # No node may be given a name the control plane answers on: those its
    # certificate covers, and the hosts of the other instances (``instances``:
    # URLs), whose certificates come from the same CA.
    hosts = [urlsplit(url).hostname or "" for url in instances]
    certs = NodeCertificates(NodeIssuer.from_files(tls.ca_file, tls.ca_key_file),
                             reserved=[*certificate_names(tls.cert_file), *filter(None, hosts)])
    certs.claims = cp.node_certs.claims  # read from the store by cp.load()
    cp.node_certs = certs


class PathDispatcher:
    """One port for everything: /v1 and /metrics to the gateway, the rest to
    the control plane. Chosen per request by a prefix test, nothing more, so
    the gateway's hot path pays one string comparison for sharing the port."""

    def __init__(self, control: App, gateway: App) -> None:
        self.control = control
        self.gateway = gateway
        # The gateway's endpoints on the paths it is sent here (llmgw's server
        # runs them without this dispatcher's frame); its /health is the control plane's.
        self.endpoints: dict[tuple[str, str], Endpoint] = {
            (method, path): endpoint
            for (method, path), endpoint in gateway.endpoints.items()
            if path.startswith("/v1/") or path == "/metrics"
        }
        # The control plane's too (agent reports: control/app.py).
        self.endpoints.update(control.endpoints)

    async def __call__(self, scope: Scope, receive: Receive, send: Reply) -> None:
        if scope["type"] in ("http", "websocket"):
            path: str = scope["path"]
            if path.startswith("/v1/") or path == "/v1" or path == "/metrics":
                await self.gateway(scope, receive, send)
                return
        await self.control(scope, receive, send)


def freeze_startup_objects() -> None:
    from llmgw.gateway.app import freeze_startup_objects as freeze

    freeze()


def build_gateway(
    cp: ControlPlane, allow_key_env: frozenset[str] = frozenset(), *, open_metrics: bool = False
) -> Gateway:
    from llmgw.gateway.app import Gateway
    from llmgw.gateway.settings import GatewaySettings

    # /metrics shares the port with /v1, where clients come: it names every
    # model, node and device and shows the traffic, so it wants a token (the
    # admin token, which every operator holds, or a metrics token for the
    # monitoring system) unless the operator opens it.
    settings = GatewaySettings(metrics_token=metrics_token_from(), key_env_allowed=allow_key_env,
                               metrics_open=open_metrics, metrics_admin=cp.credentials.is_admin)
    gateway = Gateway(InProcessLink(cp), settings)
    # One scrape target per process: the gateway's /metrics (the dispatcher
    # sends /metrics there) carries the control plane's families too.
    gateway.metrics.registry.register(ControlCollector(cp))
    return gateway


async def serve_http(
    app: App, host: str, port: int, tls: ServerTls | None = None
) -> uvicorn.Server:
    if tls is not None and tls.ca_file is not None:
        # Clients with only the fingerprint (a join token) fetch the CA here.
        app = CaRoute(app, tls.ca_pem() or b"")
    config = server_config(app, host=host, port=port, log_level="warning", loop="none",
                           **(tls.uvicorn_settings() if tls else {}))
    server = uvicorn.Server(config)
    # Signals are ours: SIGINT/SIGTERM must stop the agent and its engines
    # before the HTTP server, so uvicorn must not take them over.
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    try:
        await start_server(server)
    except ServerNotStarted:
        raise ConfigError(f"could not listen on {host}:{port}") from None
    return server


@dataclass
class Parts:
    """The running parts of one process, stopped in the reverse order of their start."""

    store: Store
    runtime: ControlPlaneRuntime
    gateway: Gateway
    server: uvicorn.Server
    control: ControlApp | None = None  # the control plane's app: its SSO client closes last

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.gateway.stop()
        await self.runtime.stop()
        await self.store.close()
        if self.control is not None:
            await self.control.state.door.aclose()


async def start_parts(
    store: Store, cp: ControlPlane, runtime: ControlPlaneRuntime, options: ProcessOptions,
    tls: ServerTls | None,
) -> Parts:
    """The runtime, the gateway, then the port they share."""
    gateway = build_gateway(cp, options.allow_key_env, open_metrics=options.open_metrics)
    await runtime.start()
    await gateway.start()
    control = create_app(cp, sso=options.sso)
    server = await serve_http(
        PathDispatcher(control, gateway), options.host, options.port, tls,
    )
    return Parts(store, runtime, gateway, server, control)
