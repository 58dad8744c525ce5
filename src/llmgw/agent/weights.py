"""The node's weights cache: what it holds, and getting what it lacks.

Layout under ``<data_dir>/weights``::

    <key>/meta.json       the entry: model, source, files with size and sha256
    <key>/...             the files themselves
    .tmp/<key>-<random>/  a fetch in progress

An entry exists only once its directory has been renamed from ``.tmp`` with
its ``meta.json`` inside, after every file was verified. A rename is atomic,
so a full disk, a killed download or a crash leaves at most a staging
directory, which the next start removes -- never a half model that an engine
would load and fail on minutes later.

The key is the model name plus a digest of its source: a catalog change of
repo, revision or file gives a new entry instead of silently serving the old
weights.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import secrets
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from llmgw.agent import fetchers
from llmgw.agent.manifest import (
    META,
    CacheEntry,
    FileDigest,
    Progress,
    WeightsError,
    cache_key,
    digest_tree,
    manifest_json,
    sha256_file,
    tree_size,
)
from llmgw.wire import ModelSpec, WeightsEntry

__all__ = [
    "CacheEntry",
    "FileDigest",
    "Progress",
    "WeightsCache",
    "WeightsError",
    "cache_key",
    "digest_tree",
    "manifest_json",
    "sha256_file",
]

log = logging.getLogger("llmgw.agent.weights")

STAGING = ".tmp"


class WeightsCache:
    """One node's cache; ``ensure`` makes a model's weights local, at most once at a time."""

    def __init__(
        self,
        root: Path,
        *,
        hf_endpoint: str | None = None,
        peer_timeout_s: float = 30.0,
    ) -> None:
        self.root = root
        self.hf_endpoint = hf_endpoint
        self.peer_timeout_s = peer_timeout_s
        self._locks: dict[str, asyncio.Lock] = {}
        self._local: dict[str, WeightsEntry] = {}

    # -- what the cache holds ------------------------------------------------

    def clean_partial(self) -> None:
        """Remove fetches a previous run left unfinished (killed, crashed, disk full)."""
        shutil.rmtree(self.root / STAGING, ignore_errors=True)

    def _read(self, key_dir: Path) -> CacheEntry | None:
        try:
            return CacheEntry.model_validate_json((key_dir / META).read_bytes())
        except (OSError, ValueError):
            return None

    def all_entries(self) -> list[tuple[Path, CacheEntry]]:
        found = []
        try:
            children = sorted(self.root.iterdir())
        except OSError:
            return []
        for child in children:
            if child.name == STAGING or not child.is_dir():
                continue
            entry = self._read(child)
            if entry is not None:
                found.append((child, entry))
        return found

    def lookup(self, spec: ModelSpec) -> Path | None:
        key_dir = self.root / cache_key(spec.name, spec.weights)
        entry = self._read(key_dir)
        return None if entry is None else key_dir / entry.entry

    def latest(self, model: str) -> tuple[Path, CacheEntry] | None:
        """The newest complete entry of ``model``, for peers asking for it."""
        held = [(d, e) for d, e in self.all_entries() if e.model == model]
        return max(held, key=lambda item: item[1].created_at, default=None)

    def report(self) -> list[WeightsEntry]:
        out = [
            WeightsEntry(
                model=e.model,
                revision=e.source.revision,
                size_bytes=e.size_bytes,
                sha256=e.sha256,
                path=str(d / e.entry),
            )
            for d, e in self.all_entries()
        ]
        cached = {w.model for w in out}
        out.extend(w for m, w in sorted(self._local.items()) if m not in cached)
        return out

    # -- getting weights -----------------------------------------------------

    async def ensure(
        self,
        spec: ModelSpec,
        *,
        progress: Progress,
        peers: Sequence[str] = (),
        peer_token: str | None = None,
        session: aiohttp.ClientSession | None = None,
    ) -> str | None:
        """A local path for the model's weights (None for engines without any)."""
        source = spec.weights
        if source.kind == "none":
            return None
        if source.kind == "local":
            return self._local_path(spec)
        key = cache_key(spec.name, source)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:  # two replicas of one model on one node fetch once
            found = self.lookup(spec)
            if found is not None:
                return str(found)
            return str(await self._fetch(spec, key, progress, peers, peer_token, session))

    def _local_path(self, spec: ModelSpec) -> str:
        path = Path(spec.weights.path or "")
        if source_file := spec.weights.file:
            path = path / source_file
        if not path.exists():
            raise WeightsError(f"weights path {path} does not exist on this node")
        size = path.stat().st_size if path.is_file() else tree_size(path)
        self._local[spec.name] = WeightsEntry(
            model=spec.name, revision=spec.weights.revision, size_bytes=size, path=str(path)
        )
        return str(path)

    async def _fetch(
        self,
        spec: ModelSpec,
        key: str,
        progress: Progress,
        peers: Sequence[str],
        peer_token: str | None,
        session: aiohttp.ClientSession | None,
    ) -> Path:
        staging = self.root / STAGING / f"{key}-{secrets.token_hex(4)}"
        try:
            staging.mkdir(parents=True, mode=0o700)
            entry: CacheEntry | None = None
            problems: list[str] = []
            if peers and peer_token and session is not None:
                entry = await fetchers.from_peers(
                    spec,
                    staging,
                    peers,
                    peer_token,
                    session,
                    progress,
                    problems,
                    timeout_s=self.peer_timeout_s,
                )
            if entry is None:
                try:
                    entry = await fetchers.from_origin(spec, staging, progress, self.hf_endpoint)
                except WeightsError as exc:
                    if problems:
                        raise WeightsError(
                            f"{exc}; peers failed too: {'; '.join(problems)}"
                        ) from None
                    raise
            entry.created_at = time.time()
            (staging / META).write_text(entry.model_dump_json(indent=1))
            target = self.root / key
            try:
                os.rename(staging, target)
            except OSError:
                if self._read(target) is None:
                    raise
                # Another process finished the same model first: keep its copy.
            final = self._read(target)
            if final is None:
                raise WeightsError(f"weights of {spec.name} vanished after download")
            return target / final.entry
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise WeightsError(
                    f"no space left on the device while fetching weights of {spec.name!r}"
                ) from None
            raise WeightsError(f"cannot store weights of {spec.name!r}: {exc}") from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
