"""``llmgw sim ...``: run simulated engines and simulated fleets from the shell.

Mounted by the main command as a typer sub-app. ``engine``: flags override
fields of ``--params-json`` (a ``wire.SimParams`` document), so a saved
parameter set can be reused with one value changed. ``fleet``: many simulated
nodes from a YAML spec, each a real agent reporting to a control plane.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
import typer

from llmgw import procstats
from llmgw.cli.commonopts import CONTROL_PLANE_OPTION
from llmgw.cli.logs import LogLevel, setup_logging
from llmgw.errors import AuthError, ConfigError, ValidationError
from llmgw.serving import run, stop_signals
from llmgw.sim.core import check_params
from llmgw.sim.fleetspec import FleetSpec, load_fleet_spec
from llmgw.sim.process import parse_params, serve
from llmgw.wire import SimParams

app = typer.Typer(
    name="sim", help="Simulated engines for tests, demos and benchmarks.", no_args_is_help=True
)


@app.callback()
def sim() -> None:
    """Simulated engines for tests, demos and benchmarks."""


@app.command("engine")
def engine_command(
    model: Annotated[str, typer.Option(help="The model name the engine serves.")] = "sim",
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0: ephemeral); with --count, the first.")] = 0,
    count: Annotated[int, typer.Option(min=1, help="Engines to run, on consecutive ports.")] = 1,
    params_json: Annotated[str, typer.Option(help="wire.SimParams as JSON.")] = "{}",
    startup_s: Annotated[float | None, typer.Option(help="Start-up delay, seconds.")] = None,
    kv_blocks: Annotated[int | None, typer.Option(help="KV cache capacity in blocks.")] = None,
    block_tokens: Annotated[int | None, typer.Option(help="Tokens per KV block.")] = None,
    prefill_tps: Annotated[float | None, typer.Option(help="Prefill tokens per second.")] = None,
    decode_ms: Annotated[
        float | None, typer.Option(help="Decode ms per token (batch of 1).")
    ] = None,
    max_running: Annotated[int | None, typer.Option(help="Requests run at once.")] = None,
    time_factor: Annotated[float | None, typer.Option(help="Multiplies every duration.")] = None,
    fault: Annotated[
        str | None,
        typer.Option(help="none, fail_at_start, crash_mid_stream, hang or slow."),
    ] = None,
    hang_after_s: Annotated[
        float | None,
        typer.Option(help="Seconds after ready when the engine wedges, /health included."),
    ] = None,
    stall_after_s: Annotated[
        float | None,
        typer.Option(help="Seconds after ready when the engine stops making progress."),
    ] = None,
) -> None:
    """Run simulated OpenAI-compatible engines until SIGINT or SIGTERM."""
    overrides: dict[str, Any] = {
        "startup_s": startup_s,
        "kv_blocks": kv_blocks,
        "block_tokens": block_tokens,
        "prefill_tokens_per_s": prefill_tps,
        "decode_ms_per_token": decode_ms,
        "max_running": max_running,
        "time_factor": time_factor,
        "fault": fault,
        "hang_after_s": hang_after_s,
        "stall_after_s": stall_after_s,
    }
    try:
        base = parse_params(params_json)
        merged = {**base.model_dump(), **{k: v for k, v in overrides.items() if v is not None}}
        params = SimParams.model_validate(merged)
        check_params(params)
    except (ValidationError, pydantic.ValidationError) as exc:
        typer.echo(f"llmgw sim engine: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        code = run(serve(model, params, host, port, count))
    except OSError as exc:
        typer.echo(
            f"llmgw sim engine: cannot listen on {host}:{port}: {exc.strerror or exc}", err=True
        )
        raise typer.Exit(1) from None
    raise typer.Exit(code)


EngineChoice = Literal["inprocess", "subprocess"]


@app.command("fleet")
def fleet_command(
    spec: Annotated[
        Path, typer.Argument(help="The fleet spec (YAML), e.g. examples/fleet-demo.yaml.")
    ],
    control_plane: Annotated[str, CONTROL_PLANE_OPTION],
    join_token: Annotated[
        str | None, typer.Option(envvar="LLMGW_JOIN_TOKEN", help="Join token (first start).")
    ] = None,
    data_dir: Annotated[
        Path, typer.Option(help="Where each node keeps its identity and state.")
    ] = Path("sim-fleet"),
    engines: Annotated[
        EngineChoice,
        typer.Option(help="inprocess: engines inside this process; subprocess: one each."),
    ] = "inprocess",
    admin_token: Annotated[
        str | None,
        typer.Option(envvar="LLMGW_ADMIN_TOKEN", help="Admin token, to apply the spec's models."),
    ] = None,
    apply_models: Annotated[
        bool, typer.Option(help="Apply the spec's models through the admin API first.")
    ] = True,
    register_timeout: Annotated[
        float, typer.Option(help="Seconds to wait for every node to register.")
    ] = 120.0,
    log_level: LogLevel = "warning",
) -> None:
    """Run a simulated fleet against a control plane until SIGINT or SIGTERM."""
    setup_logging(log_level, fallback=logging.WARNING)
    try:
        fleet_spec = load_fleet_spec(spec)
    except ValidationError as exc:
        typer.echo(f"llmgw sim fleet: {exc}", err=True)
        raise typer.Exit(2) from None
    if fleet_spec.models and apply_models and not admin_token:
        typer.echo(
            f"llmgw sim fleet: {spec} has {len(fleet_spec.models)} model(s) to apply: give"
            " --admin-token (or LLMGW_ADMIN_TOKEN), or --no-apply-models",
            err=True,
        )
        raise typer.Exit(2)
    try:
        code = asyncio.run(
            _run_fleet(
                fleet_spec,
                control_plane,
                join_token,
                data_dir,
                engines=engines,
                admin_token=admin_token if apply_models else None,
                register_timeout=register_timeout,
            )
        )
    except (ConfigError, AuthError, ValidationError) as exc:
        typer.echo(f"llmgw sim fleet: {exc}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


async def _run_fleet(
    fleet_spec: FleetSpec,
    control_plane: str,
    join_token: str | None,
    data_dir: Path,
    *,
    engines: EngineChoice,
    admin_token: str | None,
    register_timeout: float,
) -> int:
    from llmgw.sim.fleet import start_fleet

    stop, unhook = stop_signals()
    procstats.install("sim-fleet")
    started = time.monotonic()
    fleet = await start_fleet(
        fleet_spec,
        control_plane,
        join_token,
        data_dir,
        engines=engines,
        admin_token=admin_token,
        apply=admin_token is not None,
    )
    try:
        waiting = asyncio.create_task(fleet.wait_registered(register_timeout))
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({waiting, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if waiting.done():
            waiting.result()  # a refused join token or a timeout ends the run here
            print(
                f"llmgw sim fleet: {len(fleet.agents)} nodes registered with {control_plane}"
                f" in {time.monotonic() - started:.1f} s ({engines} engines); Ctrl-C stops",
                flush=True,
            )
        else:
            waiting.cancel()
        await stop.wait()
    finally:
        unhook()
        await fleet.shutdown(stop_engines=True)
    return 0
