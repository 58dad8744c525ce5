"""The simulated engine as a process: its argv, read in one place, and its signals.

``python -m llmgw.sim.engine --host H --port P --model NAME --params-json '{...}'``
runs engines as a process (the agent starts replicas that way, with an argv
list); the in-process fleet (llmgw.sim.inprocess) reads the very same argv
with the same parser, so a flag the agent adds is understood by both.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import ssl
import sys
from collections.abc import Sequence

import pydantic

from llmgw import procstats
from llmgw.engine_env import ENGINE_KEY_ENV
from llmgw.errors import ValidationError
from llmgw.serving import run, stop_signals
from llmgw.sim.core import EngineCore
from llmgw.sim.engine import SimEngine
from llmgw.wire import EngineKind, SimParams

SIM_MODULE = "llmgw.sim.engine"


def argv_parser(*, exit_on_error: bool = True) -> argparse.ArgumentParser:
    """The engine's flags; ``exit_on_error=False`` for a caller that reports errors itself."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {SIM_MODULE}",
        description="A simulated inference engine behind a real OpenAI-compatible HTTP server.",
        add_help=exit_on_error, exit_on_error=exit_on_error,
    )  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: ephemeral")
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--params-json", default="{}", help="wire.SimParams as JSON")
    parser.add_argument("--count", type=int, default=1, help="engines on consecutive ports")
    # Spelled as vLLM's, which the agent passes the same way (with the node's
    # certificate, on a fleet that issues them: agent.engines.sim).
    parser.add_argument("--ssl-certfile", help="listen with TLS under this certificate (PEM)")
    parser.add_argument("--ssl-keyfile", help="the certificate's private key (PEM)")
    return parser


def parse_params(raw: str) -> SimParams:
    """SimParams from JSON text; ValidationError with pydantic's message otherwise."""
    try:
        return SimParams.model_validate_json(raw or "{}")
    except pydantic.ValidationError as exc:
        raise ValidationError(f"--params-json: {exc}") from None


def server_tls(certfile: str | None, keyfile: str | None) -> ssl.SSLContext | None:
    """The server context ``--ssl-certfile``/``--ssl-keyfile`` ask for; OSError or SSLError."""
    if not (certfile or keyfile):
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certfile or "", keyfile)
    return context


async def run_engines(
    n: int,
    params: SimParams | None = None,
    host: str = "127.0.0.1",
    *,
    model: str = "sim",
    base_port: int = 0,
    api_key: str | None = None,
    tls: ssl.SSLContext | None = None,
) -> list[SimEngine]:
    """Start ``n`` engines on one loop: ports ``base_port + i``, or ephemeral when 0.

    All or nothing: if one cannot listen, those already started are stopped.
    """
    engines: list[SimEngine] = []
    try:
        for i in range(n):
            engine = SimEngine(model, params, api_key=api_key)
            await engine.start(host, base_port + i if base_port else 0, tls)
            engines.append(engine)
    except BaseException:
        await asyncio.gather(*(e.stop() for e in engines), return_exceptions=True)
        raise
    return engines


async def serve(
    model: str,
    params: SimParams,
    host: str,
    port: int,
    count: int = 1,
    api_key: str | None = None,
    tls: ssl.SSLContext | None = None,
) -> int:
    """Run ``count`` engines until SIGINT/SIGTERM (0) or a failed start (1)."""
    loop = asyncio.get_running_loop()
    stop, unhook = stop_signals()
    procstats.install("sim-engine")
    try:
        engines = await run_engines(
            count, params, host, model=model, base_port=port, api_key=api_key, tls=tls
        )
    except BaseException:
        unhook()
        raise
    # Modules, schemas and the engines' own state live as long as the
    # process: out of the collector's sight, so its full collections stay
    # short and a benchmark's first token does not wait on one.
    gc.collect()
    gc.freeze()
    for engine in engines:
        print(f"sim engine {model} listening on {engine.url}", flush=True)
    exits = [loop.create_task(e.wait_exit()) for e in engines]
    stopper = loop.create_task(stop.wait())
    try:
        await asyncio.wait([stopper, *exits], return_when=asyncio.FIRST_COMPLETED)
    finally:
        unhook()
        stopper.cancel()
        failed = any(t.done() and t.result() == 1 for t in exits)
        await asyncio.gather(*(e.stop() for e in engines))
        for t in exits:
            t.cancel()
    if failed:
        print(f"sim engine {model}: failed at start (fault fail_at_start)", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = argv_parser().parse_args(argv)
    try:
        params = parse_params(args.params_json)
        EngineCore(params)  # validates the values the wire type leaves open
    except ValidationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.count < 1:
        print("error: --count must be >= 1", file=sys.stderr)
        return 2
    try:
        tls = server_tls(args.ssl_certfile, args.ssl_keyfile)
    except (OSError, ssl.SSLError) as exc:
        print(f"error: --ssl-certfile/--ssl-keyfile: {exc}", file=sys.stderr)
        return 2
    try:
        # The agent passes the replica's engine key in the environment, never
        # in argv (world-readable in /proc).
        api_key = os.environ.get(ENGINE_KEY_ENV[EngineKind.SIM]) or None
        return run(serve(args.model, params, args.host, args.port, args.count, api_key, tls))
    except OSError as exc:
        print(
            f"error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 1
