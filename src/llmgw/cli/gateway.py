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
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from llmgw import procstats
from llmgw.cli.commonopts import ALLOW_KEY_ENV_OPTION, CONTROL_PLANE_OPTION
from llmgw.cli.logs import LogLevel, setup_logging
from llmgw.cli.secretfile import metrics_token_from, pick_secret
from llmgw.cli.workers import WorkerPool, watch_lifeline
from llmgw.errors import AuthError, ConfigError, ControlPlaneUnavailable, ValidationError
from llmgw.failover import parse_control_plane_urls
from llmgw.gateway.app import Gateway, freeze_startup_objects
from llmgw.gateway.link import HttpControlPlaneLink
from llmgw.gateway.settings import GatewaySettings
from llmgw.servertls import ServerTls, ensure_server_tls, given_server_tls, server_names
from llmgw.serving import run
from llmgw.tls import ClientTrust, check_plain_urls, parse_fingerprint, wants_tls

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


@dataclass(frozen=True)
class WorkerRole:
    """A ``--workers`` parent's worker: its index, the socket it serves, the lifeline it reads."""

    index: int
    listen_fd: int
    lifeline_fd: int

    def socket(self) -> socket.socket:
        try:
            return socket.socket(fileno=self.listen_fd)
        except OSError as exc:
            raise ConfigError(f"--listen-fd {self.listen_fd}: {exc}") from None


async def serve_gateway(
    control_plane: str, token: str, host: str, port: int, settings: GatewaySettings,
    *, trust: ClientTrust | None = None, tls: ServerTls | None = None,
    worker: WorkerRole | None = None,
) -> None:
    """Run a standalone gateway until cancelled or signalled.

    ``trust``: how the control plane's certificate is checked; ``tls``: the
    certificate this gateway's OpenAI endpoint listens with (None: plain);
    ``worker``: serve the socket a ``--workers`` parent bound (llmgw.cli.workers).
    """
    import uvicorn

    from llmgw.http.server import server_config

    sock = worker.socket() if worker is not None else _bind(host, port)
    try:
        link = HttpControlPlaneLink(control_plane, token, trust=trust)
    except Exception as exc:
        sock.close()
        raise ConfigError(str(exc)) from None
    gateway = Gateway(link, settings)
    if worker is not None:
        gateway.metrics.worker = (worker.index, settings.workers)
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
        log.info("gateway listening on %s:%s%s, control plane %s%s", host, actual,
                 " (TLS)" if tls else "", control_plane,
                 f" (worker {worker.index} of {settings.workers}, pid {os.getpid()})"
                 if worker else "")
        if worker is not None:
            # The parent gone (killed without stopping its workers): stop too.
            watch_lifeline(worker.lifeline_fd, lambda: setattr(server, "should_exit", True))
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
    control_plane: Annotated[str, CONTROL_PLANE_OPTION],
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
    allow_key_env: Annotated[list[str] | None, ALLOW_KEY_ENV_OPTION] = None,
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
    workers: Annotated[
        int,
        typer.Option(min=1, help="Serve the port from this many processes (SO_REUSEPORT; one"
                     " per core is the most that helps). Each worker counts as a gateway; a key's"
                     " limits hold across all of them (docs/tenancy.md)."),
    ] = 1,
    worker_index: Annotated[int | None, typer.Option(hidden=True)] = None,
    listen_fd: Annotated[int | None, typer.Option(hidden=True)] = None,
    lifeline_fd: Annotated[int | None, typer.Option(hidden=True)] = None,
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
            workers=workers,
        )
        if listen_fd is not None and lifeline_fd is not None:
            role = WorkerRole(worker_index or 0, listen_fd, lifeline_fd)
            run(serve_gateway(control_plane, token, host, port, settings, trust=trust, tls=tls,
                              worker=role))
        elif workers > 1:
            forwarded = [
                "--control-plane", control_plane, "--host", host, "--port", str(port),
                "--queue-wait-s", repr(queue_wait_s), "--queue-length", str(queue_length),
                "--max-body-mb", repr(max_body_mb), "--log-level", log_level,
                "--workers", str(workers),
                *(["--allow-anonymous"] if allow_anonymous else []),
                *(["--open-metrics"] if open_metrics else []),
                *(["--insecure-http"] if insecure_http else []),
                *(["--metrics-token-file", str(metrics_token_file)] if metrics_token_file else []),
                *[arg for name in allow_key_env or () for arg in ("--allow-key-env", name)],
                *(["--ca-file", str(ca_file)] if ca_file else []),
                *(["--ca-hash", ca_hash] if ca_hash else []),
                # A --tls-dir certificate is made once, here, not by each worker.
                *(["--tls-cert", str(tls.cert_file), "--tls-key", str(tls.key_file)]
                  if tls else []),
            ]
            raise typer.Exit(_run_workers(host, port, workers, forwarded, token))
        else:
            run(serve_gateway(control_plane, token, host, port, settings, trust=trust, tls=tls))
    except ConfigError as exc:
        typer.echo(f"llmgw: {exc}", err=True)
        raise typer.Exit(2) from None


def _run_workers(host: str, port: int, count: int, forwarded: list[str], token: str) -> int:
    """Supervise ``count`` workers on ``host:port`` (llmgw.cli.workers); their exit status."""

    def command(index: int, listen_fd: int, lifeline_fd: int) -> list[str]:
        return [sys.executable, "-m", "llmgw.cli.main", "gateway", *forwarded,
                "--worker-index", str(index), "--listen-fd", str(listen_fd),
                "--lifeline-fd", str(lifeline_fd)]

    # The token reaches the workers in their environment, never on a command line.
    env = {k: v for k, v in os.environ.items() if k != "LLMGW_GATEWAY_TOKEN_FILE"}
    env["LLMGW_GATEWAY_TOKEN"] = token
    return WorkerPool(host, port, count, command, env).run()


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
