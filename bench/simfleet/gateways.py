"""The gateways' process: gateways with fixed configs, each on a loopback port of its own.

Imported only in that process: the benchmark's own process, the load
generator, keeps the gateway's modules out of its memory and its
collector's sight.
"""

from __future__ import annotations

import asyncio
import signal
import socket

import uvicorn
import uvloop

from llmgw import wire
from llmgw.gateway.app import Gateway, freeze_startup_objects
from llmgw.gateway.link import MemoryLink
from llmgw.gateway.settings import GatewaySettings
from llmgw.http.server import server_config
from llmgw.serving import start_server
from simfleet.children import GATEWAY_MARKER

GatewaySpec = tuple[wire.GatewayConfig, GatewaySettings]


def run(specs: list[GatewaySpec]) -> int:
    """Serve ``specs`` until SIGINT or SIGTERM; the exit status."""
    uvloop.run(serve(specs))
    return 0


async def serve(specs: list[GatewaySpec]) -> None:
    """One gateway per (config, settings), each announced on stdout once it accepts.

    The lines come in the order of ``specs`` (children.read_urls reads them).
    """
    configs = []
    gateways = []
    for config, settings in specs:
        link = MemoryLink(config, poll_timeout_s=3600)  # the config never changes
        gateway = Gateway(link, settings)
        await gateway.start()
        if not await gateway.wait_configured(10.0):
            raise RuntimeError("gateway got no config")
        # What `llmgw gateway` serves with: llmgw's own HTTP protocol, and
        # its modules loaded before the freeze below. With plain uvicorn and
        # Python's collector settings, this process measured another server
        # than users run, with collections of 0.2-1.7 ms a few times a
        # stage where llmgw's settings make them rare.
        served = server_config(gateway, log_level="warning", timeout_keep_alive=75)
        served.load()
        configs.append(served)
        gateways.append(gateway)
    freeze_startup_objects()  # once every gateway is up: what start-up made lives on
    servers = []
    for served in configs:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(served)
        servers.append((server, await start_server(server, [sock])))
        port = sock.getsockname()[1]
        print(f"{GATEWAY_MARKER} http://127.0.0.1:{port}/v1", flush=True)
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopped.set)
    await stopped.wait()
    for server, _ in servers:
        server.should_exit = True
    await asyncio.gather(*(t for _, t in servers), return_exceptions=True)
    for gateway in gateways:
        await gateway.stop()
