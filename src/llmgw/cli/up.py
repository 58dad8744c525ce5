"""``llmgw up``: ``serve``'s parts plus a local agent and a starter catalog, on one machine.

One command on one machine serves a real model (or, with ``--sim``, a
simulated fleet). Everything that can be checked before anything starts
(data dir, store URL, port, model package) is checked first
(llmgw.cli.upchecks), so a bad setting fails in a second with one line and
leaves the store as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmgw import procstats
from llmgw.cli.combined import (
    ProcessOptions,
    freeze_startup_objects,
    open_control_plane,
    public_host,
    resolve_store_url,
    sign_node_certificates,
    start_parts,
)
from llmgw.cli.engineopts import engine_commands
from llmgw.cli.secretfile import metrics_token_from
from llmgw.cli.upchecks import (
    STARTER_MODEL,
    DataDirLock,
    check_port_free,
    check_starter_model,
    load_catalog_file,
    load_sim_fleet,
)
from llmgw.cli.upjson import join_token_fields, print_banner, tls_fields, urls, write_up_json
from llmgw.cli.uptraffic import KEYS_FILE, check_rate, demo_keys, start_traffic
from llmgw.cli.upworkers import start_gateway_workers
from llmgw.config import default_data_dir, ensure_data_dir
from llmgw.control.plane import ControlPlane, NewCredentials
from llmgw.control.runtime import ControlPlaneRuntime
from llmgw.errors import ConfigError
from llmgw.servertls import ServerTls
from llmgw.serving import run, stop_signals
from llmgw.wire import ModelSpec

log = logging.getLogger(__name__)


@dataclass
class UpOptions(ProcessOptions):
    catalog: Path | None = None
    sim: Path | None = None
    cpu_slots: int = 1
    traffic: float | None = None  # demo requests per second (--sim only)
    # --engine NAME=PATH items for the local agent (agent.engines.commands).
    engines: list[str] = field(default_factory=list)
    # Gateway worker processes on a port of their own (llmgw.cli.upworkers); 0: none.
    gateway_workers: int = 0
    gateway_port: int | None = None  # default: the control plane's port + 1

    @property
    def workers_port(self) -> int:
        return self.gateway_port if self.gateway_port is not None else self.port + 1


def run_up(options: UpOptions) -> int:
    data_dir = ensure_data_dir(options.data_dir or default_data_dir())
    lock = DataDirLock(data_dir)
    try:
        return _run_up(options, data_dir)
    finally:
        lock.release()


def _run_up(options: UpOptions, data_dir: Path) -> int:
    url = resolve_store_url(data_dir, options.database_url)
    check_port_free(options.host, options.port)
    if options.gateway_workers:
        check_port_free(options.host, options.workers_port)
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
    engine_commands(options.engines)  # a bad --engine fails before anything starts
    if options.sim is not None:
        fleet = load_sim_fleet(options.sim)
    if options.catalog is not None:
        catalog = load_catalog_file(options.catalog)
    elif fleet is not None:
        catalog = list(fleet.models) or None
    else:
        check_starter_model()
    return int(run(_up(options, data_dir, url, catalog, fleet, tls)))


async def _up(
    options: UpOptions, data_dir: Path, url: str, catalog: list[ModelSpec] | None, fleet: Any,
    tls: ServerTls | None = None,
) -> int:
    store, cp, creds = await open_control_plane(url)
    sign_node_certificates(cp, tls)
    # A simulated fleet is the operator's own, fabrics included (its spec
    # declares them); one local agent reports none.
    cp.trust_reported_fabrics = fleet is not None
    stop, _ = stop_signals()  # on until the process ends
    procstats.install("up")
    if catalog is not None:
        await cp.catalog.put(catalog)
    elif options.sim is None and not cp.state.models:
        await cp.catalog.put([ModelSpec.model_validate(STARTER_MODEL)])
    scheme = "https" if tls else "http"
    base = f"{scheme}://{public_host(options.host)}:{options.port}"
    runtime = ControlPlaneRuntime(cp, reconcile_interval_s=1.0, advertise_url=base)
    parts = await start_parts(store, cp, runtime, options, tls)
    try:
        agents = [await _start_agents(cp, fleet, base, data_dir, options, creds, tls)]
    except BaseException:
        await parts.stop()
        raise
    workers = None
    if options.gateway_workers:
        try:
            workers = start_gateway_workers(
                cp, base, options.host, options.workers_port, options.gateway_workers, tls,
                insecure_http=options.tls.insecure_http, allow_key_env=options.allow_key_env,
                metrics_open=options.open_metrics)
        except BaseException:
            for agent in agents:
                with contextlib.suppress(Exception):
                    await agent.shutdown(stop_engines=True)
            await parts.stop()
            raise
    info = _up_info(cp, creds, base, options, tls, workers=workers is not None)
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
        if workers is not None:
            # Before the control plane: their last usage reports go to it.
            await workers.stop()
        await parts.stop()
    return 0


async def _start_agents(
    cp: ControlPlane, fleet: Any, base: str, data_dir: Path, options: UpOptions,
    creds: NewCredentials, tls: ServerTls | None,
) -> Any:
    """The simulated fleet's agents, or this machine's one agent."""
    join_token = creds.join_token
    if fleet is None:
        return await _start_local_agent(cp, base, data_dir, options, join_token,
                                        tls.ca_file if tls else None)
    from llmgw.sim.fleet import start_fleet

    if join_token is None:
        join_token = await _own_join_token(cp, uses=None)
    # The fleet's models were applied above, in-process.
    return await start_fleet(fleet, base, join_token, data_dir / "sim", apply=False)


def _up_info(
    cp: ControlPlane, creds: NewCredentials, base: str, options: UpOptions,
    tls: ServerTls | None, *, workers: bool,
) -> dict[str, Any]:
    """What up.json says: where to call, with which credentials, and the model to try."""
    scheme = "https" if tls else "http"
    return {
        **urls(base),
        # Clients go to the workers; /v1 on the control plane's port still answers.
        **({"api_url": f"{scheme}://{public_host(options.host)}:{options.workers_port}/v1"}
           if workers else {}),
        "admin_token": creds.admin_token,
        "api_key": creds.api_key,
        "model": next(iter(sorted(cp.state.models)), "default"),
        **join_token_fields(cp, creds, tls),
        **tls_fields(tls),
    }


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
        engines=engine_commands(options.engines),
    )
    agent = Agent(config)
    await agent.start()
    task = asyncio.create_task(agent.run(), name="local-agent")
    task.add_done_callback(_log_agent_exit)
    return agent


async def _own_join_token(cp: ControlPlane, uses: int | None) -> str:
    """A short-lived join token for the agents ``up`` starts itself."""
    _, secret = await cp.credentials.create_join_token(ttl_s=600.0, max_uses=uses,
                                           description="llmgw up's own agents")
    return secret


def _log_agent_exit(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("local agent stopped: %s", task.exception())
