"""The guard in front of an engine: no route answers without the replica's engine key.

Engines guard only some of their routes with their API key (vLLM: paths
under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``, while ``POST
/invocations``, ``/pooling``, ``/score`` ... run for anyone; llama_cpp.server
and llama-server: their OpenAI routes only), and a route a new engine
version mounts is open until someone notices. So an engine the agent starts
listens on loopback only, on a port of its own, and the agent puts this
forwarder on the replica's advertised address: it reads each new
connection's first request head (bounded in size and time), answers 401 and
closes unless it carries ``Authorization: Bearer <engine key>`` (compared in
constant time), and from then on copies bytes both ways for the life of the
connection. Whatever the engine mounts, today or in a later version, is
behind the key, because the guard never looks at the path.

One check per connection, not per request: the gateway keeps its
connections to an engine open, and a connection that proved the key once is
the gateway's, whatever it sends next. Nothing of a request is rewritten
(the key goes on to the engine, which keeps checking it where it can: a
second lock against a local user of the node, who could reach the loopback
port). The guard also terminates TLS under the node's certificate, so every
engine is https where the fleet runs TLS, those without TLS flags included;
a renewed certificate is taken up by the next connection.

One request the guard answers itself: where the engine publishes its
KV-cache events (``--kv-events``), a checked connection whose first request
is exactly ``GET /llmgw/kv-events`` gets the events stream
(agent.kvrelay, llmgw.kvstream); any other path, that one's look-alikes
included, is the engine's. The key check comes first, as for every route.

The guard is a process of its own that starts the engine as its child
(``python -m llmgw.agent.engineguard --host H --port P --engine-port E --
ENGINE ARGV``; agent.guardlaunch builds the command), not a part of the agent:
an engine outlives its agent (adoption, agent.state) and must keep serving
while the agent restarts, and the guard's copying never waits behind
the agent's (or, under ``llmgw up``, the gateway's) event loop. To the
agent the pair is one engine: the guard leads the process group the
agent signals (a stop reaches both), stays in it with the engine (one
memory budget), and ends as the engine ended (its exit code, or the
signal that killed it), so the agent's supervision reads the engine
through it unchanged. An engine whose guard dies gets SIGTERM
(``PR_SET_PDEATHSIG``): nothing of it is left unguarded. The guard takes the
key from its environment (``LLMGW_GUARD_KEY``, never argv) and removes it
before the engine starts.

Everything is plain asyncio protocols (no streams, no tasks per connection
once it is spliced): a chunk from one side is written to the other from the
callback that received it, and a side whose reader is slower than its
writer pauses the other side's reads (transport flow control).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import pwd
import signal
import ssl
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from llmgw.agent.guardchild import engine_start
from llmgw.agent.guardhead import (
    BAD_GATEWAY,
    HEAD_TIMEOUT,
    HEAD_TOO_LARGE,
    UNAUTHORIZED,
    Answer,
    authorized,
)
from llmgw.agent.guardtls import CertFiles, ServerTls, TlsFiles
from llmgw.agent.kvrelay import KvRelay, private_dir, remove_dir

# What the guard process imports is kept to the standard library and llmgw
# modules that import only it (its resident memory is counted in the
# engine's budget); pyzmq too where the engine publishes its KV-cache
# events, imported by the relay only then.

log = logging.getLogger("llmgw.agent.engineguard")

# A gateway's request head is a few hundred bytes; 16 KiB holds long
# headers and is still nothing to buffer per connection.
HEAD_LIMIT = 16 * 1024
HEAD_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 5.0
# How long a refused connection is kept to drain (see _Inbound._answer_and_close).
LINGER_S = 1.0

_HEAD_END = b"\r\n\r\n"


@dataclass
class GuardStats:
    accepted: int = 0
    refused: int = 0  # 401, 408 and 431 answers
    unreachable: int = 0  # 502 answers


GUARD_MODULE = "llmgw.agent.engineguard"
GUARD_KEY_ENV = "LLMGW_GUARD_KEY"


class EngineGuard:
    """One replica's guard: listens on the advertised address, forwards to ``upstream``."""

    def __init__(
        self,
        key: str,
        upstream_host: str,
        upstream_port: int,
        *,
        tls: TlsFiles | None = None,
        head_limit: int = HEAD_LIMIT,
        head_timeout_s: float = HEAD_TIMEOUT_S,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        relay: KvRelay | None = None,
    ) -> None:
        if not key:
            raise ValueError("an engine guard needs a key")
        self.key = key.encode()
        self.upstream = (upstream_host, upstream_port)
        self.head_limit = head_limit
        self.head_timeout_s = head_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.stats = GuardStats()
        self._tls = ServerTls(tls) if tls is not None else None
        self._server: asyncio.Server | None = None
        self._open: set[_Inbound] = set()
        # The engine's KV-cache events (agent.kvrelay), answered past the key check.
        self.relay = relay

    @property
    def tls(self) -> bool:
        return self._tls is not None

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: any free port); the port bound."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Inbound(self), host, port,
            ssl=self._tls.context if self._tls is not None else None,
            reuse_address=True,
        )
        if self.relay is not None:
            self.relay.start()
        sockets = self._server.sockets
        return int(sockets[0].getsockname()[1]) if sockets else port

    def close(self) -> None:
        """Stop listening and cut every connection (the engine behind it is going away)."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        if self.relay is not None:
            self.relay.close()
        for conn in list(self._open):
            conn.abort()

    @property
    def connections(self) -> int:
        return len(self._open)


class _Outbound(asyncio.Protocol):
    """The guard's connection to the engine, for one authenticated client connection."""

    __slots__ = ("inbound", "transport")

    def __init__(self, inbound: _Inbound) -> None:
        self.inbound = inbound
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        client = self.inbound.transport
        if client is not None:
            client.write(data)

    def eof_received(self) -> bool:
        return self.inbound.peer_eof(client_side=False)

    def pause_writing(self) -> None:
        self.inbound.pause_reading()

    def resume_writing(self) -> None:
        self.inbound.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.inbound.close()


class _Inbound(asyncio.Protocol):
    """One client connection: its first head checked, then spliced to the engine."""

    def __init__(self, guard: EngineGuard) -> None:
        self.guard = guard
        self.transport: asyncio.Transport | None = None
        self.outbound: _Outbound | None = None
        self.head = bytearray()
        self.checked = False
        self.closed = False
        self.eofs = 0
        self.draining = False  # answered and refused: what comes is dropped
        self.timer: asyncio.TimerHandle | None = None

    # -- the client side -------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        guard = self.guard
        guard._open.add(self)
        if guard._tls is not None:
            guard._tls.maybe_reload()
        self.timer = asyncio.get_running_loop().call_later(
            guard.head_timeout_s, self._refuse, HEAD_TIMEOUT
        )

    def data_received(self, data: bytes) -> None:
        outbound = self.outbound
        if outbound is not None and outbound.transport is not None:
            outbound.transport.write(data)
            return
        if self.draining:
            return
        if self.checked:  # authenticated, the engine's connection still opening
            self.head += data
            return
        start = max(0, len(self.head) - 3)
        self.head += data
        end = self.head.find(_HEAD_END, start)
        if end < 0:
            if len(self.head) > self.guard.head_limit:
                self._refuse(HEAD_TOO_LARGE)
            return
        if end > self.guard.head_limit or not authorized(bytes(self.head[:end]), self.guard.key):
            self._refuse(HEAD_TOO_LARGE if end > self.guard.head_limit else UNAUTHORIZED)
            return
        self.checked = True
        self._cancel_timer()
        self.guard.stats.accepted += 1
        relay = self.guard.relay
        if relay is not None and relay.wants(self.head):
            self.draining = True  # what the follower sends after its request is dropped
            self.head = bytearray()
            relay.follow(self)
            return
        # Nothing more is read until the engine's side is open: what came
        # already waits in ``head``, and the client's next bytes wait in its socket.
        self.pause_reading()
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        host, port = self.guard.upstream
        try:
            async with asyncio.timeout(self.guard.connect_timeout_s):
                _, outbound = await loop.create_connection(lambda: _Outbound(self), host, port)
        except (OSError, TimeoutError):
            self.guard.stats.unreachable += 1
            self._answer_and_close(BAD_GATEWAY)
            return
        if self.closed or outbound.transport is None:
            if outbound.transport is not None:
                outbound.transport.close()
            return
        self.outbound = outbound
        outbound.transport.write(bytes(self.head))
        self.head = bytearray()
        if self.eofs:  # the client had half-closed already
            self._write_eof(outbound.transport)
        self.resume_reading()

    def eof_received(self) -> bool:
        if self.outbound is None:
            if not self.checked or self.draining:
                self.close()
                return False
            self.eofs += 1  # passed on once the engine's side is open
            return True
        return self.peer_eof(client_side=True)

    def pause_writing(self) -> None:
        if self.outbound is not None and self.outbound.transport is not None:
            self.outbound.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.outbound is not None and self.outbound.transport is not None:
            self.outbound.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.close()

    # -- both sides --------------------------------------------------------------

    def peer_eof(self, *, client_side: bool) -> bool:
        """One side sent its last byte: pass the half-close on; close once both did."""
        self.eofs += 1
        other = (
            (self.outbound.transport if self.outbound is not None else None)
            if client_side else self.transport
        )
        if self.eofs >= 2 or other is None or not other.can_write_eof():
            self.close()
            return False
        self._write_eof(other)
        return True

    @staticmethod
    def _write_eof(transport: asyncio.Transport) -> None:
        if transport.can_write_eof():
            with contextlib.suppress(OSError, RuntimeError):
                transport.write_eof()

    def pause_reading(self) -> None:
        if self.transport is not None and not self.closed:
            with contextlib.suppress(RuntimeError):
                self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.closed:
            with contextlib.suppress(RuntimeError):
                self.transport.resume_reading()

    def _refuse(self, answer: Answer) -> None:
        self.guard.stats.refused += 1
        self._answer_and_close(answer)

    def _answer_and_close(self, answer: Answer) -> None:
        """Answer, then close once the client had a moment to read it.

        Closing a socket with unread bytes in it sends a reset, which may
        reach the client before the answer does: the rest of what it sends
        (a body behind a refused head) is read and dropped for a second.
        """
        transport = self.transport
        if transport is None or self.closed or self.draining:
            return
        transport.write(answer.to(self.head))
        self._cancel_timer()
        if not transport.can_write_eof():
            self.close()
            return
        self.draining = True
        with contextlib.suppress(OSError, RuntimeError):
            transport.write_eof()
        self.resume_reading()
        self.timer = asyncio.get_running_loop().call_later(LINGER_S, self.close)

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def close(self) -> None:
        """Close both sides, each after what it was already given is sent."""
        if not self.closed:
            self._end(abort=False)

    def abort(self) -> None:
        """Drop both sides now, whatever is still unsent."""
        self._end(abort=True)

    def _end(self, *, abort: bool) -> None:
        self.closed = True
        self._cancel_timer()
        self.guard._open.discard(self)
        outbound = self.outbound.transport if self.outbound is not None else None
        for transport in (self.transport, outbound):
            if transport is None:
                continue
            if abort:
                transport.abort()
            else:
                transport.close()


# -- the guard's process ------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m {GUARD_MODULE}",
        description="Start an engine on loopback behind a guard that wants its key "
        f"(from ${GUARD_KEY_ENV}) on every connection.",
    )
    parser.add_argument("--host", required=True, help="where the guard listens")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--engine-port", type=int, required=True, help="the engine's, on loopback")
    parser.add_argument("--tls-cert", default=None)
    parser.add_argument("--tls-key", default=None)
    parser.add_argument("--kv-events", default=None, metavar="ipc:///DIR/SOCKET",
                        help="relay the engine's KV-cache events from here (DIR is created 0700)")
    parser.add_argument("--engine-user", default=None,
                        help="start the engine under this user (the guard stays as it is)")
    parser.add_argument("engine", nargs=argparse.REMAINDER, help="-- the engine's command")
    return parser


async def _serve(args: argparse.Namespace, key: str, engine: list[str]) -> int:
    tls = CertFiles(args.tls_cert, args.tls_key) if args.tls_cert and args.tls_key else None
    try:
        relay = KvRelay(args.kv_events) if args.kv_events else None
        guard = EngineGuard(key, "127.0.0.1", args.engine_port, tls=tls, relay=relay)
        await guard.start(args.host, args.port)
    except (OSError, ssl.SSLError, ValueError) as exc:
        print(f"engine guard: cannot start on {args.host}:{args.port}: {exc}", flush=True)
        return 1
    loop = asyncio.get_running_loop()
    # The agent stops the engine by signalling the whole group: the guard
    # waits for the engine to end and ends with it. (A handler, not SIG_IGN,
    # which the engine would inherit.)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, lambda: None)
    try:
        user = pwd.getpwnam(args.engine_user) if args.engine_user else None
    except KeyError:
        print(f"engine guard: no user {args.engine_user!r} to run the engine as", flush=True)
        guard.close()
        return 126
    try:
        events_dir = private_dir(relay.endpoint, user) if relay is not None else None
    except OSError as exc:
        print(f"engine guard: no private directory for the engine's events: {exc}", flush=True)
        guard.close()
        return 1
    try:
        return await _run_engine(args, engine, user)
    finally:
        guard.close()
        if events_dir is not None:
            remove_dir(events_dir)


async def _run_engine(
    args: argparse.Namespace, engine: list[str], user: pwd.struct_passwd | None
) -> int:
    """Start the engine and wait for its end: its exit code (127, 126: it never started)."""
    try:
        child = await asyncio.create_subprocess_exec(
            *engine, stdin=subprocess.DEVNULL, preexec_fn=engine_start(user)
        )
    except FileNotFoundError:
        print(f"{engine[0]} not found: is this engine installed on the node?", flush=True)
        return 127
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"cannot start {engine[0]}: {exc}", flush=True)
        return 126
    print(f"engine guard: {args.host}:{args.port} -> 127.0.0.1:{args.engine_port}"
          f" (engine pid {child.pid})", flush=True)
    return await child.wait()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    engine = list(args.engine)
    if engine[:1] == ["--"]:
        engine = engine[1:]
    key = os.environ.pop(GUARD_KEY_ENV, "")
    if not engine or not key:
        print(f"engine guard: needs the engine's command after -- and ${GUARD_KEY_ENV}",
              file=sys.stderr)
        return 2
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        code = asyncio.run(_serve(args, key, engine))
    else:
        code = uvloop.run(_serve(args, key, engine))
    if code < 0:
        # Killed by a signal: end by the same one, so the agent reads the
        # engine's end (an OOM kill, say) from the guard's exit status.
        with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main())
