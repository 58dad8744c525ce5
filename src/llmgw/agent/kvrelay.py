"""An engine's KV-cache events, relayed by its guard behind the engine key.

vLLM publishes its KV-cache events (``--kv-events-config``) on a ZeroMQ PUB
socket that checks no key, and the events carry the token ids of every
prompt the replica caches. So the engine publishes on the node only, on an
``ipc://`` socket in a directory of its own that only the agent's user (and
the engine's) can open, and its guard, the one process that subscribes,
relays the events to whoever passed the guard's key check with
``GET /llmgw/kv-events`` (llmgw.kvstream: the path and the framing).

Why ipc and not a loopback port: vLLM binds an ipc endpoint (and a
wildcard tcp one) and *connects* to any other tcp address
(ZmqEventPublisher._is_bind_endpoint in vllm/distributed/kv_events.py). A
wildcard bind is every interface, the hole this closes. A loopback port
would have the guard bind a SUB for the engine's PUB to connect to: any
local user could then connect a PUB of their own and feed the gateway
invented blocks, and take the port while the guard restarts. A socket file
in a 0700 directory is refused to every other user by the kernel.

One subscription per engine, however many gateways follow: a thread reads
the SUB socket (blocking, so it works under any event loop), and the loop
writes each message, encoded once, to every follower's transport. A
follower whose unsent bytes pass :data:`FOLLOWER_BUFFER` is cut off rather
than let the guard's memory grow (the engine's budget counts it): its
gateway reconnects, sees the gap in the sequence numbers, and reads the
cache anew. Standard library and pyzmq only; pyzmq is imported only by a
guard whose engine publishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pwd
import shutil
import threading
from pathlib import Path
from typing import Protocol

from llmgw import kvstream

log = logging.getLogger("llmgw.agent.kvrelay")

# Unsent bytes one follower may hold in the guard: a few seconds of a busy
# engine's events. A gateway that reads slower than the engine publishes
# would otherwise make the guard buffer the engine's whole history.
FOLLOWER_BUFFER = 4 << 20
# Messages the SUB socket holds for the relay thread (ZeroMQ drops past it,
# and the sequence gap tells the followers).
RECEIVE_HWM = 100_000
_POLL_MS = 250
# sockaddr_un's path holds 107 bytes and its terminator.
_SOCKET_PATH_MAX = 107


class Transport(Protocol):
    def write(self, data: bytes) -> None: ...

    def is_closing(self) -> bool: ...

    def get_write_buffer_size(self) -> int: ...


class Follower(Protocol):
    """A connection the guard checked (engineguard._Inbound) that asked for the events."""

    @property
    def transport(self) -> Transport | None: ...

    def abort(self) -> None: ...


def socket_path(endpoint: str) -> Path:
    """The socket file of an ``ipc://`` endpoint, checked: absolute, short enough."""
    if not endpoint.startswith("ipc:///"):
        raise ValueError(f"the events endpoint {endpoint!r} is not ipc:///PATH (an engine's "
                         "events stay on its node)")  # fmt: skip
    path = endpoint.removeprefix("ipc://")
    if len(path.encode()) > _SOCKET_PATH_MAX:
        raise ValueError(f"the events socket {path!r} is longer than a socket path may be")
    return Path(path)


def private_dir(endpoint: str, user: pwd.struct_passwd | None) -> Path:
    """Create the directory of ``endpoint``'s socket, 0700, the engine user's where it has one.

    Created here, not found: a directory that already exists (someone made
    it first to read the socket) is refused (FileExistsError).
    """
    folder = socket_path(endpoint).parent
    folder.mkdir(mode=0o700)
    if user is not None:
        # The engine binds the socket in it; the guard (root, to start the
        # engine as another user) connects all the same.
        os.chown(folder, user.pw_uid, user.pw_gid)
    return folder


def remove_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        shutil.rmtree(folder)


class KvRelay:
    """One engine's events, fanned out to the followers the guard hands it."""

    def __init__(
        self, endpoint: str, *, buffer_bytes: int = FOLLOWER_BUFFER,
        heartbeat_s: float = kvstream.HEARTBEAT_S,
    ) -> None:  # fmt: skip
        socket_path(endpoint)  # refused (ValueError) before anything starts
        self.endpoint = endpoint
        self.buffer_bytes = buffer_bytes
        self.heartbeat_s = heartbeat_s
        self.followers: set[Follower] = set()
        self.messages = 0
        self.cut_off = 0  # followers closed for falling behind
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beat: asyncio.TimerHandle | None = None

    @staticmethod
    def wants(head: bytes | bytearray) -> bool:
        """Whether a checked request head is the relay's: exactly ``GET /llmgw/kv-events``."""
        return head.startswith(kvstream.REQUEST_LINE + b"\r\n")

    def start(self) -> None:
        """Subscribe (the engine may bind its socket later: ZeroMQ connects when it does)."""
        import zmq

        loop = self._loop = asyncio.get_running_loop()
        context = zmq.Context()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        sub.connect(self.endpoint)

        def pull() -> None:
            try:
                while not self._stop.is_set():
                    if not sub.poll(_POLL_MS):
                        continue
                    frames = sub.recv_multipart()
                    loop.call_soon_threadsafe(self.publish, frames)
            except (zmq.ZMQError, RuntimeError) as exc:  # RuntimeError: the loop closed
                if not self._stop.is_set():
                    log.warning("kv events from %s: %s", self.endpoint, exc)
            finally:
                sub.close(0)
                context.term()

        self._thread = threading.Thread(target=pull, name="kv-events-relay", daemon=True)
        self._thread.start()
        self._beat = loop.call_later(self.heartbeat_s, self._heartbeat)

    def follow(self, follower: Follower) -> None:
        """Answer ``follower``'s request (its key checked) and send it every message from now."""
        transport = follower.transport
        if transport is None or transport.is_closing():
            return
        transport.write(kvstream.ANSWER_HEAD)
        self.followers.add(follower)

    def publish(self, frames: list[bytes]) -> None:
        self.messages += 1
        self._send(kvstream.encode(frames))

    def _heartbeat(self) -> None:
        self._send(kvstream.HEARTBEAT)
        if self._loop is not None and not self._stop.is_set():
            self._beat = self._loop.call_later(self.heartbeat_s, self._heartbeat)

    def _send(self, data: bytes) -> None:
        for follower in list(self.followers):
            transport = follower.transport
            if transport is None or transport.is_closing():
                self.followers.discard(follower)
                continue
            transport.write(data)
            if transport.get_write_buffer_size() > self.buffer_bytes:
                self.cut_off += 1
                self.followers.discard(follower)
                follower.abort()

    def close(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.cancel()
            self._beat = None
        for follower in list(self.followers):
            follower.abort()
        self.followers.clear()
        if self._thread is not None:
            self._thread.join(timeout=2 * _POLL_MS / 1000)
            self._thread = None
