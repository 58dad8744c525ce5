"""Weights as the cache and its peers describe them: files with size and sha256.

A fetched model is trusted only through these digests: the peer that sends
it, the disk that stores it and the network in between can each corrupt it,
and an engine that loads a corrupt file fails minutes later with an error
that names none of them.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from llmgw.errors import EngineError
from llmgw.wire import DownloadProgress, WeightsSource

META = "meta.json"
HASH_BLOCK = 4 * 1024 * 1024


class WeightsError(EngineError):
    """Weights could not be fetched or verified; the message says which and why."""


class FileDigest(BaseModel):
    path: str  # relative, "/"-separated
    size: int
    sha256: str


class CacheEntry(BaseModel):
    """``meta.json``; also the manifest a peer serves (without ``created_at``)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    source: WeightsSource
    # What an engine is given, relative to the entry: a file (a .gguf) or ".".
    entry: str = "."
    files: list[FileDigest] = Field(default_factory=list)
    created_at: float = 0.0

    @property
    def size_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def sha256(self) -> str:
        """One file: its own digest; several: a digest of the sorted file list."""
        if len(self.files) == 1:
            return self.files[0].sha256
        lines = "".join(f"{f.sha256}  {f.size}  {f.path}\n" for f in sorted(self.files, key=_path))
        return hashlib.sha256(lines.encode()).hexdigest()


def _path(item: FileDigest) -> str:
    return item.path


def cache_key(model: str, source: WeightsSource) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", model)[:80]
    digest = hashlib.sha256(source.model_dump_json().encode()).hexdigest()[:12]
    return f"{safe}-{digest}"


def safe_relative(path: str) -> str:
    """A manifest path that stays inside the entry, or WeightsError."""
    parts = path.split("/")
    if (
        not path
        or path.startswith("/")
        or "\\" in path
        or "\x00" in path
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise WeightsError(f"refusing weights file path {path!r}")
    return path


class Progress:
    """Bytes, rate and ETA of one fetch, as ReplicaStatus.download shows them."""

    def __init__(self, total: int | None = None) -> None:
        self.total = total
        self.done = 0
        self._started = time.monotonic()

    def restart(self, total: int | None) -> None:
        self.total = total
        self.done = 0
        self._started = time.monotonic()

    def snapshot(self) -> DownloadProgress:
        elapsed = max(time.monotonic() - self._started, 1e-6)
        rate = self.done / elapsed
        eta = None
        if self.total is not None and rate > 0:
            eta = max(self.total - self.done, 0) / rate
        return DownloadProgress(
            bytes_done=self.done, bytes_total=self.total, rate_bps=rate, eta_s=eta
        )

    def percent(self) -> str:
        if not self.total:
            return f"{self.done / 1e6:.0f} MB"
        return f"{100 * self.done / self.total:.0f} %"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def digest_tree(root: Path) -> list[FileDigest]:
    out = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != META):
        rel = path.relative_to(root).as_posix()
        out.append(FileDigest(path=rel, size=path.stat().st_size, sha256=sha256_file(path)))
    return out


def tree_size(root: Path) -> int:
    total = 0
    for path in root.rglob("*"):
        try:
            if path.is_file():
                total += path.stat().st_size
        except OSError:
            continue
    return total


def manifest_json(entry: CacheEntry) -> bytes:
    return json.dumps(entry.model_dump(exclude={"created_at"}, mode="json")).encode()
