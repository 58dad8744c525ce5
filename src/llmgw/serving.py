"""How an llmgw process runs: its event loop, and a uvicorn server started inside it.

Every process (``serve``, ``up``, a standalone gateway, the sim engines) and
the tests and benchmarks that serve an app in-process take the same two
steps here: copies drift (one waits forever for a server whose task already
died on a taken port).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import uvicorn

T = TypeVar("T")

# How often to look whether uvicorn listens yet: it offers no event to wait
# on, and a start takes a few milliseconds.
_POLL_S = 0.01
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class ServerNotStarted(RuntimeError):
    """uvicorn's task ended without raising and without listening (it logs why)."""


def stop_signals() -> tuple[asyncio.Event, Callable[[], None]]:
    """An event SIGINT or SIGTERM sets, and what takes the handlers off again.

    A long-running command stops on its own terms (its engines, agents and
    servers in order) rather than by Python's KeyboardInterrupt or uvicorn's
    own handlers; once the handlers are off, a second Ctrl-C interrupts as usual.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in _STOP_SIGNALS:
        with contextlib.suppress(NotImplementedError):  # no signal handlers on Windows
            loop.add_signal_handler(sig, stop.set)

    def remove() -> None:
        for sig in _STOP_SIGNALS:
            with contextlib.suppress(NotImplementedError):
                loop.remove_signal_handler(sig)

    return stop, remove


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on a fresh loop: uvloop's where installed (it roughly halves the
    event loop's share of the per-request cost on the hot path), asyncio's otherwise."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(main)
    return uvloop.run(main)


async def start_server(
    server: uvicorn.Server, sockets: list[socket.socket] | None = None
) -> asyncio.Task[None]:
    """Start ``server`` in a task on the running loop and return the task once it listens.

    A server that cannot start (a taken port) ends its task early: what it
    raised is raised here, or :class:`ServerNotStarted` when it raised
    nothing, rather than waiting for a start that never comes.
    """
    task = asyncio.create_task(server.serve(sockets=sockets))
    while not server.started:
        if task.done():
            task.result()
            raise ServerNotStarted("the HTTP server stopped before it listened")
        await asyncio.sleep(_POLL_S)
    return task
