"""``llmgw sim ...``: run simulated engines (and, later, fleets) from the shell.

Mounted by the main command as a typer sub-app. Flags override fields of
``--params-json`` (a ``wire.SimParams`` document), so a saved parameter set
can be reused with one value changed.
"""

from __future__ import annotations

from typing import Annotated, Any

import pydantic
import typer

from llmgw.errors import ValidationError
from llmgw.sim import engine as sim_engine
from llmgw.sim.core import check_params
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
    }
    try:
        base = sim_engine.parse_params(params_json)
        merged = {**base.model_dump(), **{k: v for k, v in overrides.items() if v is not None}}
        params = SimParams.model_validate(merged)
        check_params(params)
    except (ValidationError, pydantic.ValidationError) as exc:
        typer.echo(f"llmgw sim engine: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        code = sim_engine.run_blocking(model, params, host, port, count)
    except OSError as exc:
        typer.echo(
            f"llmgw sim engine: cannot listen on {host}:{port}: {exc.strerror or exc}", err=True
        )
        raise typer.Exit(1) from None
    raise typer.Exit(code)
