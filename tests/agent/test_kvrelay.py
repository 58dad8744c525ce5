"""The guard's KV-events relay: a real ZeroMQ PUB on an ipc socket, the guard on loopback.

What must hold: the events reach a follower only past the key check, in
order, framed as llmgw.kvstream says; a follower that stops reading is cut
off instead of growing the guard's memory; every other request (the relay's
look-alike paths too) is still the engine's. The last test runs the guard's
own process with ``--kv-events``, as the agent starts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from llmgw import kvstream
from llmgw.agent.engineguard import GUARD_KEY_ENV, GUARD_MODULE, EngineGuard
from llmgw.agent.kvrelay import KvRelay, private_dir, socket_path

KEY = "engine-key-0123456789abcdefghijklmnopqrstu"


@pytest.fixture
def endpoint() -> Iterator[str]:
    # Not tmp_path: a socket path must stay under 108 bytes.
    folder = Path(tempfile.mkdtemp(prefix="kv-"))
    try:
        yield f"ipc://{folder}/events"
    finally:
        for child in folder.iterdir():
            child.unlink()
        folder.rmdir()


class Engine:
    """A stand-in engine: answers any HTTP request with its request line, publishes events."""

    def __init__(self, endpoint: str) -> None:
        self.pub = zmq.asyncio.Context.instance().socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(endpoint)  # as vLLM binds an ipc endpoint
        self.seen: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            line = head.split(b"\r\n", 1)[0]
            self.seen.append(line)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                         % (len(line), line))  # fmt: skip
            await writer.drain()
            writer.close()

        self.server = await asyncio.start_server(answer, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def send(self, seq: int, payload: bytes) -> None:
        await self.pub.send_multipart([b"", seq.to_bytes(8, "big", signed=True), payload])

    def close(self) -> None:
        self.pub.close(0)
        if self.server is not None:
            self.server.close()


@contextlib.asynccontextmanager
async def guarded(
    endpoint: str, **relay: int | float
) -> AsyncIterator[tuple[Engine, KvRelay, int]]:
    engine = Engine(endpoint)
    await engine.start()
    kv = KvRelay(endpoint, **relay)  # type: ignore[arg-type]
    guard = EngineGuard(KEY, "127.0.0.1", engine.port, relay=kv)
    port = await guard.start("127.0.0.1", 0)
    try:
        yield engine, kv, port
    finally:
        guard.close()
        engine.close()


def request(path: str = kvstream.PATH, key: str | None = KEY) -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key is not None else ""
    return f"GET {path} HTTP/1.1\r\nHost: engine\r\n{auth}\r\n".encode()


async def follow(
    port: int, key: str | None = KEY
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request(key=key))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    return reader, writer, head


async def message(reader: asyncio.StreamReader, *, beats: bool = False) -> list[bytes]:
    """The next message on the stream (heartbeats skipped unless ``beats``)."""
    while True:
        count = kvstream.read_u32(await reader.readexactly(4))
        frames = []
        for _ in range(count):
            length = kvstream.read_u32(await reader.readexactly(4))
            frames.append(await reader.readexactly(length))
        if frames or beats:
            return frames


async def joined(engine: Engine, reader: asyncio.StreamReader) -> None:
    """Publish warm-ups until one comes through (a ZeroMQ subscription takes a
    moment to reach the publisher), then read the rest of them."""
    for _ in range(200):
        await engine.send(-1, b"warm-up")
        try:
            async with asyncio.timeout(0.05):
                await message(reader)
            break
        except TimeoutError:
            continue
    else:
        raise AssertionError("the relay never passed a message on")
    with contextlib.suppress(TimeoutError):
        while True:
            async with asyncio.timeout(0.3):
                await message(reader)


async def test_frames_arrive_in_order_behind_the_key(endpoint: str) -> None:
    async with guarded(endpoint) as (engine, _, port):
        reader, writer, head = await follow(port)
        assert head == kvstream.ANSWER_HEAD
        await joined(engine, reader)
        for seq in range(50):
            await engine.send(seq, b"payload %d" % seq)
        got = [await asyncio.wait_for(message(reader), 5) for _ in range(50)]
        assert got == [[b"", seq.to_bytes(8, "big"), b"payload %d" % seq] for seq in range(50)]
        assert engine.seen == []  # the guard answered it; the engine saw nothing
        writer.close()


@pytest.mark.parametrize("key", [None, "wrong-key-0123456789abcdefghijklmnopq", KEY.upper()])
async def test_a_missing_or_wrong_key_gets_401_and_nothing_streamed(
    endpoint: str, key: str | None
) -> None:
    async with guarded(endpoint) as (engine, relay, port):
        reader, writer, head = await follow(port, key)
        assert head.startswith(b"HTTP/1.1 401 ")
        for seq in range(20):
            await engine.send(seq, b"secret tokens")
            await asyncio.sleep(0.01)
        rest = await asyncio.wait_for(reader.read(), 5)
        assert b"secret" not in rest and rest.endswith(b"}")  # the JSON error, then the close
        assert relay.followers == set() and engine.seen == []
        writer.close()


async def test_a_follower_that_stops_reading_is_cut_off_and_the_others_go_on(
    endpoint: str,
) -> None:
    async with guarded(endpoint, buffer_bytes=256 << 10) as (engine, relay, port):
        # A follower that never reads, with a small receive buffer.
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.connect(("127.0.0.1", port))
        slow.sendall(request())
        reader, writer, _ = await follow(port)
        await joined(engine, reader)
        assert len(relay.followers) == 2
        big = os.urandom(64 << 10)

        async def read_all() -> int:
            seqs: list[int] = []
            while len(seqs) < 100:
                frames = await message(reader)
                if frames[2] != b"warm-up":
                    seqs.append(int.from_bytes(frames[1], "big"))
            assert seqs == list(range(100))
            return len(seqs)

        task = asyncio.get_running_loop().create_task(read_all())
        for seq in range(100):
            await engine.send(seq, big)
            await asyncio.sleep(0.002)
        assert await asyncio.wait_for(task, 10) == 100
        assert relay.cut_off == 1 and len(relay.followers) == 1
        # The slow one's connection is gone: what it reads ends.
        slow.settimeout(5)
        with contextlib.suppress(ConnectionResetError):
            while slow.recv(1 << 20):
                pass
        slow.close()
        writer.close()


@pytest.mark.parametrize(
    "path", ["/v1/models", f"{kvstream.PATH}/x", f"{kvstream.PATH}?from=0", "/llmgw/kv-event"]
)
async def test_every_other_path_is_still_the_engines(endpoint: str, path: str) -> None:
    async with guarded(endpoint) as (engine, relay, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request(path))
        answer = await asyncio.wait_for(reader.read(), 5)
        line = f"GET {path} HTTP/1.1".encode()
        assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(line)
        assert engine.seen == [line] and relay.followers == set()
        writer.close()


async def test_a_guard_without_events_splices_the_path_to_the_engine(endpoint: str) -> None:
    engine = Engine(endpoint)
    await engine.start()
    guard = EngineGuard(KEY, "127.0.0.1", engine.port)
    port = await guard.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request())
        answer = await asyncio.wait_for(reader.read(), 5)
        assert answer.endswith(kvstream.REQUEST_LINE) and engine.seen == [kvstream.REQUEST_LINE]
        writer.close()
    finally:
        guard.close()
        engine.close()


async def test_an_idle_engine_is_heard_as_heartbeats(endpoint: str) -> None:
    async with guarded(endpoint, heartbeat_s=0.05) as (_, _, port):
        reader, writer, _ = await follow(port)
        assert await asyncio.wait_for(message(reader, beats=True), 5) == []
        writer.close()


def test_the_events_socket_must_be_ipc_and_short() -> None:
    for bad in ("tcp://*:5557", "tcp://127.0.0.1:5557", "ipc://relative", "inproc://x",
                "ipc:///" + "d" * 120 + "/events"):  # fmt: skip
        with pytest.raises(ValueError):
            KvRelay(bad)
    assert socket_path("ipc:///run/x/events") == Path("/run/x/events")


def test_the_private_dir_is_made_owner_only_and_never_taken_over(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/kv/events"
    folder = private_dir(endpoint, None)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    with pytest.raises(FileExistsError):  # made first by someone else: refused
        private_dir(endpoint, None)


async def test_the_guards_process_relays_its_engines_events(endpoint: str) -> None:
    """``python -m llmgw.agent.engineguard --kv-events``: the directory is the guard's (0700),
    the engine binds its socket in it, the stream comes through the guard, and the guard
    takes the directory away when the engine ends."""
    folder = socket_path(endpoint).parent
    folder.rmdir()  # the guard makes it, and refuses one that exists
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    program = (
        "import sys, time, zmq\n"
        "pub = zmq.Context.instance().socket(zmq.PUB)\n"
        "pub.bind(sys.argv[1])\n"
        "for seq in range(600):\n"
        "    pub.send_multipart([b'', seq.to_bytes(8, 'big'), b'batch'])\n"
        "    time.sleep(0.01)\n"
    )
    env = {**os.environ, GUARD_KEY_ENV: KEY}
    guard = await asyncio.create_subprocess_exec(
        sys.executable, "-m", GUARD_MODULE, "--host", "127.0.0.1", "--port", str(port),
        "--engine-port", "9", "--kv-events", endpoint, "--",
        sys.executable, "-c", program, endpoint,
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        for _ in range(100):
            with contextlib.suppress(OSError):
                reader, writer, head = await follow(port)
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the guard never listened")
        assert head == kvstream.ANSWER_HEAD
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == os.getuid()
        first = await asyncio.wait_for(message(reader), 10)
        second = await asyncio.wait_for(message(reader), 5)
        assert first[2] == b"batch"
        assert int.from_bytes(second[1], "big") == int.from_bytes(first[1], "big") + 1
        writer.close()
    finally:
        os.killpg(guard.pid, signal.SIGTERM)  # as the agent stops an engine: its group
        async with asyncio.timeout(20):
            out, _ = await guard.communicate()
    assert not folder.exists(), out.decode(errors="replace")
    folder.mkdir()  # for the fixture's clean-up
