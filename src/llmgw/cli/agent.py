"""``llmgw agent``: run the agent of one GPU (or CPU) node.

On SIGINT or SIGTERM the agent stops reporting and, by default, leaves its
engines running: restarting or upgrading the agent must not restart replicas
that take minutes to load; the next agent on the same data dir adopts them.
``--stop-engines`` stops them instead (an interactive session, a node being
retired). Under systemd, use ``KillMode=process`` so that stopping the unit
does not kill the engines' processes with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import socket
from pathlib import Path
from typing import Annotated, cast, get_args

import typer

from llmgw import procstats
from llmgw.agent.app import Agent, AgentConfig
from llmgw.agent.diskroom import DiskReserve
from llmgw.agent.engines.nodeargs import parse_allowed
from llmgw.agent.memguard import GuardMode
from llmgw.cli.commonopts import CONTROL_PLANE_OPTION
from llmgw.cli.engineopts import ENGINE_OPTION, engine_commands
from llmgw.cli.logs import LogLevel, setup_logging
from llmgw.cli.secretfile import metrics_token_from, pick_secret
from llmgw.errors import AuthError, ConfigError
from llmgw.failover import parse_control_plane_urls
from llmgw.tls import check_plain_urls, parse_fingerprint
from llmgw.wire import ENV_NAME_PATTERN, check_host, check_node_name

app = typer.Typer(name="agent", add_completion=False, pretty_exceptions_enable=False)

EXIT_CONFIG = 2


def _parse_overrides(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ConfigError(f"--class-override {item!r}: expected PRODUCT=CLASS")
        out[key.strip()] = value.strip()
    return out


def _parse_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition("-")
    if not sep or not low.isdigit() or not high.isdigit():
        raise ConfigError(f"--port-range {text!r}: expected LOW-HIGH, e.g. 20000-29999")
    return int(low), int(high)


def _guard_mode(text: str) -> GuardMode:
    for mode in get_args(GuardMode):
        if text == mode:
            return cast(GuardMode, mode)
    choices = ", ".join(get_args(GuardMode))
    raise ConfigError(f"--memory-guard {text!r}: expected one of {choices}")


def _env_names(items: list[str]) -> frozenset[str]:
    """``--engine-env-allow`` values (each may be a comma-separated list), checked as names."""
    names = frozenset(name.strip() for item in items for name in item.split(",") if name.strip())
    for name in names:
        if not re.fullmatch(ENV_NAME_PATTERN, name):
            raise ConfigError(f"--engine-env-allow {name!r} is not an environment variable name")
    return names


def _check_identity(name: str, address: str, fabrics: list[str]) -> None:
    """Refuse at start what the control plane would refuse at every report."""
    try:
        check_node_name(name)
        check_host(address)
        for item in fabrics:
            check_node_name(item, "fabric name")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


@app.callback(invoke_without_command=True)
def agent(
    control_plane: Annotated[str, CONTROL_PLANE_OPTION],
    data_dir: Annotated[
        Path, typer.Option(envvar="LLMGW_DATA_DIR", help="Node token, engine state, weights, logs.")
    ],
    join_token: Annotated[
        str | None,
        typer.Option(envvar="LLMGW_JOIN_TOKEN",
                     help="Needed once, to register this node; prefer --join-token-file."),
    ] = None,
    join_token_file: Annotated[
        Path | None,
        typer.Option(envvar="LLMGW_JOIN_TOKEN_FILE",
                     help="A file holding the join token (keeps it off the command line)."),
    ] = None,
    name: Annotated[str | None, typer.Option(help="Node name (default: hostname).")] = None,
    fabric: Annotated[
        list[str] | None, typer.Option(help="High-speed network fabric(s) of this node.")
    ] = None,
    address: Annotated[
        str, typer.Option(help="Address the gateway and peers use to reach this node.")
    ] = "127.0.0.1",
    bind_host: Annotated[
        str | None, typer.Option(help="Where engines listen (default: --address).")
    ] = None,
    cpu_slots: Annotated[int, typer.Option(min=0, help="CPU engine slots offered.")] = 1,
    class_override: Annotated[
        list[str] | None, typer.Option(help="PRODUCT=CLASS, overrides a GPU's class.")
    ] = None,
    server_port: Annotated[
        int, typer.Option(help="Port of the agent's weights server (0: any).")
    ] = 0,
    port_range: Annotated[str, typer.Option(help="Ports for engines, LOW-HIGH.")] = "20000-29999",
    weights_reserve: Annotated[
        str | None,
        typer.Option(
            envvar="LLMGW_WEIGHTS_RESERVE",
            help="Disk space weights downloads leave free: a share (5%) or a size (20GiB)."
            " Default: 5% of the disk, at most 10 GiB.",
        ),
    ] = None,
    engine: Annotated[list[str] | None, ENGINE_OPTION] = None,
    stop_engines: Annotated[
        bool, typer.Option(help="Stop the engines when the agent exits (default: leave them).")
    ] = False,
    metrics_token_file: Annotated[
        Path | None,
        typer.Option(envvar="LLMGW_METRICS_TOKEN_FILE",
                     help="The agent's /metrics answers only this file's token as a Bearer"
                     " token (also LLMGW_METRICS_TOKEN; default: open)."),
    ] = None,
    memory_guard: Annotated[
        str,
        typer.Option(
            envvar="LLMGW_MEMORY_GUARD",
            help="How engines are held to their memory budgets: auto (a cgroup where possible,"
            " else RSS watching), cgroup, rss or off.",
        ),
    ] = "auto",
    ca_file: Annotated[
        Path | None,
        typer.Option(envvar="LLMGW_CA_FILE",
                     help="The fleet's CA to check an https:// control plane against (default:"
                     " fetched once, checked with the join token's sha256:... fingerprint,"
                     " kept as ca.pem in the data dir)."),
    ] = None,
    ca_hash: Annotated[
        str | None,
        typer.Option(envvar="LLMGW_CA_HASH",
                     help="The CA's fingerprint (sha256:...), for a join token without one."),
    ] = None,
    insecure_http: Annotated[
        bool, typer.Option(help="Allow a plain http:// control plane on another machine"
                           " (tokens and assignments cross the network in the clear), and"
                           " this agent's server in plain HTTP where the control plane"
                           " signs no node certificates.")
    ] = False,
    engine_env_allow: Annotated[
        list[str] | None,
        typer.Option(envvar="LLMGW_ENGINE_ENV_ALLOW",
                     help="A variable name the catalog may set in an engine's environment on"
                     " this node beyond the engine's own settings (repeat for more). It can"
                     " run code in the engines (LD_PRELOAD...): allow only what you must."),
    ] = None,
    engine_flag_allow: Annotated[
        list[str] | None,
        typer.Option(envvar="LLMGW_ENGINE_FLAG_ALLOW",
                     help="An engine flag that runs a model's own code which the catalog may"
                     " set on this node (only trust-remote-code): the model repository's"
                     " Python files then run here."),
    ] = None,
    engine_user: Annotated[
        str | None,
        typer.Option(envvar="LLMGW_ENGINE_USER",
                     help="Run engines under this user, which cannot read the agent's secrets"
                     " (the agent must run as root; docs/security.md)."),
    ] = None,
    log_level: LogLevel = "info",
) -> None:
    """Run this node's agent: report to the control plane and run what it assigns."""
    setup_logging(log_level)
    try:
        _check_identity(name or socket.gethostname(), address, fabric or [])
        check_plain_urls(parse_control_plane_urls(control_plane), allowed=insecure_http,
                         what="control plane")
        join_token = pick_secret(join_token, join_token_file, "join token", "--join-token")
        config = AgentConfig(
            control_plane=control_plane,
            data_dir=data_dir,
            name=name or socket.gethostname(),
            join_token=join_token,
            fabrics=list(fabric or []),
            address=address,
            bind_host=bind_host,
            cpu_slots=cpu_slots,
            class_overrides=_parse_overrides(class_override or []),
            server_port=server_port,
            port_range=_parse_range(port_range),
            weights_reserve=(
                DiskReserve.parse(weights_reserve) if weights_reserve else DiskReserve()
            ),
            metrics_token=metrics_token_from(metrics_token_file),
            memory_guard=_guard_mode(memory_guard),
            insecure_http=insecure_http,
            engine_env_allow=_env_names(engine_env_allow or []),
            engine_flag_allow=parse_allowed(engine_flag_allow or []),
            engine_user=engine_user,
            ca_file=ca_file,
            ca_fingerprint=parse_fingerprint(ca_hash) if ca_hash else None,
            engines=engine_commands(engine or []),
        )
        asyncio.run(run_agent(Agent(config), stop_engines=stop_engines))
    except (ConfigError, AuthError) as exc:
        typer.echo(f"llmgw: {exc}", err=True)
        raise typer.Exit(EXIT_CONFIG) from None


async def run_agent(agent: Agent, *, stop_engines: bool) -> None:
    """Run ``agent`` until SIGINT/SIGTERM, then shut it down."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    procstats.install("agent")
    task = asyncio.create_task(agent.run())
    waiter = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        await agent.shutdown(stop_engines=stop_engines)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    if task.done() and not task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            task.result()  # re-raise a fatal error (e.g. a refused join token)
