"""``llmgw up --gateway-workers N``: N gateway processes on a port of their own, next to ``up``.

``up``'s own gateway runs in its process, on the control plane's port, and
sees the routing table in memory. Its workers cannot: each is a standalone
``llmgw gateway`` worker (llmgw.cli.workers) following this control plane
over loopback, as any gateway on another machine would, with a gateway
token made for them at start that lives only in this process's memory
(``Credentials.process_gateway_token``): it stops working with ``up``, and
no operator ever sees or rotates it. They listen on ``--gateway-port``
(the control plane's port serves the admin API and the console besides
``/v1``, which a worker does not); ``up.json``'s ``api_url`` then names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys

from llmgw.cli.workers import WorkerPool
from llmgw.control.plane import ControlPlane
from llmgw.servertls import ServerTls

log = logging.getLogger(__name__)

# How often the parent looks for a dead worker to restart.
_CHECK_S = 0.2


class GatewayWorkers:
    """The running pool and the task that supervises it."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self._task = asyncio.get_running_loop().create_task(self._supervise(),
                                                             name="gateway-workers")

    async def _supervise(self) -> None:
        # Polled: a child's exit has no event on the loop without a child
        # watcher of its own, and a fifth of a second is soon enough.
        while True:
            if not self.pool.check():
                break
            await asyncio.sleep(_CHECK_S)
        log.error("gateway workers stopped (a worker refused its configuration); "
                  "the API stays on the control plane's port")

    async def stop(self) -> None:
        """Stop every worker (each finishes its requests and flushes its usage first)."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await asyncio.to_thread(self.pool.stop)


def start_gateway_workers(
    cp: ControlPlane, control_plane_url: str, host: str, port: int, count: int,
    tls: ServerTls | None, *, insecure_http: bool = False,
    allow_key_env: frozenset[str] = frozenset(), metrics_open: bool = False,
) -> GatewayWorkers:
    """Bind ``host:port`` and start ``count`` gateway workers following ``control_plane_url``."""
    forwarded = [
        "--control-plane", control_plane_url, "--host", host, "--port", str(port),
        "--workers", str(count), "--log-level", "warning",
        *(["--open-metrics"] if metrics_open else []),
        *(["--insecure-http"] if insecure_http else []),
        *[arg for name in sorted(allow_key_env) for arg in ("--allow-key-env", name)],
        # The control plane's certificate serves the workers' port too (same host).
        *(["--tls-cert", str(tls.cert_file), "--tls-key", str(tls.key_file)] if tls else []),
        *(["--ca-file", str(tls.ca_file)] if tls and tls.ca_file else []),
    ]

    def command(index: int, listen_fd: int, lifeline_fd: int) -> list[str]:
        return [sys.executable, "-m", "llmgw.cli.main", "gateway", *forwarded,
                "--worker-index", str(index), "--listen-fd", str(listen_fd),
                "--lifeline-fd", str(lifeline_fd)]

    env = {k: v for k, v in os.environ.items() if k != "LLMGW_GATEWAY_TOKEN_FILE"}
    env["LLMGW_GATEWAY_TOKEN"] = cp.credentials.process_gateway_token()
    pool = WorkerPool(host, port, count, command, env)
    pool.start()
    return GatewayWorkers(pool)
