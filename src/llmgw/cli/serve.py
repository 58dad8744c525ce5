"""``llmgw serve``: the control plane and the gateway, one of possibly several instances on a store.

Agents run on the GPU nodes. Several instances may share one store: one
leads, the others stand by (control.runtime), so what this one advertises
and which peers it names in ``up.json`` are settled before anything starts.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmgw import procstats
from llmgw.cli import combined
from llmgw.cli.upchecks import check_port_free
from llmgw.cli.upjson import (
    join_token_fields,
    print_banner,
    serve_admin_urls,
    tls_fields,
    urls,
    write_up_json,
)
from llmgw.config import default_data_dir, ensure_data_dir
from llmgw.control.fleetca import share_ca
from llmgw.control.jointokens import DEFAULT_TTL_S as DEFAULT_JOIN_TTL_S
from llmgw.control.plane import ControlPlane
from llmgw.control.retention import Retention
from llmgw.control.runtime import ControlPlaneRuntime
from llmgw.errors import ConfigError
from llmgw.servertls import ServerTls
from llmgw.serving import run, stop_signals


@dataclass
class ServeOptions(combined.ProcessOptions):
    host: str = "0.0.0.0"
    advertise: str | None = None
    # The other instances on the same store (--peer-url), for up.json.
    peer_urls: list[str] = field(default_factory=list)
    # Expiry of join tokens made without one (the first, rotations); None: never.
    join_token_ttl_s: float | None = DEFAULT_JOIN_TTL_S
    retention: Retention = field(default_factory=Retention)
    approve_nodes: bool = False
    trust_reported_fabrics: bool = False


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
    url = combined.resolve_store_url(data_dir, options.database_url)
    check_port_free(options.host, options.port)
    # A generated CA is the fleet's, shared through the store (control.fleetca):
    # made or taken once the store is open.
    tls = (None if options.tls.generated(options.host)
           else options.tls.resolve(data_dir, options.host, advertise))
    return int(run(_serve(options, data_dir, url, advertise, tls)))


async def _serve(
    options: ServeOptions, data_dir: Path, url: str, advertise: str, tls: ServerTls | None
) -> int:
    store, cp, creds = await combined.open_control_plane(url, options.join_token_ttl_s)
    if options.tls.generated(options.host):
        try:
            await share_ca(store, data_dir / "tls")
            tls = options.tls.resolve(data_dir, options.host, advertise)
        except BaseException:
            await store.close()
            raise
    combined.sign_node_certificates(cp, tls, [advertise, *options.peer_urls])
    cp.nodes.approve_nodes = options.approve_nodes
    cp.trust_reported_fabrics = options.trust_reported_fabrics
    stop, _ = stop_signals()  # on until the process ends
    procstats.install("serve")
    runtime = ControlPlaneRuntime(cp, advertise_url=advertise, retention=options.retention)
    parts = await combined.start_parts(store, cp, runtime, options, tls)
    scheme = "https" if tls else "http"
    base = options.advertise or f"{scheme}://{combined.public_host(options.host)}:{options.port}"
    info: dict[str, Any] = {**urls(base), "up_json": None, **tls_fields(tls)}
    if creds.admin_token or creds.api_key or creds.join_token or options.peer_urls or tls:
        # serve keeps these for `llmgw ctl` on this machine, like up does;
        # a standby (no new secrets) still records where its peers are.
        path = write_up_json(data_dir, {
            **info, "admin_url": serve_admin_urls(base, options.peer_urls),
            "admin_token": creds.admin_token, "api_key": creds.api_key,
            **join_token_fields(cp, creds, tls)})
        info["up_json"] = str(path)
    elif (data_dir / "up.json").exists():
        info["up_json"] = str(data_dir / "up.json")
    print_banner(info, creds, up=False)
    print(await _role_line(cp, runtime), flush=True)
    combined.freeze_startup_objects()
    try:
        await stop.wait()
    finally:
        await parts.stop()
    return 0


async def _role_line(cp: ControlPlane, runtime: ControlPlaneRuntime) -> str:
    own = runtime.election.advertise_url
    if cp.is_leader:
        return f"Role: leader (epoch {cp.epoch}), advertised as {own}"
    leader = await cp.leader_hint.url()
    return (f"Role: standby (leader: {leader or 'unknown'}); takes over when the leader "
            f"goes; advertised as {own}")
