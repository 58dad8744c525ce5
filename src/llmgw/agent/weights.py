"""The node's weights cache: what it holds, and getting what it lacks.

Layout under ``<data_dir>/weights``::

    <key>/meta.json       the entry: model, source, files with size and sha256
    <key>/...             the files themselves
    .tmp/<key>-<random>/  a fetch in progress (or an evicted entry being deleted)
    last-used.json        when each entry was last used (:mod:`llmgw.agent.lastuse`)

An entry exists only once its directory has been renamed from ``.tmp`` with
its ``meta.json`` inside, after every file was verified. A rename is atomic,
so a full disk, a killed download or a crash leaves at most a staging
directory, which the next start removes -- never a half model that an engine
would load and fail on minutes later.

The key is the model name plus a digest of its source: a catalog change of
repo, revision or file gives a new entry instead of silently serving the old
weights.

A fetch whose size is known asks for disk room first (:mod:`llmgw.agent.diskroom`)
and may evict entries to get it. Replicas *hold* the entry they run on from
their start until they stop or fail; held entries, entries being fetched and
operator-given local paths are never evicted.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import secrets
import shutil
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import aiohttp

from llmgw.agent import diskroom, fetchers, trust
from llmgw.agent.diskroom import DiskReserve, NotEnoughDisk, RoomCheck, Unused, size_text
from llmgw.agent.lastuse import LastUse
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
from llmgw.agent.trust import TamperedWeights, mismatches
from llmgw.wire import ModelSpec, WeightsDigests, WeightsEntry

__all__ = [
    "CacheEntry",
    "DiskReserve",
    "FileDigest",
    "NotEnoughDisk",
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
LAST_USED = "last-used.json"
# Sources whose weights live in the cache (and so may be evicted); "local"
# paths are the operator's and "none" has nothing.
CACHED_KINDS = frozenset({"hf", "package"})


class WeightsCache:
    """One node's cache; ``ensure`` makes a model's weights local, at most once at a time."""

    def __init__(
        self,
        root: Path,
        *,
        hf_endpoint: str | None = None,
        peer_timeout_s: float = 30.0,
        reserve: DiskReserve | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = root
        self.hf_endpoint = hf_endpoint
        self.peer_timeout_s = peer_timeout_s
        self.reserve = reserve or DiskReserve()
        self._locks: dict[str, asyncio.Lock] = {}
        self._local: dict[str, WeightsEntry] = {}
        self._holds: Counter[str] = Counter()
        # staging dir name -> (expected size, its progress): bytes promised
        # to fetches in flight, so two fetches do not both count the same room.
        self._pending: dict[str, tuple[int, Progress]] = {}
        self._room_lock = asyncio.Lock()
        self._last_use = LastUse(root / LAST_USED, clock)
        # model -> the control plane's record of its weights (every answer
        # replaces it); a model missing here is trusted as fetched.
        self._trusted: dict[str, WeightsDigests] = {}
        # Copies refused since the last report, for the control plane's events.
        self._refusals: list[str] = []

    # -- what the weights must be ------------------------------------------------

    def trust(self, digests: Mapping[str, WeightsDigests]) -> None:
        """Take the control plane's record of each model's weights (from a report answer)."""
        self._trusted = dict(digests)

    def take_refusals(self) -> list[str]:
        """The refusals since the last call (a report carries them once)."""
        out, self._refusals = self._refusals[-64:], []
        return out

    def _expected(self, spec: ModelSpec) -> WeightsDigests | None:
        record = self._trusted.get(spec.name)
        # A record of another source is an answer older than the catalog.
        return record if record is not None and record.source == spec.weights else None

    def _refuse(self, exc: WeightsError) -> None:
        log.warning("%s", exc)
        self._refusals.append(str(exc))

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
                source=e.source,
            )
            for d, e in self.all_entries()
        ]
        cached = {w.model for w in out}
        out.extend(w for m, w in sorted(self._local.items()) if m not in cached)
        return out

    # -- in use ------------------------------------------------------------------

    def hold(self, spec: ModelSpec) -> str | None:
        """Mark the model's cached weights in use (a replica starting or running).

        Returns the key to ``release``; None for weights the cache does not keep.
        """
        if spec.weights.kind not in CACHED_KINDS:
            return None
        key = cache_key(spec.name, spec.weights)
        self._holds[key] += 1
        return key

    def release(self, key: str) -> None:
        """One holder let go; the last one makes the entry evictable, as used now."""
        self._holds[key] -= 1
        if self._holds[key] <= 0:
            del self._holds[key]
            if (self.root / key).is_dir():
                self._last_use.mark(key)

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
            expected = self._expected(spec)
            if found is not None and expected is not None:
                found = await self._recheck(spec, key, expected)
            if found is None:
                found = await self._fetch(spec, key, progress, peers, peer_token, session)
            self._last_use.mark(key)
            return str(found)

    async def _recheck(self, spec: ModelSpec, key: str, expected: WeightsDigests) -> Path | None:
        """The cached entry if it matches the record; else it is evicted (None).

        An entry cached before the control plane had a record (or copied
        from a peer it no longer trusts) is held to the record like a fresh
        copy; its meta.json digests were taken from the bytes it wrote.
        """
        key_dir = self.root / key
        entry = self._read(key_dir)
        if entry is None:
            return None
        problems = await asyncio.to_thread(mismatches, entry, expected, key_dir)
        if not problems:
            return key_dir / entry.entry
        self._refuse(TamperedWeights(
            f"cached weights of {spec.name!r} do not match the digests recorded from"
            f" {expected.origin} ({'; '.join(problems[:5])}); deleted, fetching again"
        ))
        await self._evict(
            Unused(key=key, model=spec.name, size_bytes=entry.size_bytes,
                   last_used=entry.created_at),
            spec.name,
        )
        return None

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

        async def room(need: int) -> None:
            await self._make_room(spec.name, staging.name, need, progress)

        try:
            staging.mkdir(parents=True, mode=0o700)
            entry: CacheEntry | None = None
            problems: list[str] = []
            expected = self._expected(spec)

            def verify(copy: CacheEntry, where: str) -> None:
                if expected is not None:
                    trust.check(copy, expected, staging, where)

            if peers and peer_token and session is not None:
                try:
                    entry = await fetchers.from_peers(
                        spec,
                        staging,
                        peers,
                        peer_token,
                        session,
                        progress,
                        problems,
                        timeout_s=self.peer_timeout_s,
                        room=room,
                        verify=verify,
                    )
                except TamperedWeights as exc:
                    # Deleted, and fetched again from the origin: a peer that
                    # served one bad copy is not asked again for this one.
                    self._refuse(exc)
                    problems.append(str(exc))
                    await asyncio.to_thread(fetchers.empty_dir, staging)
            if entry is None:
                try:
                    entry = await fetchers.from_origin(
                        spec, staging, progress, self.hf_endpoint, room=room
                    )
                    await asyncio.to_thread(verify, entry, "the origin")
                except NotEnoughDisk:
                    raise  # the peers' troubles are beside the point
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
            self._pending.pop(staging.name, None)
            shutil.rmtree(staging, ignore_errors=True)

    # -- disk room ---------------------------------------------------------------

    async def _make_room(self, model: str, staging: str, need: int, progress: Progress) -> None:
        """Room for ``need`` more bytes, evicting unused weights; or NotEnoughDisk."""
        # One check at a time: two fetches deciding together would both count
        # the same free bytes, or evict for room the other already took.
        async with self._room_lock:
            check = self._room_check(model, staging, need)
            victims = check.victims()
            if victims is None:
                raise NotEnoughDisk(check.refusal())
            for victim in victims:
                await self._evict(victim, model)
            self._pending[staging] = (need, progress)

    def _room_check(self, model: str, staging: str, need: int) -> RoomCheck:
        self.root.mkdir(parents=True, exist_ok=True)
        space = diskroom.disk_space(self.root)
        pending = sum(
            max(size - p.done, 0) for name, (size, p) in self._pending.items() if name != staging
        )
        return RoomCheck(
            model=model,
            where=self.root,
            need=need,
            space=space,
            reserve=self.reserve.bytes_of(space.total),
            pending=pending,
            unused=self._unused(),
        )

    def _unused(self) -> list[Unused]:
        busy = set(self._holds) | {k for k, lock in self._locks.items() if lock.locked()}
        # An operator may point a "local" source into the cache; those files
        # are theirs to remove, not ours.
        local = [Path(w.path).resolve() for w in self._local.values() if w.path]
        out = []
        for key_dir, entry in self.all_entries():
            if key_dir.name in busy:
                continue
            if any(p.is_relative_to(key_dir.resolve()) for p in local):
                continue
            out.append(
                Unused(
                    key=key_dir.name,
                    model=entry.model,
                    size_bytes=entry.size_bytes,
                    last_used=self._last_use.get(key_dir.name, entry.created_at),
                )
            )
        return out

    async def _evict(self, victim: Unused, for_model: str) -> None:
        doomed = self.root / STAGING / f"evicted-{victim.key}-{secrets.token_hex(4)}"
        try:
            doomed.parent.mkdir(parents=True, exist_ok=True)
            # A rename first: lookups, peers and reports stop seeing the entry
            # at once, and a crash mid-delete leaves only staging to clean.
            os.rename(self.root / victim.key, doomed)
        except OSError as exc:
            raise WeightsError(
                f"cannot evict weights of {victim.model!r} to make room for {for_model!r}: {exc}"
            ) from None
        self._last_use.forget(victim.key)
        log.warning(
            "evicted weights of %r (%s, last used %s) to make room for %r",
            victim.model,
            size_text(victim.size_bytes),
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(victim.last_used)),
            for_model,
        )
        await asyncio.to_thread(shutil.rmtree, doomed, True)


def weights_size(path: str | None) -> int | None:
    """Bytes of a weights file, or of every file under a weights directory."""
    if path is None:
        return None
    try:
        if os.path.isfile(path):
            return os.path.getsize(path)
        return sum(
            os.path.getsize(os.path.join(root, name))
            for root, _, names in os.walk(path)
            for name in names
        )
    except OSError:
        return None
