"""``llmgw gateway --control-plane URL[,URL...] --token T``: the gateway on its own.

It learns routes and keys from the control plane's watch stream and keeps
serving the last ones it knew while the control plane is away. A token the
control plane refuses is a configuration error (exit 2, one line); a control
plane that is merely unreachable at start is not: the gateway answers 503
until the first config arrives, then serves.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
from pathlib import Path
from typing import Annotated

import typer

from llmgw import procstats
from llmgw.cli.logs import LogLevel, setup_logging
from llmgw.cli.secretfile import metrics_token_from, pick_secret
from llmgw.errors import AuthError, ConfigError, ControlPlaneUnavailable, ValidationError
from llmgw.failover import parse_control_plane_urls
from llmgw.gateway.app import Gateway, freeze_startup_objects
from llmgw.gateway.link import HttpControlPlaneLink
from llmgw.gateway.settings import GatewaySettings
from llmgw.serving import run
from llmgw.tls import (
    ClientTrust,
    ServerTls,
    check_plain_urls,
    ensure_server_tls,
    given_server_tls,
    parse_fingerprint,
    server_names,
    wants_tls,
)

log = logging.getLogger("llmgw.gateway")

app = typer.Typer(name="gateway", add_completion=False, pretty_exceptions_enable=False)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


async def serve_gateway(
    control_plane: str, token: str, host: str, port: int, settings: GatewaySettings,
    *, trust: ClientTrust | None = None, tls: ServerTls | None = None,
) -> None:
    """Run a standalone gateway until cancelled or signalled.

    ``trust``: how the control plane's certificate is checked; ``tls``: the
    certificate this gateway's OpenAI endpoint listens with (None: plain).
    """
    import uvicorn

    from llmgw.cli.httpserver import server_config

    sock = _bind(host, port)
    try:
        link = HttpControlPlaneLink(control_plane, token, trust=trust)
    except Exception as exc:
        sock.close()
        raise ConfigError(str(exc)) from None
    gateway = Gateway(link, settings)
    try:
        try:
            async with asyncio.timeout(10.0):
                gateway.apply(await link.watch_config(-1))
        except AuthError as exc:
            raise ConfigError(str(exc)) from None
        except (ControlPlaneUnavailable, ValidationError, TimeoutError) as exc:
            log.warning("control plane not reachable yet (%s); answering 503 until it is", exc)
        await gateway.start()
        procstats.install("gateway")
        config = server_config(
            gateway, log_level=logging.getLevelName(logging.getLogger().level).lower(),
            **(tls.uvicorn_settings() if tls else {}),
        )
        # uvicorn imports its protocol, loop and lifespan modules here (or at
        # its start): before the freeze, so a full collection never walks them.
        config.load()
        freeze_startup_objects()
        server = uvicorn.Server(config)
        actual = sock.getsockname()[1]
        log.info("gateway listening on %s:%s%s, control plane %s", host, actual,
                 " (TLS)" if tls else "", control_plane)
        if threading.current_thread() is threading.main_thread():
            # uvicorn re-raises the signal that stopped it once it is done,
            # with the handlers it found; a quiet handler here lets the final
            # usage flush below run instead of the process dying first.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: None)
        await server.serve(sockets=[sock])
    finally:
        await gateway.stop()
        await link.close()
        sock.close()


@app.callback(invoke_without_command=True)
def gateway(
    control_plane: Annotated[
        str,
        typer.Option(
            envvar="LLMGW_CONTROL_PLANE",
            help="Control plane URL, or several comma-separated (leader and standbys).",
        ),
    ],
    token: Annotated[
        str | None,
        typer.Option(envvar="LLMGW_GATEWAY_TOKEN",
                     help="Gateway token (llmgw-gw-...); prefer --token-file."),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(envvar="LLMGW_GATEWAY_TOKEN_FILE",
                     help="A file holding the gateway token (keeps it off the command line)."),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "0.0.0.0",
    port: Annotated[int, typer.Option(help="Port of the OpenAI API.")] = 8000,
    queue_wait_s: Annotated[
        float, typer.Option(help="How long a request waits for an on-demand model.")
    ] = GatewaySettings.queue_wait_s,
    queue_length: Annotated[
        int, typer.Option(help="Requests that may wait per on-demand model.")
    ] = GatewaySettings.queue_length,
    max_body_mb: Annotated[float, typer.Option(help="Largest request body, MiB.")] = 32.0,
    allow_anonymous: Annotated[
        bool, typer.Option(help="Accept requests without an API key.")
    ] = False,
    metrics_token_file: Annotated[
        Path | None,
        typer.Option(envvar="LLMGW_METRICS_TOKEN_FILE",
                     help="/metrics answers only this file's token as a Bearer token"
                     " (also LLMGW_METRICS_TOKEN; without one /metrics is closed unless"
                     " --open-metrics)."),
    ] = None,
    allow_key_env: Annotated[
        list[str] | None,
        typer.Option("--allow-key-env",
                     help="An environment variable an external model's api_key_env may name"
                     " besides LLMGW_EXTERNAL_* (repeatable): its value goes to that"
                     " model's URLs."),
    ] = None,
    open_metrics: Annotated[
        bool, typer.Option(help="Answer /metrics to anyone when no metrics token is set"
                           " (metrics name every model and show the traffic).")
    ] = False,
    ca_file: Annotated[
        Path | None,
        typer.Option(envvar="LLMGW_CA_FILE",
                     help="The fleet's CA (serve's data dir: tls/ca.pem) to check an https://"
                     " control plane against."),
    ] = None,
    ca_hash: Annotated[
        str | None,
        typer.Option(envvar="LLMGW_CA_HASH",
                     help="Or the CA's fingerprint (sha256:..., as in join tokens): the CA is"
                     " fetched once and kept only if it matches."),
    ] = None,
    tls_cert: Annotated[
        Path | None, typer.Option(help="Serve the OpenAI API with TLS: this certificate"
                                  " (PEM, chain included)...")
    ] = None,
    tls_key: Annotated[Path | None, typer.Option(help="...and its private key.")] = None,
    tls_dir: Annotated[
        Path | None,
        typer.Option(help="Or serve TLS with a CA and certificate made in this directory on"
                     " first start (clients trust its ca.pem)."),
    ] = None,
    insecure_http: Annotated[
        bool, typer.Option(help="Allow plain HTTP to a control plane or on a listening address"
                           " that is not loopback.")
    ] = False,
    log_level: LogLevel = "info",
) -> None:
    """Run the OpenAI-compatible gateway alone, following a control plane."""
    setup_logging(log_level)
    try:
        check_plain_urls(parse_control_plane_urls(control_plane), allowed=insecure_http,
                         what="control plane")
        trust = ClientTrust(ca_file=ca_file,
                            ca_fingerprint=parse_fingerprint(ca_hash) if ca_hash else None)
        tls = _listening_tls(host, tls_cert, tls_key, tls_dir, insecure_http)
        token = pick_secret(token, token_file, "gateway token", "--token")
        if not token:
            raise ConfigError("a gateway token is needed: --token-file PATH, "
                              "LLMGW_GATEWAY_TOKEN or --token")
        settings = GatewaySettings(
            queue_wait_s=queue_wait_s,
            queue_length=queue_length,
            max_body_bytes=int(max_body_mb * 1024 * 1024),
            allow_anonymous=allow_anonymous,
            metrics_token=metrics_token_from(metrics_token_file),
            metrics_open=open_metrics,
            key_env_allowed=frozenset(allow_key_env or ()),
        )
        run(serve_gateway(control_plane, token, host, port, settings, trust=trust, tls=tls))
    except ConfigError as exc:
        typer.echo(f"llmgw: {exc}", err=True)
        raise typer.Exit(2) from None


def _listening_tls(host: str, cert: Path | None, key: Path | None, directory: Path | None,
                   insecure_http: bool) -> ServerTls | None:
    """The certificate the OpenAI endpoint listens with; plain only on loopback or if allowed."""
    if (cert is None) != (key is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    if cert is not None and key is not None:
        return given_server_tls(cert, key, None)
    if directory is not None:
        return ensure_server_tls(directory, server_names(host))
    if wants_tls(host, tls=None, insecure_http=insecure_http):
        raise ConfigError(
            f"--host {host} is not a loopback address: API keys and prompts would cross the "
            "network in the clear; serve TLS (--tls-cert/--tls-key or --tls-dir DIR) or pass "
            "--insecure-http"
        )
    return None


if __name__ == "__main__":
    app()
