"""The ``llmgw`` command.

Configuration problems (a bad database URL, a port in use, an unwritable data
dir...) end with one line on stderr and exit code 2: a person reading a
traceback for a typo in a flag is a person who stops trusting the tool.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from llmgw import __version__
from llmgw.cli.commonopts import ALLOW_KEY_ENV_OPTION
from llmgw.cli.engineopts import ENGINE_OPTION
from llmgw.cli.logs import LogLevel, setup_logging
from llmgw.cli.ssoflags import SsoFlags, with_sso_flags
from llmgw.errors import ConfigError

app = typer.Typer(
    name="llmgw",
    help="Self-hosted LLM gateway and GPU fleet manager.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,
)

EXIT_CONFIG = 2


def fail(message: str, code: int = EXIT_CONFIG) -> None:
    typer.echo(f"llmgw: {message}", err=True)
    raise typer.Exit(code)


@app.command()
def version() -> None:
    """Print llmgw's version."""
    typer.echo(__version__)


# Flags shared by `up` and `serve`: where they listen, and how (llmgw.servertls; docs/security.md).
HOST_OPTION = typer.Option(help="Address to listen on.")
PORT_OPTION = typer.Option(help="Port of the API, admin API and console.")
TLS_OPTION = typer.Option(
    "--tls", help="Listen with TLS even on a loopback address (other addresses use TLS unless"
    " --insecure-http): a CA and certificate are made in the data dir's tls/ on first start.")
INSECURE_OPTION = typer.Option(
    "--insecure-http", help="Listen with plain HTTP on an address that is not loopback"
    " (tokens, prompts and assignments cross the network in the clear).")
TLS_CERT_OPTION = typer.Option(help="Listen with this certificate (PEM, chain included)"
                               " instead of a generated one.")
TLS_KEY_OPTION = typer.Option(help="The private key of --tls-cert.")
TLS_CA_OPTION = typer.Option(help="The CA that signed --tls-cert: its fingerprint goes into"
                             " join tokens and its path into up.json.")
OPEN_METRICS_OPTION = typer.Option(
    "--open-metrics", help="Answer /metrics without a token (by default it wants the admin token,"
    " or the metrics token of LLMGW_METRICS_TOKEN_FILE): metrics name every model and node and"
    " show the traffic.")
TLS_CA_KEY_OPTION = typer.Option(help="The private key of --tls-ca, to sign the nodes' server"
                                 " certificates (without it the agents' servers stay plain).")


@app.command()
@with_sso_flags
def up(
    data_dir: Annotated[
        Path | None, typer.Option(help="Where the store, weights and logs live.")
    ] = None,
    host: Annotated[str, HOST_OPTION] = "127.0.0.1",
    port: Annotated[int, PORT_OPTION] = 8080,
    database_url: Annotated[
        str | None, typer.Option(help="postgresql://... instead of the embedded SQLite store.")
    ] = None,
    catalog: Annotated[
        Path | None, typer.Option(help="Models to serve (YAML); default: the starter model.")
    ] = None,
    sim: Annotated[
        Path | None, typer.Option(help="Run a simulated fleet from this YAML spec instead.")
    ] = None,
    cpu_slots: Annotated[int, typer.Option(help="CPU engine slots of the local node.")] = 1,
    engine: Annotated[list[str] | None, ENGINE_OPTION] = None,
    traffic: Annotated[
        float | None, typer.Option(help="With --sim: send this many demo requests per second"
                                   " (a mix of models, keys and shared prompts).")
    ] = None,
    tls: Annotated[bool, TLS_OPTION] = False,
    insecure_http: Annotated[bool, INSECURE_OPTION] = False,
    tls_cert: Annotated[Path | None, TLS_CERT_OPTION] = None,
    tls_key: Annotated[Path | None, TLS_KEY_OPTION] = None,
    tls_ca: Annotated[Path | None, TLS_CA_OPTION] = None,
    allow_key_env: Annotated[list[str] | None, ALLOW_KEY_ENV_OPTION] = None,
    open_metrics: Annotated[bool, OPEN_METRICS_OPTION] = False,
    gateway_workers: Annotated[
        int,
        typer.Option(min=0, help="Also serve the OpenAI API from this many gateway processes"
                     " on --gateway-port (one per core; a key's limits hold across all of them:"
                     " docs/tenancy.md)."),
    ] = 0,
    gateway_port: Annotated[
        int | None, typer.Option(help="Port of the gateway workers (default: --port + 1).")
    ] = None,
    log_level: LogLevel = "warning",
    *,
    sso: SsoFlags,
) -> None:
    """Run everything on this machine: control plane, gateway and a local agent."""
    from llmgw.cli.combined import TlsOptions
    from llmgw.cli.up import UpOptions, run_up

    setup_logging(log_level)
    try:
        sso_settings = sso.settings()
    except ConfigError as exc:
        fail(str(exc))
    options = UpOptions(
        data_dir=data_dir, host=host, port=port, database_url=database_url, catalog=catalog,
        sim=sim, cpu_slots=cpu_slots, traffic=traffic, engines=list(engine or []),
        allow_key_env=frozenset(allow_key_env or ()), open_metrics=open_metrics,
        tls=TlsOptions(tls=tls or None, insecure_http=insecure_http, cert=tls_cert,
                       key=tls_key, ca=tls_ca),
        gateway_workers=gateway_workers, gateway_port=gateway_port, sso=sso_settings,
    )
    try:
        code = run_up(options)
    except ConfigError as exc:
        fail(str(exc))
    raise typer.Exit(code)


@app.command()
@with_sso_flags
def serve(
    data_dir: Annotated[Path | None, typer.Option(help="Where the embedded store lives.")] = None,
    host: Annotated[str, HOST_OPTION] = "0.0.0.0",
    port: Annotated[int, PORT_OPTION] = 8080,
    database_url: Annotated[
        str | None, typer.Option(help="postgresql://user@host/db (default: embedded SQLite).")
    ] = None,
    advertise: Annotated[
        str | None,
        typer.Option(
            "--advertise-url", "--advertise",
            help="URL agents, gateways and ctl use to reach this instance; standbys send "
            "them here while it leads (default: http://<host name>:<port>).",
        ),
    ] = None,
    peer_url: Annotated[
        list[str] | None,
        typer.Option(
            "--peer-url",
            help="Another instance on the same store (repeatable or comma-separated); "
            "written with this one to up.json so `llmgw ctl` here finds the leader "
            "after a failover.",
        ),
    ] = None,
    join_token_ttl: Annotated[
        float,
        typer.Option(help="Hours a join token works unless made with its own expiry"
                     " (0: never).", min=0),
    ] = 24.0,
    approve_nodes: Annotated[
        bool, typer.Option(help="Hold each new node cordoned until `llmgw ctl nodes approve`.")
    ] = False,
    trust_reported_fabrics: Annotated[
        bool, typer.Option(help="Take a node's fabrics from its own reports unless an operator"
                           " set them (only where every machine that can join is yours).")
    ] = False,
    events_retention_days: Annotated[
        float, typer.Option(help="Days events are kept (0: forever).", min=0)
    ] = 30.0,
    usage_retention_days: Annotated[
        float, typer.Option(help="Days per-minute usage is kept (0: forever).", min=0)
    ] = 400.0,
    tls: Annotated[bool, TLS_OPTION] = False,
    insecure_http: Annotated[bool, INSECURE_OPTION] = False,
    tls_cert: Annotated[Path | None, TLS_CERT_OPTION] = None,
    tls_key: Annotated[Path | None, TLS_KEY_OPTION] = None,
    tls_ca: Annotated[Path | None, TLS_CA_OPTION] = None,
    tls_ca_key: Annotated[Path | None, TLS_CA_KEY_OPTION] = None,
    tls_name: Annotated[
        list[str] | None,
        typer.Option(help="Another name (or address) the generated certificate covers"
                     " (repeatable): a load balancer's, a DNS alias."),
    ] = None,
    allow_key_env: Annotated[list[str] | None, ALLOW_KEY_ENV_OPTION] = None,
    open_metrics: Annotated[bool, OPEN_METRICS_OPTION] = False,
    log_level: LogLevel = "info",
    *,
    sso: SsoFlags,
) -> None:
    """Run the control plane and the gateway (agents run on the GPU nodes)."""
    from llmgw.cli.combined import TlsOptions
    from llmgw.cli.serve import ServeOptions, run_serve
    from llmgw.control.retention import Retention

    setup_logging(log_level)
    try:
        code = run_serve(
            ServeOptions(
                data_dir=data_dir, host=host, port=port, database_url=database_url,
                advertise=advertise, peer_urls=list(peer_url or []),
                join_token_ttl_s=join_token_ttl * 3600 or None,
                approve_nodes=approve_nodes,
                trust_reported_fabrics=trust_reported_fabrics,
                allow_key_env=frozenset(allow_key_env or ()), open_metrics=open_metrics,
                retention=Retention(events_days=events_retention_days,
                                    usage_days=usage_retention_days),
                tls=TlsOptions(tls=tls or None, insecure_http=insecure_http, cert=tls_cert,
                               key=tls_key, ca=tls_ca, ca_key=tls_ca_key,
                               names=list(tls_name or [])),
                sso=sso.settings(),
            )
        )
    except ConfigError as exc:
        fail(str(exc))
    raise typer.Exit(code)


def _mount_subcommands() -> None:
    """Commands owned by their own modules (agent, gateway, ctl, sim, doctor)."""
    from llmgw.cli import agent, completion, ctl, doctor, gateway, sim

    app.add_typer(agent.app, name="agent")
    app.add_typer(gateway.app, name="gateway")
    app.add_typer(sim.app, name="sim")
    app.add_typer(ctl.app, name="ctl")
    app.command("doctor")(doctor.doctor)
    app.command("completion")(completion.completion)


_mount_subcommands()


def main() -> None:
    try:
        app()
    except ConfigError as exc:
        typer.echo(f"llmgw: {exc}", err=True)
        sys.exit(EXIT_CONFIG)


if __name__ == "__main__":
    main()
